// The MoE router for T tokens (workgroup x = token): router logits [T, E] → the chosen
// expert ids [T, K] (u32, best first) and their weights [T, K]; COUNT also adds one to
// counts[COUNT_OFF + id] per choice (the inspector's expert load). The formulas are transformers 5.17's
// (reference/moe.rs is the oracle, HYBRIDS.md the math):
// GROUPED: s = sigmoid(l), c = s + correction bias (params[BIAS_OFF..]); NG groups of GS
//   consecutive experts score the sum of their two best c; the TG best groups stay
//   eligible; the K best eligible c are chosen; w = s, divided by (Σ w + 1e-20) with NORM,
//   times RSF.
// otherwise (softmax top-k): the K best logits, w = softmax over those K.
// Order: a higher score first, equal scores by the lower id (as the CPU reference ranks).
// The scores are computed in parallel; one invocation then selects (K·E comparisons, a few
// microseconds for the released shapes).

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;
#if GROUPED
@group(0) @binding(1) var<storage, read> params: array<f32>;
var<workgroup> prob: array<f32, E>;
var<workgroup> group_score: array<f32, NG>;
var<workgroup> group_kept: array<u32, NG>;
#endif
#if COUNT
@group(0) @binding(4) var<storage, read_write> counts: array<atomic<u32>>;
#endif
#if PROMPT
@group(0) @binding(5) var<storage, read> ctrl: Ctrl;
#endif

var<workgroup> score: array<f32, E>;
var<workgroup> taken: array<u32, E>;

fn better(a: f32, ia: u32, b: f32, ib: u32) -> bool {
    return a > b || (a == b && ia < ib);
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let t = wid.x;
#if PROMPT
    if (t >= ctrl.prompt_len) {
        return;
    }
#endif
    for (var e = lid; e < E; e += WG) {
        let l = logits[t * E + e];
#if GROUPED
        let s = 1.0 / (1.0 + exp(-l));
        prob[e] = s;
        score[e] = s + params[BIAS_OFF + e];
#else
        score[e] = l;
#endif
        taken[e] = 0u;
    }
    workgroupBarrier();
#if GROUPED
    for (var g = lid; g < NG; g += WG) {
        var m1 = -3.4e38;
        var m2 = -3.4e38;
        for (var j = 0u; j < GS; j++) {
            let c = score[g * GS + j];
            if (c > m1) {
                m2 = m1;
                m1 = c;
            } else if (c > m2) {
                m2 = c;
            }
        }
        group_score[g] = m1 + m2;
        group_kept[g] = 0u;
    }
    workgroupBarrier();
#endif
    if (lid != 0u) {
        return;
    }
#if GROUPED
    for (var r = 0u; r < TG; r++) {
        var best = NG;
        for (var g = 0u; g < NG; g++) {
            if (group_kept[g] == 0u && (best == NG || better(group_score[g], g, group_score[best], best))) {
                best = g;
            }
        }
        group_kept[best] = 1u;
    }
#endif
    var total = 0.0;
#if !GROUPED
    var first = 0.0;
#endif
    for (var j = 0u; j < K; j++) {
        var best = E;
        for (var e = 0u; e < E; e++) {
#if GROUPED
            let eligible = taken[e] == 0u && group_kept[e / GS] == 1u;
#else
            let eligible = taken[e] == 0u;
#endif
            if (eligible && (best == E || better(score[e], e, score[best], best))) {
                best = e;
            }
        }
        taken[best] = 1u;
        ids[t * K + j] = best;
#if GROUPED
        let w = prob[best];
#else
        if (j == 0u) {
            first = score[best];
        }
        let w = exp(score[best] - first);
#endif
        wts[t * K + j] = w;
        total += w;
#if COUNT
        atomicAdd(&counts[COUNT_OFF + best], 1u);
#endif
    }
    // Divided, then scaled: the CPU reference's order of operations.
    for (var j = 0u; j < K; j++) {
#if GROUPED
        var w = wts[t * K + j];
        if (NORM == 1u) {
            w = w / (total + 1e-20);
        }
        wts[t * K + j] = w * RSF;
#else
        wts[t * K + j] = wts[t * K + j] / total;
#endif
    }
}
