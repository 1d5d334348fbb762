// The 4-, 5- and 6-bit blocks' share of a quantized GEMV row (block_quant.wgsl's layouts):
// `unit_load(row, x, v)` issues the loads of the row's unit v (VW values) and of the same
// columns of q8 input vector x; `unit_dot` multiplies them with dot4I8Packed (dot16), so
// that a lane can have several units' loads in flight. Used by the one-token GEMV
// (gemv.wgsl, x = 0) and the routed experts' (expert_gemv.wgsl, x = the token or choice);
// the including shader gives the input's accessors `x_q(i)` (16-byte words, KP/16 per
// vector) and `x_d(i)` (block scales, KP/32 per vector) and `col_scale(k)`.

#if W_Q4_0
// Block v of the row: its nibbles widened to bytes 16·(q − 8) (block_quant.wgsl's
// `q4_bytes`). `unit_load` issues its loads, `unit_dot` uses them (so a lane can have
// several blocks' loads in flight).
struct Unit {
    q: vec4<u32>,
    x0: vec4<u32>,
    x1: vec4<u32>,
    d: u32,
    xs: f32,
}

fn unit_load(row: u32, x: u32, v: u32) -> Unit {
    let si = row * (KP / 32u) + v;
    let xo = x * (KP / 16u);
    return Unit(w[si], x_q(xo + 2u * v), x_q(xo + 2u * v + 1u), ws[si / 2u], x_d(x * (KP / 32u) + v));
}

fn unit_dot(l: Unit, row: u32, v: u32) -> f32 {
    let b = q4_bytes(l.q);
    let idot = dot16(b[0], l.x0) + dot16(b[1], l.x1);
    let si = row * (KP / 32u) + v;
    let d = unpack2x16float(l.d)[si % 2u];
    return f32(idot) * (d * 0.0625 * l.xs * col_scale(v * 32u));
}
#endif

#if W_Q4_1
// Block v of the row: the nibbles are levels 0…15 of d·q + m, so the block's product is
// d·Σq·x + m·Σx (Σx from a dot product with ones, as the k-quants' mins take it).
struct Unit {
    q: vec4<u32>,
    x0: vec4<u32>,
    x1: vec4<u32>,
    dm: u32,
    xs: f32,
}

fn unit_load(row: u32, x: u32, v: u32) -> Unit {
    let si = row * (KP / 32u) + v;
    let xo = x * (KP / 16u);
    return Unit(w[si], x_q(xo + 2u * v), x_q(xo + 2u * v + 1u), ws[si], x_d(x * (KP / 32u) + v));
}

fn unit_dot(l: Unit, row: u32, v: u32) -> f32 {
    let n = vec4<u32>(0x0F0F0F0Fu);
    let ones = vec4<u32>(0x01010101u);
    let idot = dot16(l.q & n, l.x0) + dot16((l.q >> vec4<u32>(4u)) & n, l.x1);
    let isum = dot16(ones, l.x0) + dot16(ones, l.x1);
    let dm = unpack2x16float(l.dm);
    return (dm.x * f32(idot) + dm.y * f32(isum)) * (l.xs * col_scale(v * 32u));
}
#endif

#if W_Q5
// Block v of the row: q4_0's nibbles with each value's fifth bit from qh (bit j, for
// value j), widened by block_quant.wgsl's `q5_bytes` (W_Q5_0: bytes 8·(q − 16)) or
// `q5_levels` (W_Q5_1: levels 0…31 of d·q + m, multiplied as W_Q4_1's).
struct Unit {
    q: vec4<u32>,
    x0: vec4<u32>,
    x1: vec4<u32>,
    s: vec2<u32>,
    xs: f32,
}

fn unit_load(row: u32, x: u32, v: u32) -> Unit {
    let si = row * (KP / 32u) + v;
    let xo = x * (KP / 16u);
    return Unit(w[si], x_q(xo + 2u * v), x_q(xo + 2u * v + 1u), ws[si], x_d(x * (KP / 32u) + v));
}

#if W_Q5_0
fn unit_dot(l: Unit, row: u32, v: u32) -> f32 {
    let b = q5_bytes(l.q, l.s.x);
    let idot = dot16(b[0], l.x0) + dot16(b[1], l.x1);
    let d = unpack2x16float(l.s.y).x;
    return f32(idot) * (d * 0.125 * l.xs * col_scale(v * 32u));
}
#endif

#if W_Q5_1
fn unit_dot(l: Unit, row: u32, v: u32) -> f32 {
    let ones = vec4<u32>(0x01010101u);
    let b = q5_levels(l.q, l.s.x);
    let idot = dot16(b[0], l.x0) + dot16(b[1], l.x1);
    let isum = dot16(ones, l.x0) + dot16(ones, l.x1);
    let dm = unpack2x16float(l.s.y);
    return (dm.x * f32(idot) + dm.y * f32(isum)) * (l.xs * col_scale(v * 32u));
}
#endif
#endif

#if W_K4
// 16 quant bytes of a superblock: low nibbles are 16 values of sub-block 2j, high nibbles
// 16 of sub-block 2j+1 (j = c/2, the half h = c%2 of their 32). W_Q5_K adds each value's
// fifth bit from the superblock's qh bytes 16h…16h+16 (bit 2j for sub-block 2j, 2j+1 for
// 2j+1): levels 0…31 are still positive int8.
struct Unit {
    q: vec4<u32>,
    qh: vec4<u32>,
    x0: vec4<u32>,
    x1: vec4<u32>,
    sv: vec4<u32>,
    xd0: f32,
    xd1: f32,
}

fn unit_load(row: u32, x: u32, v: u32) -> Unit {
    let sb = row * (KP / 256u) + v / 8u;
    let c = v % 8u;
    let h = c % 2u;
    let b0 = (v / 8u) * 8u + 2u * (c / 2u);
#if W_Q5_K
    let qh = w[sb * K4_DV + 8u + h];
#else
    let qh = vec4<u32>(0u);
#endif
    let xo = x * (KP / 16u);
    let xdo = x * (KP / 32u);
    return Unit(w[sb * K4_DV + c], qh, x_q(xo + 2u * b0 + h), x_q(xo + 2u * b0 + 2u + h), ws[sb], x_d(xdo + b0), x_d(xdo + b0 + 1u));
}

fn unit_dot(l: Unit, row: u32, v: u32) -> f32 {
    let c = v % 8u;
    let j = c / 2u;
    let ones = vec4<u32>(0x01010101u);
    var lo = l.q & vec4<u32>(0x0F0F0F0Fu);
    var hi = (l.q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
#if W_Q5_K
    lo |= ((l.qh >> vec4<u32>(2u * j)) & ones) << vec4<u32>(4u);
    hi |= ((l.qh >> vec4<u32>(2u * j + 1u)) & ones) << vec4<u32>(4u);
#endif
    let b0 = (v / 8u) * 8u + 2u * j;
    let dm = unpack2x16float(l.sv.x);
    let s0 = k4_scale_min(l.sv, 2u * j);
    let s1 = k4_scale_min(l.sv, 2u * j + 1u);
    let p0 = dm.x * s0.x * f32(dot16(lo, l.x0)) - dm.y * s0.y * f32(dot16(ones, l.x0));
    let p1 = dm.x * s1.x * f32(dot16(hi, l.x1)) - dm.y * s1.y * f32(dot16(ones, l.x1));
    return p0 * (l.xd0 * col_scale(b0 * 32u)) + p1 * (l.xd1 * col_scale(b0 * 32u + 32u));
}
#endif

#if W_Q6_K
// 64 values of a superblock: half n, l = 16h…16h+16 of each of its four quarters t (ql
// nibbles of two 16-byte runs, two bits each of one qh run); (q ^ 32) << 2 is 4·(q − 32).
struct Unit {
    qa: vec4<u32>,
    qb: vec4<u32>,
    qh: vec4<u32>,
    d: u32,
    sw: vec2<u32>,
    x0: vec4<u32>,
    x1: vec4<u32>,
    x2: vec4<u32>,
    x3: vec4<u32>,
    xs: vec4<f32>,
}

fn unit_load(row: u32, x: u32, v: u32) -> Unit {
    let sbr = v / 4u;
    let sb = row * (KP / 256u) + sbr;
    let n = (v % 4u) / 2u;
    let h = v % 2u;
    let base = sb * 12u;
    // The quarters' blocks b = sbr·8 + 4n + t.
    let b = sbr * 8u + 4u * n;
    let xo = x * (KP / 16u);
    let xdo = x * (KP / 32u);
    return Unit(
        w[base + 4u * n + h],
        w[base + 4u * n + 2u + h],
        w[base + 8u + 2u * n + h],
        ws[sb * 5u + 4u],
        // The i8 scales 8n + 2t + h of the four quarters: bytes h and h+2 of words 2n, 2n+1.
        vec2<u32>(ws[sb * 5u + 2u * n], ws[sb * 5u + 2u * n + 1u]),
        x_q(xo + 2u * b + h),
        x_q(xo + 2u * (b + 1u) + h),
        x_q(xo + 2u * (b + 2u) + h),
        x_q(xo + 2u * (b + 3u) + h),
        vec4<f32>(x_d(xdo + b), x_d(xdo + b + 1u), x_d(xdo + b + 2u), x_d(xdo + b + 3u)),
    );
}

fn unit_dot(l: Unit, row: u32, v: u32) -> f32 {
    let sbr = v / 4u;
    let n = (v % 4u) / 2u;
    let h = v % 2u;
    let m4 = vec4<u32>(0x0F0F0F0Fu);
    let m2 = vec4<u32>(0x03030303u);
    let d = unpack2x16float(l.d).x * 0.25;
    let xv = array<vec4<u32>, 4>(l.x0, l.x1, l.x2, l.x3);
    var acc = 0.0;
    // (Straight-line quarters: every index below is a constant.)
#for t 4
    {
        let t = {t}u;
        var nib = l.qa;
        if (t % 2u == 1u) {
            nib = l.qb;
        }
        let q = ((nib >> vec4<u32>(4u * (t / 2u))) & m4) | (((l.qh >> vec4<u32>(2u * t)) & m2) << vec4<u32>(4u));
        let s = ((q ^ vec4<u32>(0x20202020u)) << vec4<u32>(2u)) & vec4<u32>(0xFCFCFCFCu);
        let b = sbr * 8u + 4u * n + t;
        let sbyte = (l.sw[t / 2u] >> (8u * (h + 2u * (t % 2u)))) & 0xFFu;
        let sc = f32(bitcast<i32>(sbyte << 24u) >> 24u);
        acc += f32(dot16(s, xv[{t}])) * (sc * l.xs[{t}] * col_scale(b * 32u));
    }
#endfor
    return acc * d;
}
#endif

