// Writes the chosen token into the control block (argmax and sample share it): the next
// embed reads it, the position advances, and a stop token stops later state updates.
// `bad`: some logit was NaN or ±Inf — flagged in `ctrl.nonfinite` for the host, which
// reads it with the token and reports an error (the token itself stays in the vocabulary).
// Needs `ctrl` bound read_write.

fn emit_token(t: u32, bad: bool) {
    if (ctrl.stopped != 0u) {
        return;
    }
    if (bad) {
        ctrl.nonfinite = 1u;
    }
    // The token just fed is in the KV caches now (a stopped step stored nothing).
    ctrl.kv_len += 1u;
    ctrl.token = t;
    ctrl.pos += 1u;
    for (var i = 0u; i < min(ctrl.n_stop, 4u); i++) {
        if (ctrl.stop_ids[i] == t) {
            ctrl.stopped = 1u;
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

// NaN or ±Inf, tested on the bits: a compiler may assume float values are finite.
fn is_nonfinite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u;
}
