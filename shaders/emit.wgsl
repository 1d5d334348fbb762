// Writes the chosen token into the control block (argmax and sample share it): the next
// embed reads it, the position advances, and a stop token stops later state updates.
// `bad`: some logit was NaN or ±Inf — flagged in `ctrl[ln].nonfinite` for the host, which
// reads it with the token and reports an error (the token itself stays in the vocabulary).
// Needs `ctrl` (an array, one per lane) bound read_write; `ln` is the workgroup's lane
// (workgroup x), `lo` its first logit (ln·V). With ONLY_GREEDY / ONLY_SAMPLED (a batch of
// lanes with both kinds) a lane the other kernel serves is skipped: `mine` says whether
// this one serves it (temperature ≤ 0 is greedy, as Sampling::is_greedy says).

var<private> ln: u32;
var<private> lo: u32;

fn mine() -> bool {
#if ONLY_GREEDY
    return ctrl[ln].temperature <= 0.0;
#else
#if ONLY_SAMPLED
    return !(ctrl[ln].temperature <= 0.0);
#else
    return true;
#endif
#endif
}

var<workgroup> skip_lane: u32;

// Sets the workgroup's lane (`ln`, `lo`) and says whether the other sampling kernel serves
// it (the whole workgroup then returns). Call first, in uniform control flow.
fn enter_lane(lane: u32, lid: u32) -> bool {
    ln = lane;
    lo = lane * V;
    if (lid == 0u) {
        skip_lane = select(1u, 0u, mine());
    }
    return workgroupUniformLoad(&skip_lane) != 0u;
}

fn emit_token(t: u32, bad: bool) {
    if (ctrl[ln].stopped != 0u) {
        return;
    }
    if (bad) {
        ctrl[ln].nonfinite = 1u;
    }
    // The token just fed is in the KV caches now (a stopped step stored nothing).
    ctrl[ln].kv_len += 1u;
    ctrl[ln].token = t;
    ctrl[ln].pos += 1u;
    for (var i = 0u; i < min(ctrl[ln].n_stop, 4u); i++) {
        if (ctrl[ln].stop_ids[i] == t) {
            ctrl[ln].stopped = 1u;
        }
    }
}

// PCG's output permutation as a hash; the same as sampling::pcg_hash on the host.
fn pcg_hash(x: u32) -> u32 {
    let state = x * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

// sampling::uniform for positions below 2^32.
fn uniform01(key: u32, pos: u32) -> f32 {
    let h = pcg_hash(key ^ pcg_hash(pos ^ pcg_hash(0u)));
    return f32(h >> 8u) * (1.0 / 16777216.0);
}
