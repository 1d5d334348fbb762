//! Mixture-of-experts blocks on the CPU: the oracle of the routing and expert kernels, for one
//! token at a time. Exactly transformers 5.17's formulas (HYBRIDS.md; the fixtures
//! `nemotron_h_moe` and `granite_moe_hybrid` hold its choices):
//!
//! - Nemotron-H (`NemotronHTopkRouter`): `s = sigmoid(logits)`, `c = s + e_score_correction_bias`;
//!   the experts form `n_group` groups of consecutive ids, a group scores the sum of its best two
//!   `c`; only the best `topk_group` groups stay eligible (5.17 fills the others' `c` with −inf,
//!   so they are never chosen); the `top_k` best eligible `c` are chosen; their weights are the
//!   *uncorrected* `s`, divided by `(Σ s + 1e-20)` when `norm_topk_prob`, times
//!   `routed_scaling_factor`. Experts are `down(relu(up(x))²)`.
//! - Granite-4.0-H (`GraniteMoeHybridTopKRouter`): the `top_k` best raw logits, weights = softmax
//!   over those `k` only. Experts are gated: `out(silu(a) ⊙ b)` with `[a; b] = input_linear(x)`.
//!
//! Order and ties: a [`Route`] lists its experts best first, equal scores by the lower expert id,
//! NaN above everything (as torch.topk ranks it). torch's order is unspecified for ties and, for
//! Nemotron-H (`topk(sorted=False)`), for the chosen ids too: compare with the oracle as sets.
//! The routing runs in the working precision `T`; transformers routes in f32.

use std::cmp::Ordering;

use super::math::{Real, matvec, silu};

/// One token's routing: the chosen experts, best first, and the weight of each.
#[derive(Clone, Debug, PartialEq)]
pub struct Route<T> {
    /// Expert ids, best first.
    pub ids: Vec<usize>,
    /// `weights[j]` multiplies expert `ids[j]`'s output.
    pub weights: Vec<T>,
}

/// The Nemotron-H router's settings (config keys in brackets).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupRouting {
    /// `E` [`n_routed_experts`]
    pub experts: usize,
    /// Groups of `E / n_group` consecutive experts [`n_group`].
    pub n_group: usize,
    /// Groups that stay eligible [`topk_group`].
    pub topk_group: usize,
    /// Experts per token [`num_experts_per_tok`].
    pub top_k: usize,
    /// Weights divided by their sum [`norm_topk_prob`].
    pub norm_topk_prob: bool,
    /// Final factor on the weights [`routed_scaling_factor`].
    pub routed_scaling_factor: f64,
}

impl GroupRouting {
    /// The settings transformers could not run (its `view` or `topk` would fail), or that would
    /// choose fewer than `top_k` experts.
    pub fn check(&self) -> Result<(), String> {
        let Self {
            experts,
            n_group,
            topk_group,
            top_k,
            ..
        } = *self;
        check_top_k(experts, top_k)?;
        if n_group == 0 || experts % n_group != 0 {
            return Err(format!(
                "n_group {n_group} does not divide the {experts} routed experts"
            ));
        }
        // A group scores its best two experts.
        let size = experts / n_group;
        if size < 2 {
            return Err(format!(
                "groups of {size} expert: the group score needs two (n_routed_experts {experts}, n_group {n_group})"
            ));
        }
        if topk_group == 0 || topk_group > n_group {
            return Err(format!(
                "topk_group {topk_group} is not within 1..={n_group} (n_group)"
            ));
        }
        if top_k > topk_group * size {
            return Err(format!(
                "num_experts_per_tok {top_k} exceeds the {} experts of the {topk_group} eligible groups",
                topk_group * size
            ));
        }
        Ok(())
    }
}

/// `1 ≤ top_k ≤ experts`, for either router.
pub fn check_top_k(experts: usize, top_k: usize) -> Result<(), String> {
    if top_k == 0 || top_k > experts {
        return Err(format!(
            "num_experts_per_tok {top_k} is not within 1..={experts} (the expert count)"
        ));
    }
    Ok(())
}

/// `σ(x) = 1 / (1 + e^−x)`
pub fn sigmoid<T: Real>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

/// How `a` ranks against `b` (`Greater`: `a` first): by value, NaN above everything (torch.topk's
/// order), so the ranking is total and sorting never meets an inconsistent comparison.
fn rank<T: Real>(a: T, b: T) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        // −0 == +0 here, as in torch.
        (false, false) => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    }
}

/// The ids of the `k` largest `scores`, best first, equal scores by the lower id.
pub fn top_k<T: Real>(scores: &[T], k: usize) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..scores.len()).collect();
    ids.sort_by(|&a, &b| rank(scores[b], scores[a]).then(a.cmp(&b)));
    ids.truncate(k);
    ids
}

/// The Nemotron-H router: `logits [E]` (`x · W_gate^T`), `bias [E]` (`e_score_correction_bias`).
/// `r` must pass [`GroupRouting::check`].
pub fn route_grouped<T: Real>(logits: &[T], bias: &[T], r: &GroupRouting) -> Route<T> {
    debug_assert!(r.check().is_ok(), "{:?}", r.check());
    assert_eq!(logits.len(), r.experts, "router logits");
    assert_eq!(bias.len(), r.experts, "e_score_correction_bias");
    let s: Vec<T> = logits.iter().map(|&x| sigmoid(x)).collect();
    // The bias only steers the choice (load balancing); the weights below use s.
    let c: Vec<T> = s.iter().zip(bias).map(|(&s, &b)| s + b).collect();
    let size = r.experts / r.n_group;
    let group_scores: Vec<T> = c
        .chunks(size)
        .map(|g| {
            let best = top_k(g, 2);
            g[best[0]] + g[best[1]]
        })
        .collect();
    // Outside the eligible groups c becomes −inf (5.17; HYBRIDS.md and DeepSeek-V3's reference
    // write 0.0 instead, which differs once an eligible c < 0 would rank below a masked 0.0).
    let mut eligible = vec![T::neg_infinity(); r.experts];
    for g in top_k(&group_scores, r.topk_group) {
        let span = g * size..(g + 1) * size;
        eligible[span.clone()].copy_from_slice(&c[span]);
    }
    let ids = top_k(&eligible, r.top_k);
    let mut weights: Vec<T> = ids.iter().map(|&i| s[i]).collect();
    if r.norm_topk_prob {
        // The 1e-20 only guards a zero sum; it vanishes in f32 and f64 alike otherwise.
        let total = weights.iter().fold(T::zero(), |a, &w| a + w) + T::of(1e-20);
        weights.iter_mut().for_each(|w| *w = *w / total);
    }
    let scale = T::of(r.routed_scaling_factor);
    weights.iter_mut().for_each(|w| *w = *w * scale);
    Route { ids, weights }
}

/// The Granite-4.0-H router: the `top_k` largest `logits [E]` (`x · W_router^T`), weights =
/// their softmax (over those `k` only, so they sum to 1).
pub fn route_softmax_top_k<T: Real>(logits: &[T], k: usize) -> Route<T> {
    debug_assert!(check_top_k(logits.len(), k).is_ok());
    let ids = top_k(logits, k);
    // The best logit comes first: subtracting it keeps every exp ≤ 1.
    let max = logits[ids[0]];
    let e: Vec<T> = ids.iter().map(|&i| (logits[i] - max).exp()).collect();
    let total = e.iter().fold(T::zero(), |a, &x| a + x);
    let weights = e.into_iter().map(|x| x / total).collect();
    Route { ids, weights }
}

/// Expert `e`'s matrix out of a stacked `[experts, rows, cols]` tensor (Granite's
/// `input_linear` / `output_linear`): the `e`-th of `experts` equal row-major blocks.
pub fn expert_block<T>(stacked: &[T], experts: usize, e: usize) -> &[T] {
    assert!(
        e < experts && stacked.len().is_multiple_of(experts),
        "expert {e} of {experts}"
    );
    let n = stacked.len() / experts;
    &stacked[e * n..(e + 1) * n]
}

/// Nemotron-H's non-gated MLP (routed experts, shared expert and `-` layers alike):
/// `down · relu(up · x)²`. `x [d]`, `up [I, d]`, `down [d, I]` → `[d]`.
pub fn relu2_mlp<T: Real>(x: &[T], up: &[T], down: &[T]) -> Vec<T> {
    let inter = up.len() / x.len();
    let mut h = vec![T::zero(); inter];
    matvec(up, x, &mut h);
    for v in &mut h {
        // relu, then square; a NaN stays NaN, as in torch.
        *v = if *v > T::zero() || v.is_nan() {
            *v * *v
        } else {
            T::zero()
        };
    }
    let mut out = vec![T::zero(); down.len() / inter];
    matvec(down, &h, &mut out);
    out
}

/// Granite's gated MLP (routed experts and `shared_mlp` alike): `output · (silu(a) ⊙ b)` with
/// `[a; b] = input_linear · x`, the gate `a` in the first half. `x [d]`, `input_linear [2I, d]`,
/// `output_linear [d, I]` → `[d]`.
pub fn gated_mlp<T: Real>(x: &[T], input_linear: &[T], output_linear: &[T]) -> Vec<T> {
    let two_i = input_linear.len() / x.len();
    assert!(
        two_i.is_multiple_of(2),
        "input_linear has an odd row count {two_i}"
    );
    let mut ab = vec![T::zero(); two_i];
    matvec(input_linear, x, &mut ab);
    let (a, b) = ab.split_at(two_i / 2);
    let h: Vec<T> = a.iter().zip(b).map(|(&a, &b)| silu(a) * b).collect();
    let mut out = vec![T::zero(); output_linear.len() / h.len()];
    matvec(output_linear, &h, &mut out);
    out
}

/// The routed part of an MoE block: `Σ_j weights[j] · expert(ids[j])` over `[d]` outputs, added
/// in route order (transformers adds by ascending expert id: the sums differ by rounding only).
pub fn routed_sum<T: Real>(
    route: &Route<T>,
    d: usize,
    mut expert: impl FnMut(usize) -> Vec<T>,
) -> Vec<T> {
    let mut out = vec![T::zero(); d];
    for (&id, &w) in route.ids.iter().zip(&route.weights) {
        let y = expert(id);
        assert_eq!(y.len(), d, "expert {id}'s output");
        for (o, y) in out.iter_mut().zip(y) {
            *o = *o + w * y;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits whose sigmoids are `p` (to f64 rounding): `ln(p / (1 − p))`.
    fn logits(p: &[f64]) -> Vec<f64> {
        p.iter().map(|&p| (p / (1.0 - p)).ln()).collect()
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
    }

    fn routing(experts: usize, n_group: usize, topk_group: usize, top_k: usize) -> GroupRouting {
        GroupRouting {
            experts,
            n_group,
            topk_group,
            top_k,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
        }
    }

    #[test]
    fn top_k_ranks_by_score_then_lower_id() {
        // 3.0 at ids 1, 2, 4, then 2.0 at id 3.
        assert_eq!(top_k(&[1.0f64, 3.0, 3.0, 2.0, 3.0], 4), vec![1, 2, 4, 3]);
        // torch.topk ranks NaN above everything.
        assert_eq!(top_k(&[1.0f32, f32::NAN, 2.0], 2), vec![1, 2]);
        // −0 and +0 are equal: the lower id first.
        assert_eq!(top_k(&[-0.0f64, 0.0], 1), vec![0]);
        assert_eq!(top_k(&[0.0f64, -0.0], 1), vec![0]);
    }

    #[test]
    fn group_limit_can_exclude_the_best_expert() {
        // s = [.95 .05 | .6 .6 | .7 .65 | .1 .1], no bias. Group scores (sum of the best two):
        // 1.00, 1.20, 1.35, 0.20 → groups 2 and 1 stay; expert 0 (0.95, the best) is out.
        // Best eligible: 4 (0.7), 5 (0.65); weights 0.7 / 1.35 and 0.65 / 1.35.
        let p = [0.95, 0.05, 0.6, 0.6, 0.7, 0.65, 0.1, 0.1];
        let r = routing(8, 4, 2, 2);
        let route = route_grouped(&logits(&p), &[0.0; 8], &r);
        assert_eq!(route.ids, vec![4, 5]);
        assert!(
            close(&route.weights, &[0.7 / 1.35, 0.65 / 1.35]),
            "{route:?}"
        );
        // One group of all 8: experts 0 (0.95) and 4 (0.7).
        let route = route_grouped(&logits(&p), &[0.0; 8], &routing(8, 1, 1, 2));
        assert_eq!(route.ids, vec![0, 4]);
    }

    #[test]
    fn best_experts_all_in_one_group() {
        // s = [.9 .85 | .1 .1 | .5 .45 | .3 .2]: groups 1.75, 0.2, 0.95, 0.5 → groups 0 and 2;
        // the best two eligible, 0 and 1, share group 0. Weights 0.9 / 1.75 and 0.85 / 1.75, × 2.5:
        // 1.2857142857…, 1.2142857142….
        let p = [0.9, 0.85, 0.1, 0.1, 0.5, 0.45, 0.3, 0.2];
        let r = GroupRouting {
            routed_scaling_factor: 2.5,
            ..routing(8, 4, 2, 2)
        };
        let route = route_grouped(&logits(&p), &[0.0; 8], &r);
        assert_eq!(route.ids, vec![0, 1]);
        assert!(close(
            &route.weights,
            &[2.5 * 0.9 / 1.75, 2.5 * 0.85 / 1.75]
        ));
        assert!((route.weights[0] - 1.285_714_285_714_285_7).abs() < 1e-12);
    }

    #[test]
    fn bias_chooses_and_the_plain_scores_weigh() {
        // s = [.8 .6 .7 .5], bias [0 0 −.2 .35] → c = [.8 .6 .5 .85]: choice 3 (0.85), 0 (0.8).
        // Without norm_topk_prob the weights are s × 2.5: 0.5 × 2.5 = 1.25 and 0.8 × 2.5 = 2.0
        // (not c: 0.85 × 2.5 would be 2.125).
        let p = [0.8, 0.6, 0.7, 0.5];
        let bias = [0.0, 0.0, -0.2, 0.35];
        let r = GroupRouting {
            norm_topk_prob: false,
            routed_scaling_factor: 2.5,
            ..routing(4, 2, 2, 2)
        };
        let route = route_grouped(&logits(&p), &bias, &r);
        assert_eq!(route.ids, vec![3, 0]);
        assert!(close(&route.weights, &[1.25, 2.0]), "{route:?}");
        // Without the bias: 0 (0.8) and 2 (0.7).
        assert_eq!(route_grouped(&logits(&p), &[0.0; 4], &r).ids, vec![0, 2]);
    }

    #[test]
    fn norm_topk_prob_and_scaling() {
        // s = [.8 .2 .6 .4], one group: choice 0, 2 (s 0.8, 0.6, sum 1.4).
        let p = logits(&[0.8, 0.2, 0.6, 0.4]);
        let case = |norm: bool, scale: f64| {
            let r = GroupRouting {
                norm_topk_prob: norm,
                routed_scaling_factor: scale,
                ..routing(4, 1, 1, 2)
            };
            let route = route_grouped(&p, &[0.0; 4], &r);
            assert_eq!(route.ids, vec![0, 2]);
            route.weights
        };
        // 0.8 / 1.4 = 0.5714285714…, 0.6 / 1.4 = 0.4285714285…
        assert!(close(&case(true, 1.0), &[0.8 / 1.4, 0.6 / 1.4]));
        // × 2.5: 1.4285714285…, 1.0714285714…
        assert!(close(&case(true, 2.5), &[2.0 / 1.4, 1.5 / 1.4]));
        // Not normalised: 0.8 × 2.5 = 2.0, 0.6 × 2.5 = 1.5.
        assert!(close(&case(false, 2.5), &[2.0, 1.5]));
        assert!(close(&case(false, 1.0), &[0.8, 0.6]));
    }

    #[test]
    fn masked_groups_are_never_chosen() {
        // s = [.9 .2 | .3 .3], bias [0 −.3 0 0] → c = [.9 −.1 | .3 .3]: groups 0.8, 0.6 → group 0
        // alone. 5.17 fills group 1 with −inf, so the second choice is expert 1 (c = −0.1): the
        // 0.0 fill would have taken expert 2 (0.0 > −0.1). Weights: s = 0.9, 0.2.
        let p = [0.9, 0.2, 0.3, 0.3];
        let bias = [0.0, -0.3, 0.0, 0.0];
        let r = GroupRouting {
            norm_topk_prob: false,
            ..routing(4, 2, 1, 2)
        };
        let route = route_grouped(&logits(&p), &bias, &r);
        assert_eq!(route.ids, vec![0, 1]);
        assert!(close(&route.weights, &[0.9, 0.2]));
    }

    #[test]
    fn ties_go_to_the_lower_group_and_expert() {
        // All logits 0: every s = 0.5, both groups score 1.0 → group 0; experts 0 then 1.
        let r = routing(4, 2, 1, 2);
        let route = route_grouped(&[0.0f64; 4], &[0.0; 4], &r);
        assert_eq!(route.ids, vec![0, 1]);
        assert!(close(&route.weights, &[0.5, 0.5]));
        // A bias that makes experts 1 and 3 equal and best: groups tie again, group 0 wins.
        let route = route_grouped(&[0.0f32; 4], &[0.0, 0.25, 0.0, 0.25], &routing(4, 2, 1, 1));
        assert_eq!(route.ids, vec![1]);
    }

    #[test]
    fn f32_and_f64_choose_alike() {
        // A spread of scores away from ties: both precisions give the same route.
        let p: Vec<f64> = (0..16)
            .map(|i| ((i * 7) % 16) as f64 / 17.0 + 0.03)
            .collect();
        let bias: Vec<f64> = (0..16)
            .map(|i| ((i * 5) % 16) as f64 / 80.0 - 0.1)
            .collect();
        let r = GroupRouting {
            routed_scaling_factor: 2.5,
            ..routing(16, 4, 2, 2)
        };
        let l64 = logits(&p);
        let l32: Vec<f32> = l64.iter().map(|&x| x as f32).collect();
        let b32: Vec<f32> = bias.iter().map(|&x| x as f32).collect();
        let (a, b) = (
            route_grouped(&l64, &bias, &r),
            route_grouped(&l32, &b32, &r),
        );
        assert_eq!(a.ids, b.ids);
        for (x, y) in a.weights.iter().zip(&b.weights) {
            assert!((x - *y as f64).abs() < 1e-6);
        }
    }

    #[test]
    fn granite_softmax_over_the_chosen_only() {
        // Logits 3.0 at ids 1 and 3 (tie: 1 first); softmax of two equal logits: 0.5 each.
        let route = route_softmax_top_k(&[1.0f64, 3.0, 2.0, 3.0], 2);
        assert_eq!(route.ids, vec![1, 3]);
        assert!(close(&route.weights, &[0.5, 0.5]));
        // ln 3 and 0 chosen: e^(ln 3) / (3 + 1) = 0.75 and 0.25 (id 2, logit −1, is not counted).
        let route = route_softmax_top_k(&[0.0f64, 3f64.ln(), -1.0], 2);
        assert_eq!(route.ids, vec![1, 0]);
        assert!(close(&route.weights, &[0.75, 0.25]));
    }

    #[test]
    fn relu2_mlp_by_hand() {
        // up = [[1, 0], [0, −1]], x = [2, 3] → [2, −3] → relu² [4, 0];
        // down = [[1, 2], [3, 4]] → [4, 12].
        let y = relu2_mlp(
            &[2.0f64, 3.0],
            &[1.0, 0.0, 0.0, -1.0],
            &[1.0, 2.0, 3.0, 4.0],
        );
        assert_eq!(y, vec![4.0, 12.0]);
    }

    #[test]
    fn gated_mlp_gate_is_the_first_half() {
        // input_linear = [[1, 0] (gate a), [0, 2] (up b)], x = [ln 3, 5] → a = ln 3, b = 10;
        // silu(ln 3) = ln 3 · σ(ln 3) = ln 3 · 3/4 → h = 7.5 ln 3; output_linear = [[1], [−2]]
        // → [7.5 ln 3, −15 ln 3]. (Gate and up swapped: silu(10) · ln 3 ≈ 10.98, not 8.24.)
        let ln3 = 3f64.ln();
        let y = gated_mlp(&[ln3, 5.0], &[1.0, 0.0, 0.0, 2.0], &[1.0, -2.0]);
        assert!(close(&y, &[7.5 * ln3, -15.0 * ln3]), "{y:?}");
    }

    #[test]
    fn routed_sum_of_stacked_experts() {
        // Three 1 → 1 → 1 relu² experts, up = e + 1, down = 1: expert e gives (e + 1)² for x = 1.
        // Route 2 (0.75), 0 (0.25): 0.75 · 9 + 0.25 · 1 = 7.
        let (up, down) = ([1.0f64, 2.0, 3.0], [1.0f64; 3]);
        let route = Route {
            ids: vec![2, 0],
            weights: vec![0.75, 0.25],
        };
        let y = routed_sum(&route, 1, |e| {
            relu2_mlp(&[1.0], expert_block(&up, 3, e), expert_block(&down, 3, e))
        });
        assert_eq!(y, vec![7.0]);
    }

    #[test]
    fn settings_transformers_could_not_run_are_refused() {
        let ok = routing(16, 4, 2, 2);
        assert_eq!(ok.check(), Ok(()));
        let bad = |r: GroupRouting| r.check().unwrap_err();
        assert!(bad(GroupRouting { top_k: 17, ..ok }).contains("num_experts_per_tok 17"));
        assert!(bad(GroupRouting { top_k: 0, ..ok }).contains("num_experts_per_tok 0"));
        assert!(bad(GroupRouting { n_group: 3, ..ok }).contains("does not divide"));
        assert!(
            bad(GroupRouting {
                n_group: 16,
                topk_group: 2,
                ..ok
            })
            .contains("needs two")
        );
        assert!(
            bad(GroupRouting {
                topk_group: 5,
                ..ok
            })
            .contains("topk_group 5")
        );
        // 2 eligible groups of 4 hold 8 experts.
        assert!(bad(GroupRouting { top_k: 9, ..ok }).contains("exceeds the 8"));
        assert!(check_top_k(10, 11).is_err() && check_top_k(10, 10).is_ok());
    }
}
