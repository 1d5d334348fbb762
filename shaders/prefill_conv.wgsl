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

// COL4 (K ≤ 4; DIP, DI, CD and H multiples of 4): each invocation takes four adjacent
// columns through 16-byte loads and stores, the same sums per column.
#if COL4
@group(0) @binding(0) var<storage, read_write> mix: array<vec4<f32>>;
#if U16
// U16 (with COL4): u in f16, for the SSD kernels on cooperative matrices (conv_out.wgsl).
@group(0) @binding(4) var<storage, read_write> u: array<vec2<u32>>;
#else
@group(0) @binding(4) var<storage, read_write> u: array<vec4<f32>>;
#endif
#else
@group(0) @binding(0) var<storage, read_write> mix: array<f32>;
@group(0) @binding(4) var<storage, read_write> u: array<f32>;
#endif
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read> conv_state: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;

// Columns per invocation, and their values (one or a vec4).
#if COL4
alias Cv = vec4<f32>;
const CPI: u32 = 4u;

fn params_c(at: u32) -> Cv {
    return vec4<f32>(params[at], params[at + 1u], params[at + 2u], params[at + 3u]);
}

fn softplus_c(v: Cv) -> Cv {
    return vec4<f32>(softplus(v.x), softplus(v.y), softplus(v.z), softplus(v.w));
}

// Stores four columns of u at slice i.
fn put_u(i: u32, v: vec4<f32>) {
#if U16
    u[i] = vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
#else
    u[i] = v;
#endif
}

// Input position s of columns col .. col+3 (as conv_input).
fn conv_input4(col: u32, s: i32) -> vec4<f32> {
    if (s >= 0) {
        return mix[(u32(s) * DIP + DI + col) / 4u];
    }
    var v = vec4<f32>(0.0);
    if (s >= -i32(KC - 1u)) {
        for (var q = 0u; q < 4u; q++) {
            v[q] = conv_state[(col + q) * (KC - 1u) + u32(i32(KC - 1u) + s)];
        }
    }
    return v;
}

// silu(b + Σ_j w_j·x_j) of four columns, the taps in order (positions t−3 … t).
fn conv4(b: vec4<f32>, w: array<vec4<f32>, 4>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> vec4<f32> {
    var acc = b;
    acc += w[0] * x0;
    acc += w[1] * x1;
    acc += w[2] * x2;
    acc += w[3] * x3;
    return acc / (1.0 + exp(-acc));
}

#else
alias Cv = f32;
const CPI: u32 = 1u;

fn params_c(at: u32) -> Cv {
    return params[at];
}

fn softplus_c(v: Cv) -> Cv {
    return softplus(v);
}

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
#endif

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = CPI * gid.x;
    let t0 = gid.y * TPI;
    let tokens = ctrl.prompt_len;
    if (col >= CD + H || t0 >= tokens) {
        return;
    }
    let t_end = min(t0 + TPI, tokens);
    if (col >= CD) {
        let h = col - CD;
        let db = params_c(DTB_OFF + h);
        for (var t = t0; t < t_end; t++) {
            let i = (t * DIP + DI + CD + h) / CPI;
            mix[i] = clamp(softplus_c(mix[i] + db), Cv(DT_MIN), Cv(DT_MAX));
        }
        return;
    }
    let b = params_c(CB_OFF + col);
#if COL4
    // Tap j of the window (positions t−3 … t) for the four columns: zeros before the first
    // of K.
    var w: array<vec4<f32>, 4>;
    for (var j = 0u; j < KC; j++) {
        for (var q = 0u; q < 4u; q++) {
            w[4u - KC + j][q] = params[CW_OFF + (col + q) * KC + j];
        }
    }
    let s0 = i32(t0);
    var x0 = conv_input4(col, s0 - 3);
    var x1 = conv_input4(col, s0 - 2);
    var x2 = conv_input4(col, s0 - 1);
    if (t_end == t0 + TPI) {
        // A whole run: all its rows' loads go out before the first sum.
#for i TPI
        let r{i} = mix[((t0 + {i}u) * DIP + DI + col) / 4u];
#endfor
#for i TPI
        put_u(((t0 + {i}u) * CD + col) / 4u, conv4(b, w, x0, x1, x2, r{i}));
        x0 = x1;
        x1 = x2;
        x2 = r{i};
#endfor
        return;
    }
    for (var t = t0; t < t_end; t++) {
        let x3 = mix[(t * DIP + DI + col) / 4u];
        put_u((t * CD + col) / 4u, conv4(b, w, x0, x1, x2, x3));
        x0 = x1;
        x1 = x2;
        x2 = x3;
    }
#else
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
#endif
}
