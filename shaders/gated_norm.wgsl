// The unfused graph's gated group RMSNorm: v = y ⊙ silu(z); each of the G contiguous
// groups of GS channels is divided by its own RMS, then ⊙ norm weight (RV = G sums). Each
// workgroup sums every group and writes its own CHUNK channels; with Q8_OUT also the q8
// blocks of the result.
// `mix` holds z in its first DI entries.

@group(0) @binding(0) var<storage, read> y: array<f32>;
@group(0) @binding(1) var<storage, read> mix: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;
#if Q8_OUT
@group(0) @binding(4) var<storage, read_write> xq: array<u32>;
@group(0) @binding(5) var<storage, read_write> xd: array<f32>;
#endif

fn gated(c: u32) -> f32 {
    return y[c] * silu(mix[c]);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
#if SUBGROUP
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
#endif
) {
#if !SUBGROUP
    let sg_lane = 0u;
    let sg_size = 1u;
#endif
    var ss: array<f32, RV>;
    for (var c = lid; c < DI; c += WG) {
        let v = gated(c);
        ss[c / GS] += v * v;
    }
    var tot = wg_sum(ss, lid, sg_lane, sg_size);
    let first = wid.x * CHUNK;
    for (var c = first + lid; c < min(first + CHUNK, DI); c += WG) {
        dst[c] = gated(c) * inverseSqrt(tot[c / GS] / f32(GS) + EPS) * params[NW_OFF + c];
    }
#if Q8_OUT
    let b = first / 32u + lid;
    if (lid < CHUNK / 32u && b < (DI + 31u) / 32u) {
        var v: array<f32, 32>;
        for (var j = 0u; j < 32u; j++) {
            let c = b * 32u + j;
            if (c < DI) {
                v[j] = gated(c) * inverseSqrt(tot[c / GS] / f32(GS) + EPS) * params[NW_OFF + c];
            }
        }
        q8_block(v, b);
    }
#endif
}
