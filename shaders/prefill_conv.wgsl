// The causal conv over a prefill block, one invocation per (column, token): for an xBC
// channel c, u[t][c] = silu(b + Σ_j w[c][j]·in[t−K+1+j]) where in[s] is the block's raw
// input (mix rows of DIP) for s ≥ 0 and the cached conv state before it; u goes to its own
// buffer (rows of CD), so the raw inputs stay readable by every token. For a dt column,
// δ = softplus(dt + b) clamped to the time-step limit, in place. The new conv state is
// written by prefill_conv_state once every token has read the old one.

@group(0) @binding(0) var<storage, read_write> mix: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read> conv_state: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;
@group(0) @binding(4) var<storage, read_write> u: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let t = gid.y;
    if (col >= CD + H || t >= ctrl.prompt_len) {
        return;
    }
    if (col >= CD) {
        let h = col - CD;
        let i = t * DIP + DI + CD + h;
        mix[i] = clamp(softplus(mix[i] + params[DTB_OFF + h]), DT_MIN, DT_MAX);
        return;
    }
    var acc = params[CB_OFF + col];
    for (var j = 0u; j < KC; j++) {
        // Input position t − (K−1) + j: from the block, or from the cached columns.
        let s = i32(t) - i32(KC - 1u) + i32(j);
        var v = 0.0;
        if (s >= 0) {
            v = mix[u32(s) * DIP + DI + col];
        } else {
            v = conv_state[col * (KC - 1u) + u32(i32(KC - 1u) + s)];
        }
        acc += params[CW_OFF + col * KC + j] * v;
    }
    u[t * CD + col] = silu(acc);
}
