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

// Candidate k as loaded, nothing computed on it yet (so a round's loads all go out before
// its first compare): a logit (its id k) or, with PARTS, a workgroup's winner (its id and
// non-finite flag as the lm_head wrote them). N candidates in all.
struct Cand {
    v: f32,
    i: u32,
    flag: u32,
}

#if PARTS
const N: u32 = NP;

fn cand(k: u32) -> Cand {
    let p = parts[k];
    return Cand(bitcast<f32>(p.x), p.y, p.z);
}
#else
const N: u32 = V;

fn cand(k: u32) -> Cand {
    return Cand(logits[lo + k], k, 0u);
}
#endif

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
    for (var base = 0u; base < N; base += LPT * WG) {
#for j LPT
        let k{j} = base + {j}u * WG + lid;
        var c{j} = Cand(-3.4e38, 0xffffffffu, 0u);
        if (k{j} < N) {
            c{j} = cand(k{j});
        }
#endfor
#for j LPT
        if (k{j} < N) {
            // (A partial's winner is non-finite only where its flag is set already.)
            bad = bad || c{j}.flag != 0u || is_nonfinite(c{j}.v);
            if (ranks_before(c{j}.v, c{j}.i, bv, bi)) {
                bv = c{j}.v;
                bi = c{j}.i;
            }
        }
#endfor
    }
    if (bad) {
        atomicOr(&any_bad, 1u);
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride && ranks_before(best_v[lid + stride], best_i[lid + stride], best_v[lid], best_i[lid])) {
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
