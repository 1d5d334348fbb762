// The selective state update of one token over a block of CB consecutive channels
// c = h·P + p (a block may span heads; each row uses its own head's δ, A, D and group):
//   S[c,:] = exp(δ_h·A_h)·S[c,:] + δ_h·x[c]·B[g(h),:];   y[c] = C[g(h),:]·S[c,:] + D_h·x[c]
// A team of TEAM invocations owns a row; lane j holds the state columns n ≡ j (mod TEAM),
// so a team reads its row contiguously. Reads the mixer row vector `mix` = [z | x B C | δ].
// GATED (fused graph): writes u = y·silu(z)·w_norm for the out_proj GEMV and the block's
// Σ(y·silu(z))² (`part`), from which out_proj applies each group's 1/rms; with Q8_OUT
// also the block's q8 activation (CB = 32).
// Lanes (batched decode): workgroup row y is lane l, whose vectors start at l·MIX_LS,
// l·Y_LS, l·PART_LS, l·XQ_LS, l·XD_LS and whose slot's state at l·STATE_LS.

@group(0) @binding(0) var<storage, read> mix: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
#if VEC4
@group(0) @binding(2) var<storage, read_write> state: array<vec4<f32>>;
#else
@group(0) @binding(2) var<storage, read_write> state: array<f32>;
#endif
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if GATED
@group(0) @binding(4) var<storage, read_write> part: array<f32>;
var<workgroup> vals: array<f32, CB>;
var<workgroup> sq: array<f32, CB>;
#endif
@group(0) @binding(5) var<storage, read> ctrl: array<Ctrl>;
#if Q8_OUT
@group(0) @binding(6) var<storage, read_write> xq: array<u32>;
@group(0) @binding(7) var<storage, read_write> xd: array<f32>;
#endif

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = lid / TEAM;
    let lane = lid % TEAM;
    let l = wid.y;
    let mo = l * MIX_LS;
    let c = wid.x * CB + r;
    let h = c / P;
    let g = h / (H / G);
    let delta = mix[mo + DI + CD + h];
    let alpha = exp(delta * params[A_OFF + h]);
    let xv = mix[mo + DI + c];
    let dx = delta * xv;
    let live = ctrl[l].stopped == 0u;
    let bbase = mo + DI + DI + g * N;
    let cbase = mo + DI + DI + G * N + g * N;
#if VEC4
    // Four consecutive state columns per lane and step (one 16-byte load and store), SPL
    // steps TEAM vectors apart; all of a lane's state loads go out before its first sum.
    // The row's sum is the one a team of RTEAM lanes (one step each, the one-token
    // kernel's) reduces: val[q] is what its lane lane + TEAM·q holds, and the steps of its
    // butterfly that pair lanes of this invocation run here, in the same order, so a
    // batch's rows equal their one-token sums bit for bit whatever TEAM is.
    var val: array<f32, FQ>;
#for i SPL
    let n4_{i} = lane + {i}u * TEAM;
    let idx_{i} = l * (STATE_LS / 4u) + c * (N / 4u) + n4_{i};
    var s_{i} = vec4<f32>(0.0);
    if (n4_{i} < N / 4u) {
        s_{i} = state[idx_{i}];
    }
#endfor
#for i SPL
    if (n4_{i} < N / 4u) {
        let n = 4u * n4_{i};
        let bv = vec4<f32>(mix[bbase + n], mix[bbase + n + 1u], mix[bbase + n + 2u], mix[bbase + n + 3u]);
        let cv = vec4<f32>(mix[cbase + n], mix[cbase + n + 1u], mix[cbase + n + 2u], mix[cbase + n + 3u]);
        let s = alpha * s_{i} + dx * bv;
        if (live) {
            state[idx_{i}] = s;
        }
        val[{i}u % FQ] += dot(cv, s);
    }
#endfor
    var total = 0.0;
    if (FQ == 1u) {
        total = team_sum(val[0], lid);
    } else {
        // The one-token team's butterfly steps m ≥ TEAM within its pieces of RSUB lanes.
        for (var m = RSUB / 2u; m >= TEAM; m /= 2u) {
            let f = m / TEAM;
            var nv: array<f32, FQ>;
            for (var q = 0u; q < FQ; q++) {
                nv[q] = val[q] + val[q ^ f];
            }
            val = nv;
        }
        // Its steps below TEAM (this team's own butterfly), then its pieces in order.
        if (RTEAM == RSUB) {
            total = team_sum(val[0], lid);
        } else {
            for (var k = 0u; k < RTEAM / RSUB; k++) {
                total += team_sum(val[k * (RSUB / TEAM)], lid);
            }
        }
    }
#else
    var acc = 0.0;
    for (var n = lane; n < N; n += TEAM) {
        let idx = l * STATE_LS + c * N + n;
        let s = alpha * state[idx] + dx * mix[bbase + n];
        if (live) {
            state[idx] = s;
        }
        acc += mix[cbase + n] * s;
    }
    let total = team_sum(acc, lid);
#endif
    let out = total + params[D_OFF + h] * xv;
#if GATED
    let v = out * silu(mix[mo + c]);
    if (lane == 0u) {
        y[l * Y_LS + c] = v * params[NW_OFF + c];
        vals[r] = v * params[NW_OFF + c];
        sq[r] = v * v;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var s = 0.0;
        for (var i = 0u; i < CB; i++) {
            s += sq[i];
        }
        part[l * PART_LS + wid.x] = s;
    }
#if Q8_OUT
    // The block's q8 activation: 8 invocations pack 4 values each.
    if (lid < 8u) {
        var amax = 0.0;
        for (var i = 0u; i < 32u; i++) {
            amax = max(amax, abs(vals[i]));
        }
        let d = amax / 127.0;
        var inv = 0.0;
        if (d > 0.0) {
            inv = 1.0 / d;
        }
        let f = vec4<f32>(vals[4u * lid], vals[4u * lid + 1u], vals[4u * lid + 2u], vals[4u * lid + 3u]) * inv;
        xq[l * XQ_LS + wid.x * 8u + lid] = pack4xI8(clamp(vec4<i32>(round(f)), vec4<i32>(-127), vec4<i32>(127)));
        if (lid == 0u) {
            xd[l * XD_LS + wid.x] = d;
        }
    }
#endif
#else
    if (lane == 0u) {
        y[l * Y_LS + c] = out;
    }
#endif
}
