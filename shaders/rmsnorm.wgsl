// dst = src / rms(src) ⊙ params[NW_OFF..NW_OFF+D]: the block pre-norm and the final norm
// of the unfused graph. One workgroup.

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
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
    for (var k = lid; k < D; k += WG) {
        dst[k] = src[k] * rstd * params[NW_OFF + k];
    }
}
