// The selective state update of one token, per head h and block of PB channels p:
//   S[h,p,:] = exp(δ_h·A_h)·S[h,p,:] + δ_h·x[h,p]·B[g(h),:];   y[h,p] = C[g(h),:]·S[h,p,:] + D_h·x[h,p]
// One workgroup of WG = N threads per (p-block, head); thread n owns column n of the
// block's rows, so the state is read and written contiguously. Reads the mixer row
// vector `mix` = [z | x B C | δ]. Flag GATED (fused graph): writes v = y·silu(z) and the
// block's Σ v² for the next kernel's group norm, instead of y.

@group(0) @binding(0) var<storage, read> mix: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if GATED
@group(0) @binding(4) var<storage, read_write> part: array<f32>;
var<workgroup> vsq: array<f32, PB>;
#endif
@group(0) @binding(5) var<storage, read> ctrl: Ctrl;

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
    let pb = wid.x;
    let h = wid.y;
    let g = h / (H / G);
    let n = lid;
    let delta = mix[DI + CD + h];
    let alpha = exp(delta * params[A_OFF + h]);
    let bn = mix[DI + DI + g * N + n];
    let cn = mix[DI + DI + G * N + g * N + n];
    let live = ctrl.stopped == 0u;
    var part_y: array<f32, RV>;
    for (var i = 0u; i < PB; i++) {
        let p = pb * PB + i;
        if (p < P) {
            let xv = mix[DI + h * P + p];
            let idx = (h * P + p) * N + n;
            let s = alpha * state[idx] + delta * xv * bn;
            if (live) {
                state[idx] = s;
            }
            part_y[i] = cn * s;
        }
    }
    var tot = wg_sum(part_y, lid, sg_lane, sg_size);
    var v = 0.0;
    let p = pb * PB + lid;
    if (lid < PB && p < P) {
        let ch = h * P + p;
        v = tot[lid] + params[D_OFF + h] * mix[DI + ch];
#if GATED
        v *= silu(mix[ch]);
#endif
        y[ch] = v;
    }
#if GATED
    if (lid < PB) {
        vsq[lid] = v * v;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var s = 0.0;
        for (var i = 0u; i < PB; i++) {
            s += vsq[i];
        }
        part[h * NPB + pb] = s;
    }
#endif
}
