// Greedy sampling on the device: ctrl.token = argmax(logits) (lowest id on ties; NaN never
// wins), unless a stop token was already sampled; a NaN or ±Inf logit sets ctrl.nonfinite.
// One workgroup of WG threads per lane (workgroup x; `logits [lane][V]`, `ctrl[lane]`), each
// keeping LPT independent loads in flight per round.

// PARTS (one token): the lm_head GEMV's per-workgroup winners `parts [NP]` (bits of the
// value, id, non-finite flag, 0) instead of the logits: the same token, the same flag.
#if PARTS
@group(0) @binding(0) var<storage, read> parts: array<vec4<u32>>;
#else
@group(0) @binding(0) var<storage, read> logits: array<f32>;
#endif
@group(0) @binding(1) var<storage, read_write> ctrl: array<Ctrl>;

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;
var<workgroup> any_bad: atomic<u32>; // a NaN or ±Inf logit was seen

// Is (v, i) better than (bv, bi)?
fn better(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    return v > bv || (v == bv && i < bi);
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    if (enter_lane(wid.x, lid)) {
        return;
    }
    if (lid == 0u) {
        atomicStore(&any_bad, 0u);
    }
    workgroupBarrier();
    var bv = -3.4e38;
    var bi = 0xffffffffu;
    var bad = false;
    // LPT loads per invocation and round, all issued before the first compare (straight-line
    // variables: a round is one memory latency, not LPT of them).
#if PARTS
    for (var base = 0u; base < NP; base += LPT * WG) {
#for j LPT
        let k{j} = base + {j}u * WG + lid;
        var p{j} = vec4<u32>(0u, 0xffffffffu, 0u, 0u);
        if (k{j} < NP) {
            p{j} = parts[k{j}];
        }
#endfor
#for j LPT
        if (k{j} < NP) {
            bad = bad || p{j}.z != 0u;
            if (better(bitcast<f32>(p{j}.x), p{j}.y, bv, bi)) {
                bv = bitcast<f32>(p{j}.x);
                bi = p{j}.y;
            }
        }
#endfor
    }
#else
    for (var base = 0u; base < V; base += LPT * WG) {
#for j LPT
        let k{j} = base + {j}u * WG + lid;
        var v{j} = -3.4e38;
        if (k{j} < V) {
            v{j} = logits[lo + k{j}];
        }
#endfor
#for j LPT
        if (k{j} < V) {
            bad = bad || is_nonfinite(v{j});
            if (better(v{j}, k{j}, bv, bi)) {
                bv = v{j};
                bi = k{j};
            }
        }
#endfor
    }
#endif
    if (bad) {
        atomicOr(&any_bad, 1u);
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride && better(best_v[lid + stride], best_i[lid + stride], best_v[lid], best_i[lid])) {
            best_v[lid] = best_v[lid + stride];
            best_i[lid] = best_i[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        var t = best_i[0];
        if (t == 0xffffffffu) {
            t = 0u;
        }
        emit_token(t, atomicLoad(&any_bad) != 0u);
    }
}
