// Shared by every kernel (prepended by gpu::shader::assemble). Constants come first,
// written by the host: WG (threads per workgroup) and whatever the kernel declares.

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
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
    pad0: u32,
    pad1: u32,
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
