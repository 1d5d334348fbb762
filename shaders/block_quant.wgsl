// The pair decoder `half2` of the 16-bit float formats (W_HALF: W_F16 or W_BF16; their
// binding is the including shader's), and the 4-, 5- and 6-bit block formats (W_BLOCK) in
// the device layout `model::quant` describes (ggml's blocks split into quants and scales):
// bindings 0 (quants, 16-byte vectors) and 1 (scales), and `bq_weights8`, eight
// consecutive weights of a row dequantized the way ggml does (what the GEMM tiles and the
// embedding gather read; the GEMV takes integer dot products instead). Needs KP (a whole
// number of blocks).
//   W_Q4_0: 32-value blocks; data 16 B (value j = nibble j/16 of byte j%16, d·(q−8));
//           scales: d, two f16 per word.
//   W_Q4_1: 32-value blocks; data 16 B as W_Q4_0's; scales one word per block: d (low
//           half), m (high half), d·q + m.
//   W_Q5 (W_Q5_0, W_Q5_1): 32-value blocks; data 16 B as W_Q4_0's (the low four bits);
//           scales one vec2 per block: qh (bit j: the fifth bit of value j), then d (low
//           half) and m (high half; zero for W_Q5_0): d·(q−16) for W_Q5_0, d·q + m for W_Q5_1.
//   W_K4 (W_Q4_K, W_Q5_K): 256-value superblocks; data qs[128] (sub-block s = nibble
//           s%2 of bytes 32·(s/2)…+32), for W_Q5_K then qh[32] (bit s of byte l: the fifth
//           bit of value l of sub-block s); scales one 16-byte vector: d|dmin, then 12
//           bytes of 6-bit scales and mins (bound as vec4 words).
//   W_Q6_K: 256-value superblocks; data ql[128] qh[64] (48 words), scales 5 words:
//           sixteen i8 scales, then d.

// Values per unit of the quantized GEMVs' rows (gemv_units.wgsl: one block, or q6_k's
// quarter superblock; the GEMV kernels give the float formats and q8_0 theirs).
#if W_BLOCK
#if W_Q6_K
const VW: u32 = 64u;
#else
const VW: u32 = 32u;
#endif

// The low nibbles of values j … j+8 of a 32-value block's 16 quant bytes `v` (q4_0, q4_1
// and the q5s' low four bits: value j is nibble j/16 of byte j%16), one per byte: two words.
fn b32_nibbles8(v: vec4<u32>, j: u32) -> vec2<u32> {
    let sh = (j / 16u) * 4u;
    let wi = (j % 16u) / 4u;
    return vec2<u32>((v[wi] >> sh) & 0x0F0F0F0Fu, (v[wi + 1u] >> sh) & 0x0F0F0F0Fu);
}
#endif

#if W_F16
fn half2(u: u32) -> vec2<f32> {
    return unpack2x16float(u);
}
#endif

#if W_BF16
// bf16: the top half of an f32, two per word (low half first).
fn half2(u: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(u << 16u), bitcast<f32>(u & 0xFFFF0000u));
}
#endif

#if W_Q4_0
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;

// The 32 values of a block (quants `q`) as int8 bytes 16·(q − 8): values 0…15 (the low
// nibbles) then 16…31. Nibbles q ^ 8 are q − 8 in 4-bit two's complement; at the top of a
// byte they read as 16·(q − 8). What the GEMVs' integer dot products take.
fn q4_bytes(q: vec4<u32>) -> array<vec4<u32>, 2> {
    let s = q ^ vec4<u32>(0x88888888u);
    let lo = (s << vec4<u32>(4u)) & vec4<u32>(0xF0F0F0F0u);
    let hi = s & vec4<u32>(0xF0F0F0F0u);
    return array<vec4<u32>, 2>(lo, hi);
}

fn bq_weights8(row: u32, k0: u32) -> array<f32, 8> {
    let blk = row * (KP / 32u) + k0 / 32u;
    let d = unpack2x16float(ws[blk / 2u])[blk % 2u];
    let q = b32_nibbles8(w[blk], k0 % 32u);
    let a = (vec4<f32>(unpack4xU8(q.x)) - 8.0) * d;
    let b = (vec4<f32>(unpack4xU8(q.y)) - 8.0) * d;
    return array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
}
#endif

#if W_Q4_1
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;

fn bq_weights8(row: u32, k0: u32) -> array<f32, 8> {
    let blk = row * (KP / 32u) + k0 / 32u;
    let dm = unpack2x16float(ws[blk]);
    let q = b32_nibbles8(w[blk], k0 % 32u);
    let a = vec4<f32>(unpack4xU8(q.x)) * dm.x + dm.y;
    let b = vec4<f32>(unpack4xU8(q.y)) * dm.x + dm.y;
    return array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
}
#endif

#if W_Q5
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ws: array<vec2<u32>>;

// Four fifth bits (bits 0…3 of `h`) moved to bit 4 of the four bytes of a word: one
// multiply puts copies of h at bits 0, 7, 14 and 21 (no two overlap, so nothing carries)
// and the mask keeps bit i of the copy at 8·i.
fn q5_spread4(h: u32) -> u32 {
    return (((h & 15u) * 0x00204081u) & 0x01010101u) << 4u;
}

// The 32 bits of `hv`, each at bit 0 of a byte in the order of a block's values: values
// 0…15 (the low nibbles' bytes), then 16…31 (the high ones'); q5_spread4's multiply.
fn q5_fifth(hv: u32) -> array<vec4<u32>, 2> {
    let h = vec4<u32>(hv);
    let m = vec4<u32>(0x00204081u);
    let b = vec4<u32>(0x01010101u);
    let lo = (((h >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u)) * m) & b;
    let hi = (((h >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u)) * m) & b;
    return array<vec4<u32>, 2>(lo, hi);
}

#if W_Q5_0
// The 32 values of a block (quants `q`, fifth bits `hv`) as int8 bytes 8·(q − 16): values
// 0…15 (the low nibbles) then 16…31 (the high ones). 8·(q − 16) in an int8 is (q ^ 16) << 3,
// that is the nibble << 3 with the inverted fifth bit at bit 7. What the GEMVs' integer
// dot products take.
fn q5_bytes(q: vec4<u32>, hv: u32) -> array<vec4<u32>, 2> {
    let f = q5_fifth(~hv);
    let n = vec4<u32>(0x0F0F0F0Fu);
    let lo = ((q & n) << vec4<u32>(3u)) | (f[0] << vec4<u32>(7u));
    let hi = (((q >> vec4<u32>(4u)) & n) << vec4<u32>(3u)) | (f[1] << vec4<u32>(7u));
    return array<vec4<u32>, 2>(lo, hi);
}
#endif

#if W_Q5_1
// The 32 values of a block (quants `q`, fifth bits `hv`) as their levels 0…31, one byte
// each (positive int8s), in q5_bytes' order.
fn q5_levels(q: vec4<u32>, hv: u32) -> array<vec4<u32>, 2> {
    let f = q5_fifth(hv);
    let n = vec4<u32>(0x0F0F0F0Fu);
    let lo = (q & n) | (f[0] << vec4<u32>(4u));
    let hi = ((q >> vec4<u32>(4u)) & n) | (f[1] << vec4<u32>(4u));
    return array<vec4<u32>, 2>(lo, hi);
}
#endif

fn bq_weights8(row: u32, k0: u32) -> array<f32, 8> {
    let blk = row * (KP / 32u) + k0 / 32u;
    let s = ws[blk];
    let dm = unpack2x16float(s.y);
    let j = k0 % 32u;
    let q = b32_nibbles8(w[blk], j);
    // Their fifth bits: bits j … j+8 of qh.
    let h = s.x >> j;
    let qa = vec4<f32>(unpack4xU8(q.x | q5_spread4(h & 15u)));
    let qb = vec4<f32>(unpack4xU8(q.y | q5_spread4((h >> 4u) & 15u)));
#if W_Q5_0
    let a = (qa - 16.0) * dm.x;
    let b = (qb - 16.0) * dm.x;
#else
    let a = qa * dm.x + dm.y;
    let b = qb * dm.x + dm.y;
#endif
    return array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
}
#endif

#if W_K4
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
// One 16-byte vector per superblock: d|dmin, then the 12 scale bytes.
@group(0) @binding(1) var<storage, read> ws: array<vec4<u32>>;

#if W_Q5_K
const K4_DV: u32 = 10u; // 16-byte data vectors per superblock: qs, qh
#else
const K4_DV: u32 = 8u; // qs
#endif

// (scale, min) of sub-block j of superblock scales `s` (ggml's get_scale_min_k4, on words:
// bytes 0…3 hold the low 6 bits of scales 0…3, bytes 4…7 of mins 0…3; sub-blocks 4…7 take
// their low 4 bits from bytes 8…11 and their top 2 from the top bits of bytes 0…7).
fn k4_scale_min(s: vec4<u32>, j: u32) -> vec2<f32> {
    let i = 8u * (j % 4u);
    let lo = vec2<u32>((s.y >> i) & 63u, (s.z >> i) & 63u);
    let b = s.w >> i;
    let sc = (b & 0xFu) | ((((s.y >> i) >> 6u) & 3u) << 4u);
    let m = ((b >> 4u) & 0xFu) | ((((s.z >> i) >> 6u) & 3u) << 4u);
    let hi = vec2<u32>(sc, m);
    return vec2<f32>(select(hi, lo, j < 4u));
}

fn bq_weights8(row: u32, k0: u32) -> array<f32, 8> {
    let sb = row * (KP / 256u) + k0 / 256u;
    let e = k0 % 256u;
    let j = e / 32u;
    let l = e % 32u;
    let s = ws[sb];
    let dm = unpack2x16float(s.x);
    let sm = k4_scale_min(s, j);
    let dl = dm.x * sm.x;
    let ml = dm.y * sm.y;
    // qs bytes 32·(j/2) + l … +8, nibble j%2 (W_Q5_K: qh bytes l … +8, bit j).
    let qs = sb * 4u * K4_DV + (32u * (j / 2u) + l) / 4u;
    let sh = (j % 2u) * 4u;
    var qa = (bq_word(qs) >> sh) & 0x0F0F0F0Fu;
    var qb = (bq_word(qs + 1u) >> sh) & 0x0F0F0F0Fu;
#if W_Q5_K
    let qh = sb * 4u * K4_DV + 32u + l / 4u;
    qa |= ((bq_word(qh) >> j) & 0x01010101u) << 4u;
    qb |= ((bq_word(qh + 1u) >> j) & 0x01010101u) << 4u;
#endif
    let a = vec4<f32>(unpack4xU8(qa)) * dl - ml;
    let b = vec4<f32>(unpack4xU8(qb)) * dl - ml;
    return array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
}
#endif

#if W_Q6_K
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;

// The i8 scale i (0…15) of superblock sb.
fn k6_scale(sb: u32, i: u32) -> f32 {
    let b = (ws[sb * 5u + i / 4u] >> (8u * (i % 4u))) & 0xFFu;
    return f32(bitcast<i32>(b << 24u) >> 24u);
}

fn bq_weights8(row: u32, k0: u32) -> array<f32, 8> {
    let sb = row * (KP / 256u) + k0 / 256u;
    let e = k0 % 256u;
    let n = e / 128u;        // which 128-value half
    let t = (e % 128u) / 32u; // which of its four 32-value quarters
    let l = e % 32u;
    let d = unpack2x16float(ws[sb * 5u + 4u]).x * k6_scale(sb, e / 16u);
    // ql bytes 64n + 32·(t%2) + l (nibble t/2), qh bytes 32n + l (bits 2t, 2t+1).
    let ql = sb * 48u + (64u * n + 32u * (t % 2u) + l) / 4u;
    let qh = sb * 48u + 32u + (32u * n + l) / 4u;
    let sh = (t / 2u) * 4u;
    let qa = ((bq_word(ql) >> sh) & 0x0F0F0F0Fu) | (((bq_word(qh) >> (2u * t)) & 0x03030303u) << 4u);
    let qb = ((bq_word(ql + 1u) >> sh) & 0x0F0F0F0Fu) | (((bq_word(qh + 1u) >> (2u * t)) & 0x03030303u) << 4u);
    let a = (vec4<f32>(unpack4xU8(qa)) - 32.0) * d;
    let b = (vec4<f32>(unpack4xU8(qb)) - 32.0) * d;
    return array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
}
#endif

#if W_BLOCK
// Word i of the quants.
fn bq_word(i: u32) -> u32 {
    return w[i / 4u][i % 4u];
}
#endif
