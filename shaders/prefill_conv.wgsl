// The causal conv over a prefill block: for an xBC channel c, u[t][c] = silu(b + Σ_j
// w[c][j]·in[t−K+1+j]) where in[s] is the block's raw input (mix rows of DIP) for s ≥ 0 and
// the cached conv state before it; u goes to its own buffer (rows of CD), so the raw inputs
// stay readable by every token. For a dt column, δ = softplus(dt + b) clamped to the
// time-step limit, in place. The new conv state is written by prefill_conv_state once every
// token has read the old one.
// One invocation per column and run of TPI tokens: the column's weights stay in registers
// and (K ≤ 4) its last four inputs slide through a vec4, so each input is read once, not K
// times (one invocation per (column, token) reloaded all of them: 27 ms of Codestral's 4096
// tokens on the H200). The sum runs in the same order as that version's.

@group(0) @binding(0) var<storage, read_write> mix: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read> conv_state: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;
@group(0) @binding(4) var<storage, read_write> u: array<f32>;

// Input position s of column col: from the block (s ≥ 0) or the cached columns (s ≥ −(K−1)),
// zero before those (the window's slots past K).
fn conv_input(col: u32, s: i32) -> f32 {
    if (s >= 0) {
        return mix[u32(s) * DIP + DI + col];
    }
    if (s >= -i32(KC - 1u)) {
        return conv_state[col * (KC - 1u) + u32(i32(KC - 1u) + s)];
    }
    return 0.0;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let t0 = gid.y * TPI;
    let tokens = ctrl.prompt_len;
    if (col >= CD + H || t0 >= tokens) {
        return;
    }
    let t_end = min(t0 + TPI, tokens);
    if (col >= CD) {
        let h = col - CD;
        let db = params[DTB_OFF + h];
        for (var t = t0; t < t_end; t++) {
            let i = t * DIP + DI + CD + h;
            mix[i] = clamp(softplus(mix[i] + db), DT_MIN, DT_MAX);
        }
        return;
    }
    let b = params[CB_OFF + col];
#if WIN4
    // Weights aligned with the window (positions t−3 … t): zeros before the first of K.
    var w = vec4<f32>(0.0);
    for (var j = 0u; j < KC; j++) {
        w[4u - KC + j] = params[CW_OFF + col * KC + j];
    }
    let s0 = i32(t0);
    var win = vec4<f32>(0.0, conv_input(col, s0 - 3), conv_input(col, s0 - 2), conv_input(col, s0 - 1));
    for (var t = t0; t < t_end; t++) {
        win = vec4<f32>(win.yzw, mix[t * DIP + DI + col]);
        var acc = b;
        // The first 4 − K terms are 0·0: the sum is the K-term one, in its order.
        acc += w.x * win.x;
        acc += w.y * win.y;
        acc += w.z * win.z;
        acc += w.w * win.w;
        u[t * CD + col] = silu(acc);
    }
#else
    for (var t = t0; t < t_end; t++) {
        var acc = b;
        for (var j = 0u; j < KC; j++) {
            acc += params[CW_OFF + col * KC + j] * conv_input(col, i32(t) - i32(KC - 1u) + i32(j));
        }
        u[t * CD + col] = silu(acc);
    }
#endif
}
