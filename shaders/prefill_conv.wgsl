// The causal conv over a prefill block: for each xBC channel, the cached K−1 inputs then
// the block's T inputs (mix rows of DIP values), u = silu(conv + b) written in place, and
// the last K−1 inputs left as the new conv state; for each dt column δ = softplus(dt + b)
// clamped to the time-step limit. One invocation per column, walking the tokens in order
// (it keeps the window in registers, so writing in place is safe).

@group(0) @binding(0) var<storage, read_write> mix: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read_write> conv_state: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let tokens = ctrl.prompt_len;
    if (col >= CD + H) {
        return;
    }
    if (col >= CD) {
        let h = col - CD;
        for (var t = 0u; t < tokens; t++) {
            let i = t * DIP + DI + CD + h;
            mix[i] = clamp(softplus(mix[i] + params[DTB_OFF + h]), DT_MIN, DT_MAX);
        }
        return;
    }
    var win: array<f32, KC>;
    for (var j = 0u; j + 1u < KC; j++) {
        win[j] = conv_state[col * (KC - 1u) + j];
    }
    let bias = params[CB_OFF + col];
    for (var t = 0u; t < tokens; t++) {
        let i = t * DIP + DI + col;
        win[KC - 1u] = mix[i];
        var acc = bias;
        for (var j = 0u; j < KC; j++) {
            acc += params[CW_OFF + col * KC + j] * win[j];
        }
        mix[i] = silu(acc);
        for (var j = 0u; j + 1u < KC; j++) {
            win[j] = win[j + 1u];
        }
    }
    for (var j = 0u; j + 1u < KC; j++) {
        conv_state[col * (KC - 1u) + j] = win[j];
    }
}
