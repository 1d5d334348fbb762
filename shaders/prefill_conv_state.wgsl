// After a prefill block's conv: the conv state becomes the last K−1 raw inputs (from the
// block, or still from the old state when the block is shorter than K−1). One invocation
// per channel; it reads all of its old columns before writing any.

@group(0) @binding(0) var<storage, read> mix: array<f32>;
@group(0) @binding(1) var<storage, read_write> conv_state: array<f32>;
@group(0) @binding(2) var<storage, read> ctrl: Ctrl;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    if (col >= CD) {
        return;
    }
    let tokens = i32(ctrl.prompt_len);
    var next: array<f32, KC>;
    for (var j = 0u; j + 1u < KC; j++) {
        // Column j of the new state is input position T − (K−1) + j.
        let s = tokens - i32(KC - 1u) + i32(j);
        if (s >= 0) {
            next[j] = mix[u32(s) * DIP + DI + col];
        } else {
            next[j] = conv_state[col * (KC - 1u) + u32(i32(KC - 1u) + s)];
        }
    }
    for (var j = 0u; j + 1u < KC; j++) {
        conv_state[col * (KC - 1u) + j] = next[j];
    }
}
