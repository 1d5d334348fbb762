// The MoE routing of one token by one workgroup, shared by the routing kernel
// (moe_route.wgsl) and the decode up pass that routes in its prologue (expert_gemv.wgsl with
// ROUTE): the same code, so the same ids and weights bit for bit. The including kernel
// declares `logits` (and `params` when GROUPED) to read, `ids`, `wts` (and `counts` when
// COUNT) to write, and the constants WG, E, K (chosen), KS (slots), TPC (invocations per
// candidate), with GROUPED NG, GS, TG, NORM, RSF, BIAS_OFF, with COUNT COUNT_OFF.
// The formulas are transformers 5.17's (reference/moe.rs is the oracle, HYBRIDS.md the math):
// GROUPED: s = sigmoid(l), c = s + correction bias (params[BIAS_OFF..]); NG groups of GS
//   consecutive experts score the sum of their two best c; the TG best groups stay
//   eligible; the K best eligible c are chosen; w = s, divided by (Σ w + 1e-20) with NORM,
//   times RSF.
// otherwise (softmax top-k): the K best logits, w = softmax over those K.
// Order: a higher score first, equal scores by the lower id (`ranks_before`, as the CPU
// reference ranks).
// Selection without serial rounds: every candidate counts the candidates that beat it —
// its rank, counted by TPC invocations over slices of the candidates — and the K of
// rank < K write their slot (ranks are unique: ties go by id). With TG = NG every group is
// eligible and the group scores are skipped.

#if GROUPED
var<workgroup> rt_prob: array<f32, E>;
var<workgroup> rt_group_score: array<f32, NG>;
var<workgroup> rt_group_kept: array<u32, NG>;
#endif
var<workgroup> rt_score: array<f32, E>;
var<workgroup> rt_rank: array<atomic<u32>, E>;
// The chosen experts best first, and their scores (GROUPED: s; else the logit).
var<workgroup> rt_slot_id: array<u32, K>;
var<workgroup> rt_slot_w: array<f32, K>;
var<workgroup> rt_total: f32;

fn rt_eligible(e: u32) -> bool {
#if GROUPED
    if (TG < NG) {
        return rt_group_kept[e / GS] == 1u;
    }
#endif
    return true;
}

// Token t's K choices into rt_slot_id / rt_slot_w (visible to the whole workgroup on
// return). Call from uniform control flow.
fn route_select(t: u32, lid: u32) {
    rt_scores(t, lid);
    // Invocation lid counts, for candidate lid / TPC (and every WG / TPC after it), the
    // candidates j ≡ lid (mod TPC) that beat it.
    for (var e = lid / TPC; e < E; e += WG / TPC) {
        if (rt_eligible(e)) {
            atomicAdd(&rt_rank[e], rt_beaten_by(e, lid));
        }
    }
    workgroupBarrier();
    for (var e = lid; e < E; e += WG) {
        if (rt_eligible(e)) {
            let rank = atomicLoad(&rt_rank[e]);
            if (rank < K) {
                rt_put(rank, e);
            }
        }
    }
    workgroupBarrier();
}

#if RT_SHUFFLE
// The expert of slot `want`, for the decode up pass (route_rank).
var<workgroup> rt_want_id: u32;

// route_select with one candidate per TPC consecutive invocations (E ≤ WG / TPC, TPC at
// most the smallest subgroup): their counts are summed by shuffles instead of workgroup
// atomics, and the candidate's first invocation writes its slot, and its id to
// `rt_want_id` when its rank is `want`. The same ranks, so the same choices. No barrier
// after the count: whoever reads the slots (route_write) or the id takes one first. Call
// from uniform control flow.
fn route_rank(t: u32, lid: u32, want: u32) {
    rt_scores(t, lid);
    let e = lid / TPC;
    let live = e < E && rt_eligible(min(e, E - 1u));
    var beaten_by = 0u;
    if (live) {
        beaten_by = rt_beaten_by(e, lid);
    }
    for (var o = TPC / 2u; o > 0u; o /= 2u) {
        beaten_by += subgroupShuffleXor(beaten_by, o);
    }
    if (live && lid % TPC == 0u && beaten_by < K) {
        rt_put(beaten_by, e);
        if (beaten_by == want) {
            rt_want_id = e;
        }
    }
}
#endif

// How many of the candidates j ≡ lid (mod TPC) beat eligible candidate e, counting no
// further than K (the TPC shares of a rank under K are exact; one of K or more sums to K or
// more).
fn rt_beaten_by(e: u32, lid: u32) -> u32 {
    let c = rt_score[e];
    var beaten_by = 0u;
    for (var j = lid % TPC; j < E && beaten_by < K; j += TPC) {
        beaten_by += u32(rt_eligible(j) && ranks_before(rt_score[j], j, c, e));
    }
    return beaten_by;
}

// Candidate e, of rank `rank` < K, into its slot with its score (GROUPED: s; else the logit).
fn rt_put(rank: u32, e: u32) {
    rt_slot_id[rank] = e;
#if GROUPED
    rt_slot_w[rank] = rt_prob[e];
#else
    rt_slot_w[rank] = rt_score[e];
#endif
}

// The candidates' scores (and with GROUPED the eligible groups), visible to the workgroup
// on return. Call from uniform control flow.
fn rt_scores(t: u32, lid: u32) {
    for (var e = lid; e < E; e += WG) {
        let l = logits[t * E + e];
#if GROUPED
        let s = 1.0 / (1.0 + exp(-l));
        rt_prob[e] = s;
        rt_score[e] = s + params[BIAS_OFF + e];
#else
        rt_score[e] = l;
#endif
        atomicStore(&rt_rank[e], 0u);
    }
    workgroupBarrier();
#if GROUPED
    // (A constant condition: with every group eligible its barriers go too.)
    if (TG < NG) {
        for (var g = lid; g < NG; g += WG) {
            var m1 = -3.4e38;
            var m2 = -3.4e38;
            for (var j = 0u; j < GS; j++) {
                let c = rt_score[g * GS + j];
                if (c > m1) {
                    m2 = m1;
                    m1 = c;
                } else if (c > m2) {
                    m2 = c;
                }
            }
            rt_group_score[g] = m1 + m2;
        }
        workgroupBarrier();
        for (var g = lid; g < NG; g += WG) {
            var rank = 0u;
            for (var h = 0u; h < NG; h++) {
                rank += u32(ranks_before(rt_group_score[h], h, rt_group_score[g], g));
            }
            rt_group_kept[g] = u32(rank < TG);
        }
        workgroupBarrier();
    }
#endif
}

// After route_select: token t's row of KS slots — the K chosen with their weights, then the
// S shared-expert slices (experts E .. E + S − 1, weight 1) — into ids/wts, and with COUNT
// one more choice of each chosen expert into counts. Call from uniform control flow.
fn route_write(t: u32, lid: u32) {
    // The weights' sum in slot order (one invocation: the CPU reference's order), then
    // every slot written by its own invocation.
    if (lid == 0u) {
        var sum = 0.0;
#if GROUPED
        for (var j = 0u; j < K; j++) {
            sum += rt_slot_w[j];
        }
#else
        let first = rt_slot_w[0];
        for (var j = 0u; j < K; j++) {
            rt_slot_w[j] = exp(rt_slot_w[j] - first);
            sum += rt_slot_w[j];
        }
#endif
        rt_total = sum;
    }
    workgroupBarrier();
    if (lid < K) {
        var w = rt_slot_w[lid];
#if GROUPED
        if (NORM == 1u) {
            w = w / (rt_total + 1e-20);
        }
        w = w * RSF;
#else
        w = w / rt_total;
#endif
        ids[t * KS + lid] = rt_slot_id[lid];
        wts[t * KS + lid] = w;
#if COUNT
        atomicAdd(&counts[COUNT_OFF + rt_slot_id[lid]], 1u);
#endif
    } else if (lid < KS) {
        ids[t * KS + lid] = E + lid - K;
        wts[t * KS + lid] = 1.0;
    }
}
