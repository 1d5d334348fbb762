// The unfused graph's gated group RMSNorm: v = y ⊙ silu(z); each of the G contiguous
// groups of GS channels is divided by its own RMS, then ⊙ norm weight. One workgroup per
// group. `mix` holds z in its first DI entries.

@group(0) @binding(0) var<storage, read> y: array<f32>;
@group(0) @binding(1) var<storage, read> mix: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

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
    let base = wid.x * GS;
    var ss: array<f32, RV>;
    for (var k = lid; k < GS; k += WG) {
        let v = y[base + k] * silu(mix[base + k]);
        ss[0] += v * v;
    }
    let tot = wg_sum(ss, lid, sg_lane, sg_size);
    let rstd = inverseSqrt(tot[0] / f32(GS) + EPS);
    for (var k = lid; k < GS; k += WG) {
        let c = base + k;
        dst[c] = y[c] * silu(mix[c]) * rstd * params[NW_OFF + c];
    }
}
