// y = W·x for one token: W [M, K] in f32, f16 or q8_0 (rows zero-padded to KP columns),
// R rows per workgroup, all WG threads striding over K (any subgroup size).
// Flags: W_F32 | W_F16 | W_Q8;  X_PLAIN | X_RMS | X_GROUP (what x is);  O_STORE | O_ADD |
// O_MIXER (what is done with each row);  NEED_PARAMS;  SUBGROUP.
//   X_RMS:   x = src ⊙ params[NW_OFF..] and the row is scaled by 1/rms(src) (pre-norm fused in)
//   X_GROUP: x = src ⊙ params[NW_OFF..] ⊙ rstd[group], rstd from the SSD step's partial sums
//   O_ADD:   dst[row] += y (residual);  O_MIXER: mixer_row (conv, dt) on each row
// q8_0: 32-weight blocks, int8 weights packed 4 per u32, one f16 scale per block (`ws`).
// The activation is quantized in the prologue to int8 per 32-block (scale amax/127, as
// ggml's q8_1 activations), then the dot is dot4I8Packed.

#if W_F32
@group(0) @binding(0) var<storage, read> w: array<vec4<f32>>;
const VW: u32 = 4u;
#endif
#if W_F16
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
const VW: u32 = 8u;
#endif
#if W_Q8
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;
const VW: u32 = 16u;
#endif
@group(0) @binding(2) var<storage, read> src: array<f32>;
#if NEED_PARAMS
@group(0) @binding(3) var<storage, read> params: array<f32>;
#endif
#if X_GROUP
@group(0) @binding(4) var<storage, read> part: array<f32>;
#endif
@group(0) @binding(5) var<storage, read_write> dst: array<f32>;
#if O_MIXER
@group(0) @binding(6) var<storage, read_write> conv_state: array<f32>;
@group(0) @binding(7) var<storage, read> ctrl: Ctrl;
#endif

const NV: u32 = KP / VW;

#if X_GROUP
var<workgroup> grp_rstd: array<f32, G>;
#endif
#if W_Q8
var<workgroup> xq: array<u32, KP / 4u>;
var<workgroup> xd: array<f32, KP / 32u>;
#endif

// Raw activations src[k..k+4], zero past K.
fn load4(k: u32) -> vec4<f32> {
    if (k + 3u < K) {
        return vec4<f32>(src[k], src[k + 1u], src[k + 2u], src[k + 3u]);
    }
    var v = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        if (k + i < K) {
            v[i] = src[k + i];
        }
    }
    return v;
}

// The GEMV's input at k..k+4, from the raw values.
fn scale4(k: u32, raw: vec4<f32>) -> vec4<f32> {
#if X_PLAIN
    return raw;
#else
    var v = raw;
    for (var i = 0u; i < 4u; i++) {
        if (k + i < K) {
            v[i] *= params[NW_OFF + k + i];
#if X_GROUP
            v[i] *= grp_rstd[(k + i) / GS];
#endif
        }
    }
    return v;
#endif
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
#if SUBGROUP
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
#endif
) {
#if !SUBGROUP
    let sg_lane = 0u;
    let sg_size = 1u;
#endif
    let row0 = (wid.x + wid.y * nwg.x) * R;
#if X_GROUP
    if (lid < G) {
        var s = 0.0;
        for (var i = 0u; i < NPART; i++) {
            s += part[lid * NPART + i];
        }
        grp_rstd[lid] = inverseSqrt(s / f32(GS) + EPS);
    }
    workgroupBarrier();
#endif
    // acc[0..R]: row dots; acc[R]: Σ src² (for X_RMS).
    var acc: array<f32, RV>;
#if W_Q8
    for (var b = lid; b < KP / 32u; b += WG) {
        var amax = 0.0;
        for (var q = 0u; q < 8u; q++) {
            let raw = load4(b * 32u + q * 4u);
            acc[R] += dot(raw, raw);
            let v = abs(scale4(b * 32u + q * 4u, raw));
            amax = max(amax, max(max(v.x, v.y), max(v.z, v.w)));
        }
        // ggml's q8 activation rule: d = amax/127, q = round(x/d) (ties to even here).
        let d = amax / 127.0;
        var inv = 0.0;
        if (d > 0.0) {
            inv = 1.0 / d;
        }
        for (var q = 0u; q < 8u; q++) {
            let v = scale4(b * 32u + q * 4u, load4(b * 32u + q * 4u)) * inv;
            xq[b * 8u + q] = pack4xI8(clamp(vec4<i32>(round(v)), vec4<i32>(-127), vec4<i32>(127)));
        }
        xd[b] = d;
    }
    workgroupBarrier();
    for (var v = lid; v < NV; v += WG) {
        let blk = v / 2u;
        let a0 = xq[v * 4u];
        let a1 = xq[v * 4u + 1u];
        let a2 = xq[v * 4u + 2u];
        let a3 = xq[v * 4u + 3u];
        let xs = xd[blk];
        for (var r = 0u; r < R; r++) {
            let row = min(row0 + r, M - 1u);
            let wv = w[row * NV + v];
            let idot = dot4I8Packed(wv.x, a0) + dot4I8Packed(wv.y, a1) + dot4I8Packed(wv.z, a2) + dot4I8Packed(wv.w, a3);
            let si = row * (KP / 32u) + blk;
            let sc = unpack2x16float(ws[si / 2u])[si % 2u];
            acc[r] += f32(idot) * (sc * xs);
        }
    }
#else
    for (var v = lid; v < NV; v += WG) {
        let k = v * VW;
        let ra = load4(k);
        let xa = scale4(k, ra);
        acc[R] += dot(ra, ra);
#if W_F16
        let rb = load4(k + 4u);
        let xb = scale4(k + 4u, rb);
        acc[R] += dot(rb, rb);
#endif
        for (var r = 0u; r < R; r++) {
            let row = min(row0 + r, M - 1u);
            let wv = w[row * NV + v];
#if W_F16
            acc[r] += dot(vec4<f32>(unpack2x16float(wv.x), unpack2x16float(wv.y)), xa)
                + dot(vec4<f32>(unpack2x16float(wv.z), unpack2x16float(wv.w)), xb);
#else
            acc[r] += dot(wv, xa);
#endif
        }
    }
#endif
    var tot = wg_sum(acc, lid, sg_lane, sg_size);
    if (lid < R && row0 + lid < M) {
        let row = row0 + lid;
        var val = tot[lid];
#if X_RMS
        val *= inverseSqrt(tot[R] / f32(K) + EPS);
#endif
#if O_STORE
        dst[row] = val;
#endif
#if O_ADD
        dst[row] += val;
#endif
#if O_MIXER
        mixer_row(row, val);
#endif
    }
}
