// Shared by every kernel (prepended by gpu::shader::assemble). Constants come first,
// written by the host: WG (threads per workgroup) and whatever the kernel declares.

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

// NaN or ±Inf, tested on the bits: a compiler may assume float values are finite.
fn is_nonfinite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u;
}

// Does value v of id i rank before bv of id bi? The higher value, then the lower id; NaN
// never wins. The greedy rule over tokens (argmax.wgsl, the lm_head's per-workgroup
// winners) and the MoE routers' order of experts and groups (route_select.wgsl), as the CPU
// reference ranks them.
fn ranks_before(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    return v > bv || (v == bv && i < bi);
}

// log(1 + e^x), and x itself above 20, as every Mamba2 implementation does.
fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    return log(1.0 + exp(x));
}

// The control block shared by the token's kernels (see gpu/graph.rs, `Ctrl`).
struct Ctrl {
    token: u32,      // the token the next embed reads; the sampler writes it
    pos: u32,        // position of the next sampled token (seeds the draw)
    stopped: u32,    // 1 once a stop token was sampled: state updates become no-ops
    n_stop: u32,
    stop_ids: array<u32, 4>,
    seed_key: u32,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    cursor: u32,     // prefill: index of the prompt token being fed
    prompt_len: u32,
    kv_len: u32,     // rows already in the KV caches: where the token being fed is stored
    nonfinite: u32,  // set by the sampler when a logit is NaN or ±Inf (never cleared)
}

#if REDUCE
// Workgroup sums of RV values per thread. With subgroups: one subgroupAdd per value and
// a shared-memory pass over the subgroup totals (any subgroup size: 4…128). Without: a
// shared-memory tree. Every thread of the workgroup must call it (uniform control flow).
const RED_SLOTS: u32 = RV * WG;
var<workgroup> red: array<f32, RED_SLOTS>;

fn wg_sum(v: array<f32, RV>, lid: u32, sg_lane: u32, sg_size: u32) -> array<f32, RV> {
    var out: array<f32, RV>;
#if SUBGROUP
    let sg = lid / sg_size;
    let nsg = (WG + sg_size - 1u) / sg_size;
    for (var i = 0u; i < RV; i++) {
        let s = subgroupAdd(v[i]);
        if (sg_lane == 0u) {
            red[i * WG + sg] = s;
        }
    }
    workgroupBarrier();
    for (var i = 0u; i < RV; i++) {
        var t = 0.0;
        for (var s = 0u; s < nsg; s++) {
            t += red[i * WG + s];
        }
        out[i] = t;
    }
#else
    for (var i = 0u; i < RV; i++) {
        red[i * WG + lid] = v[i];
    }
    workgroupBarrier();
    var stride = 1u;
    while (stride * 2u < WG) {
        stride *= 2u;
    }
    for (; stride > 0u; stride /= 2u) {
        if (lid < stride && lid + stride < WG) {
            for (var i = 0u; i < RV; i++) {
                red[i * WG + lid] += red[i * WG + lid + stride];
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < RV; i++) {
        out[i] = red[i * WG];
    }
#endif
    workgroupBarrier();
    return out;
}
#endif

#if TEAM_REDUCE
// Sum over a team of TEAM consecutive invocations (TEAM a power of two); the team's first
// lane gets the total, every lane of it with TEAM_ALL (the batch GEMV, whose lanes write
// the totals side by side; the one-token kernels' totals go out from one lane, and its
// extra sums cost Codestral's one-token decode 1 %, run 124). With TEAM_SHUFFLE, groups
// of SUB lanes (SUB ≤ the subgroup size, so each lies inside one subgroup) reduce by a butterfly of subgroupShuffleXor, and the
// TEAM/SUB partials of a team meet in workgroup memory. Otherwise a workgroup-memory tree.
// Every invocation of the workgroup must call it (uniform control flow).
var<workgroup> team_red: array<f32, WG>;

fn team_sum(v: f32, lid: u32) -> f32 {
#if TEAM_SHUFFLE
    var s = v;
    for (var o = SUB / 2u; o > 0u; o /= 2u) {
        s += subgroupShuffleXor(s, o);
    }
    if (TEAM == SUB) {
        return s;
    }
    if (lid % SUB == 0u) {
        team_red[lid / SUB] = s;
    }
    workgroupBarrier();
    // The pieces summed in order (by every lane with TEAM_ALL).
    var t = 0.0;
#if !TEAM_ALL
    if (lid % TEAM == 0u) {
#endif
#if TEAM_ALL
        let first = (lid / TEAM) * (TEAM / SUB);
#else
        let first = lid / SUB;
#endif
        for (var i = 0u; i < TEAM / SUB; i++) {
            t += team_red[first + i];
        }
#if !TEAM_ALL
    }
#endif
    workgroupBarrier();
    return t;
#else
    team_red[lid] = v;
    workgroupBarrier();
    for (var o = TEAM / 2u; o > 0u; o /= 2u) {
        if ((lid % TEAM) < o) {
            team_red[lid] += team_red[lid + o];
        }
        workgroupBarrier();
    }
    let t = team_red[lid - lid % TEAM];
    workgroupBarrier();
    return t;
#endif
}
#endif

#if Q8_OUT
// q8 activation blocks of a chunk of WG consecutive elements starting at `first` (a
// multiple of 32) of a row that starts at element `base` (a multiple of 32), the way the
// q8_0 GEMV reads them: d = amax/127, q = round(v/d) (ties to even), four int8 per u32
// (model::quant mirrors it). Every invocation calls it with its own element's value (0
// past the end); blocks from NB on (in the row) are not written, nor (Q8_ROWS, the expert
// up projection's folded activation) elements from R on: the next workgroup's rows; nor
// (Q8_BLOCK, the experts' down pass making the next pre-norm) elements from TR on.
// Word i of the q8 values and scale b of the blocks: to the output buffers, or (X_LOCAL,
// the pre-norm folded into a GEMV) to the workgroup's own vec4 words.
fn q8_put(i: u32, word: u32) {
#if X_LOCAL
    xq[i / 4u][i % 4u] = word;
#else
    xq[i] = word;
#endif
}

fn q8_put_d(b: u32, d: f32) {
    xd[b] = d;
}

fn q8_live(lid: u32) -> bool {
#if Q8_ROWS
    return lid < R;
#else
#if Q8_BLOCK
    return lid < TR;
#else
    return true;
#endif
#endif
}

#if Q8_SHUFFLE
// Each block's absmax by shuffles within pieces of Q8SUB lanes (a power of two, 4…32, at
// most the smallest subgroup), the pieces of a block (32 / Q8SUB) combined in workgroup
// memory; the four values of a word gathered by shuffles too. No barrier when a subgroup
// holds a whole block: the norms' and activations' q8 output was a chain of two barriers
// and a 32-step serial max.
var<workgroup> q8_part: array<f32, WG / Q8SUB>;

fn q8_chunk(v: f32, lid: u32, first: u32, base: u32) {
    var amax = abs(v);
    for (var o = Q8SUB / 2u; o > 0u; o /= 2u) {
        amax = max(amax, subgroupShuffleXor(amax, o));
    }
    if (Q8SUB < 32u) {
        if (lid % Q8SUB == 0u) {
            q8_part[lid / Q8SUB] = amax;
        }
        workgroupBarrier();
        let p0 = (lid / 32u) * (32u / Q8SUB);
        for (var i = 0u; i < 32u / Q8SUB; i++) {
            amax = max(amax, q8_part[p0 + i]);
        }
        workgroupBarrier();
    }
    let d = amax / 127.0;
    var inv = 0.0;
    if (d > 0.0) {
        inv = 1.0 / d;
    }
    let q = clamp(i32(round(v * inv)), -127, 127);
    let q1 = subgroupShuffleXor(q, 1u);
    let q2 = subgroupShuffleXor(q, 2u);
    let q3 = subgroupShuffleXor(q, 3u);
    if ((first + lid) / 32u < NB && q8_live(lid)) {
        if (lid % 32u == 0u) {
            q8_put_d((base + first + lid) / 32u, d);
        }
        if (lid % 4u == 0u) {
            q8_put((base + first + lid) / 4u, pack4xI8(vec4<i32>(q, q1, q2, q3)));
        }
    }
}
#else
var<workgroup> q8_vals: array<f32, WG>;
var<workgroup> q8_inv: array<f32, WG / 32u>;

fn q8_chunk(v: f32, lid: u32, first: u32, base: u32) {
    q8_vals[lid] = v;
    workgroupBarrier();
    let blk = first / 32u + lid;
    if (lid < WG / 32u) {
        var amax = 0.0;
        for (var i = 0u; i < 32u; i++) {
            amax = max(amax, abs(q8_vals[lid * 32u + i]));
        }
        let d = amax / 127.0;
        var inv = 0.0;
        if (d > 0.0) {
            inv = 1.0 / d;
        }
        q8_inv[lid] = inv;
        if (blk < NB && q8_live(32u * lid)) {
            q8_put_d(base / 32u + blk, d);
        }
    }
    workgroupBarrier();
    if (lid % 4u == 0u && (first + lid) / 32u < NB && q8_live(lid)) {
        let f = vec4<f32>(q8_vals[lid], q8_vals[lid + 1u], q8_vals[lid + 2u], q8_vals[lid + 3u]) * q8_inv[lid / 32u];
        q8_put((base + first + lid) / 4u, pack4xI8(clamp(vec4<i32>(round(f)), vec4<i32>(-127), vec4<i32>(127))));
    }
}
#endif
#endif
