// The MoE router for T tokens (workgroup x = token): router logits [T, E] → the chosen
// expert ids [T, K] (u32, best first) and their weights [T, K]; COUNT also adds one to
// counts[COUNT_OFF + id] per choice (the inspector's expert load). The formulas are
// transformers 5.17's (reference/moe.rs is the oracle, HYBRIDS.md the math):
// GROUPED: s = sigmoid(l), c = s + correction bias (params[BIAS_OFF..]); NG groups of GS
//   consecutive experts score the sum of their two best c; the TG best groups stay
//   eligible; the K best eligible c are chosen; w = s, divided by (Σ w + 1e-20) with NORM,
//   times RSF.
// otherwise (softmax top-k): the K best logits, w = softmax over those K.
// Order: a higher score first, equal scores by the lower id (as the CPU reference ranks).
// Selection without serial rounds: every candidate counts the candidates that beat it —
// its rank, counted by TPC invocations over slices of the candidates — and the K of
// rank < K write their slot (ranks are unique: ties go by id). With TG = NG every group is
// eligible and the group scores are skipped.
// A token's row of ids/weights holds KS = K + S slots: after the K chosen, the S slices of
// the shared expert (stored as experts E .. E + S − 1) with weight 1.

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
var<workgroup> rank_of: array<atomic<u32>, E>;
var<workgroup> slot_id: array<u32, K>;
var<workgroup> slot_w: array<f32, K>;
var<workgroup> total: f32;

fn better(a: f32, ia: u32, b: f32, ib: u32) -> bool {
    return a > b || (a == b && ia < ib);
}

fn eligible(e: u32) -> bool {
#if GROUPED
    if (TG < NG) {
        return group_kept[e / GS] == 1u;
    }
#endif
    return true;
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let t = wid.x;
#if PROMPT
    // Uniform per workgroup: the whole workgroup returns.
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
        atomicStore(&rank_of[e], 0u);
    }
    workgroupBarrier();
#if GROUPED
    for (var g = lid; g < NG && TG < NG; g += WG) {
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
    }
    workgroupBarrier();
    for (var g = lid; g < NG && TG < NG; g += WG) {
        var rank = 0u;
        for (var h = 0u; h < NG; h++) {
            rank += u32(better(group_score[h], h, group_score[g], g));
        }
        group_kept[g] = u32(rank < TG);
    }
    workgroupBarrier();
#endif
    // Invocation lid counts, for candidate lid / TPC (and every WG / TPC after it), the
    // candidates j ≡ lid (mod TPC) that beat it.
    for (var e = lid / TPC; e < E; e += WG / TPC) {
        if (eligible(e)) {
            let c = score[e];
            var beaten_by = 0u;
            for (var j = lid % TPC; j < E && beaten_by < K; j += TPC) {
                beaten_by += u32(eligible(j) && better(score[j], j, c, e));
            }
            atomicAdd(&rank_of[e], beaten_by);
        }
    }
    workgroupBarrier();
    for (var e = lid; e < E; e += WG) {
        if (eligible(e)) {
            let c = score[e];
            let rank = atomicLoad(&rank_of[e]);
            if (rank < K) {
                slot_id[rank] = e;
#if GROUPED
                slot_w[rank] = prob[e];
#else
                slot_w[rank] = c;
#endif
            }
        }
    }
    workgroupBarrier();
    // The weights' sums in slot order (one invocation: the CPU reference's order), then
    // every slot written by its own invocation.
    if (lid == 0u) {
        var sum = 0.0;
#if GROUPED
        for (var j = 0u; j < K; j++) {
            sum += slot_w[j];
        }
#else
        let first = slot_w[0];
        for (var j = 0u; j < K; j++) {
            slot_w[j] = exp(slot_w[j] - first);
            sum += slot_w[j];
        }
#endif
        total = sum;
    }
    workgroupBarrier();
    if (lid < K) {
        var w = slot_w[lid];
#if GROUPED
        if (NORM == 1u) {
            w = w / (total + 1e-20);
        }
        w = w * RSF;
#else
        w = w / total;
#endif
        ids[t * KS + lid] = slot_id[lid];
        wts[t * KS + lid] = w;
#if COUNT
        atomicAdd(&counts[COUNT_OFF + slot_id[lid]], 1u);
#endif
    } else if (lid < KS) {
        ids[t * KS + lid] = E + lid - K;
        wts[t * KS + lid] = 1.0;
    }
}
