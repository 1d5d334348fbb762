#if NORM_SUM
// 1/rms of the D values norm_x(base + k): invocation lid sums x[lid + j·WG]² (j < SSL) in
// order, then `wg_sum`. Every decode pre-norm takes this order (the norm kernel and the
// router GEMV that folds the MoE pre-norm in, both with WG = 256), so they agree bit for
// bit. The including shader defines `norm_x`.
fn norm_rstd(base: u32, lid: u32, sg_lane: u32, sg_size: u32) -> f32 {
    var ss: array<f32, RV>;
#for j SSL
    {
        let k = lid + {j}u * WG;
        if (k < D) {
            let x = norm_x(base + k);
            ss[0] += x * x;
        }
    }
#endfor
    let tot = wg_sum(ss, lid, sg_lane, sg_size);
    return inverseSqrt(tot[0] / f32(D) + EPS);
}
#endif
