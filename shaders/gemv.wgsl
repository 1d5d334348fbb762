// y = W·x for one token: W [M, K] in f32, f16 or q8_0 (rows zero-padded to KP columns).
// A team of TEAM consecutive invocations owns a row and strides over it with 16-byte
// loads; R = WG/TEAM rows per workgroup; one team reduction per row. The input is ready:
// f32 `src [KP]` (zero past K) for f32/f16 weights, q8 blocks `xq`/`xd` for q8_0 weights
// (made once per token by the producer kernel, so no workgroup repeats that work).
// Flags: W_F32 | W_F16 | W_Q8;  X_GROUP (x_k is scaled by its group's rstd, from the SSD
// step's per-block Σv²: the gated group norm folded in);  O_STORE | O_ADD | O_MIXER.

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
@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> xd: array<f32>;
const VW: u32 = 16u;
#else
@group(0) @binding(2) var<storage, read> src: array<vec4<f32>>;
#endif
@group(0) @binding(5) var<storage, read_write> dst: array<f32>;
#if O_MIXER
@group(0) @binding(6) var<storage, read_write> conv_state: array<f32>;
@group(0) @binding(7) var<storage, read> ctrl: Ctrl;
@group(0) @binding(8) var<storage, read> params: array<f32>;
#endif
#if X_GROUP
@group(0) @binding(9) var<storage, read> part: array<f32>;
var<workgroup> grp_rstd: array<f32, G>;
#endif

const NV: u32 = KP / VW;

// The group-norm factor of input column k (1 without X_GROUP).
fn col_scale(k: u32) -> f32 {
#if X_GROUP
    return grp_rstd[k / GS];
#else
    return 1.0;
#endif
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
#if X_GROUP
    // rstd per group from the per-block sums of squares of v (BPG blocks per group).
    if (lid < G) {
        var s = 0.0;
        for (var i = 0u; i < BPG; i++) {
            s += part[lid * BPG + i];
        }
        grp_rstd[lid] = inverseSqrt(s / f32(GS) + EPS);
    }
    workgroupBarrier();
#endif
    let lane = lid % TEAM;
    let row_raw = (wid.x + wid.y * nwg.x) * R + lid / TEAM;
    let row = min(row_raw, M - 1u);
    let base = row * NV;
    var acc = 0.0;
    for (var v = lane; v < NV; v += TEAM) {
        let wv = w[base + v];
#if W_Q8
        let a = xq[v];
        let idot = dot4I8Packed(wv.x, a.x) + dot4I8Packed(wv.y, a.y) + dot4I8Packed(wv.z, a.z) + dot4I8Packed(wv.w, a.w);
        let blk = v / 2u;
        let si = row * (KP / 32u) + blk;
        acc += f32(idot) * (unpack2x16float(ws[si / 2u])[si % 2u] * xd[blk] * col_scale(blk * 32u));
#endif
#if W_F16
        let xa = src[2u * v] * col_scale(v * 8u);
        let xb = src[2u * v + 1u] * col_scale(v * 8u + 4u);
        acc += dot(vec4<f32>(unpack2x16float(wv.x), unpack2x16float(wv.y)), xa)
            + dot(vec4<f32>(unpack2x16float(wv.z), unpack2x16float(wv.w)), xb);
#endif
#if W_F32
        acc += dot(wv, src[v] * col_scale(v * 4u));
#endif
    }
    let total = team_sum(acc, lid);
    if (lane == 0u && row_raw < M) {
#if O_STORE
        dst[row] = total;
#endif
#if O_ADD
        dst[row] += total;
#endif
#if O_MIXER
        mixer_row(row, total);
#endif
    }
}
