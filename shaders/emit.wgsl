// Writes the chosen token into the control block (argmax and sample share it): the next
// embed reads it, the position advances, and a stop token stops later state updates.
// Needs `ctrl` bound read_write.

fn emit_token(t: u32) {
    if (ctrl.stopped != 0u) {
        return;
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
