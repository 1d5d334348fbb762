// dst = src / rms(src) ⊙ params[NW_OFF..NW_OFF+D]: the block pre-norm and the final norm,
// writing the next GEMV's input once per token. With Q8_OUT also its q8 blocks (zero past
// D). Each workgroup sums all of src² (a few KB from cache) and writes its own CHUNK
// elements, so the work spreads over the GPU instead of one multiprocessor.

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
#if Q8_OUT
@group(0) @binding(3) var<storage, read_write> xq: array<u32>;
@group(0) @binding(4) var<storage, read_write> xd: array<f32>;
#endif

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
    for (var k = lid; k < D; k += WG) {
        ss[0] += src[k] * src[k];
    }
    let tot = wg_sum(ss, lid, sg_lane, sg_size);
    let rstd = inverseSqrt(tot[0] / f32(D) + EPS);
    let first = wid.x * CHUNK;
    for (var k = first + lid; k < min(first + CHUNK, D); k += WG) {
        dst[k] = src[k] * rstd * params[NW_OFF + k];
    }
#if Q8_OUT
    let b = first / 32u + lid;
    if (lid < CHUNK / 32u && b < (D + 31u) / 32u) {
        var v: array<f32, 32>;
        for (var j = 0u; j < 32u; j++) {
            let k = b * 32u + j;
            if (k < D) {
                v[j] = src[k] * rstd * params[NW_OFF + k];
            }
        }
        q8_block(v, b);
    }
#endif
}
