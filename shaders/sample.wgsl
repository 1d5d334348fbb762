// Seeded sampling on the device, the rule of src/sampling.rs: p = exp((l − max)/T); keep
// p ≥ τ_k (the k-th largest p) and p ≥ τ_p (the largest τ whose kept mass reaches top_p of
// the total); draw u = uniform(seed, pos) and walk the kept mass in index order. The
// thresholds are found exactly by bisection on the bits of p (non-negative floats order
// like their bit patterns). A NaN or ±Inf logit sets ctrl.nonfinite (the host reports it).
// One workgroup per lane (workgroup x; `logits`, `probs [lane][V]`, `ctrl[lane]`); `probs`
// is scratch.

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> ctrl: array<Ctrl>;
@group(0) @binding(2) var<storage, read_write> probs: array<f32>;

var<workgroup> red: array<f32, WG>;
var<workgroup> scan: array<f32, WG>;
var<workgroup> pick: atomic<u32>;
var<workgroup> total: f32;
var<workgroup> opt_k: u32;
var<workgroup> opt_p: f32;
var<workgroup> any_bad: atomic<u32>; // a NaN or ±Inf logit was seen

fn wg_total(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        total = red[0];
    }
    return workgroupUniformLoad(&total);
}

fn wg_max(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        total = red[0];
    }
    return workgroupUniformLoad(&total);
}

// Σ over kept p with bits ≥ t (mass) or their count.
fn above(t: u32, floor_bits: u32, count: bool, lid: u32) -> f32 {
    var s = 0.0;
    for (var k = lid; k < V; k += WG) {
        let b = bitcast<u32>(probs[lo + k]);
        if (b >= t && b >= floor_bits) {
            s += select(probs[lo + k], 1.0, count);
        }
    }
    return wg_total(s, lid);
}

// The largest t with above(t) ≥ goal.
fn threshold(goal: f32, floor_bits: u32, count: bool, lid: u32) -> u32 {
    var lo = 0u;
    var hi = 0x7f800001u;
    for (var i = 0u; i < 32u; i++) {
        if (hi - lo <= 1u) {
            break;
        }
        let mid = lo + (hi - lo) / 2u;
        if (above(mid, floor_bits, count, lid) >= goal) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
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
    let temp = ctrl[ln].temperature;
    var m = -3.4e38;
    var bad = false;
    for (var k = lid; k < V; k += WG) {
        let l = logits[lo + k];
        m = max(m, l);
        bad = bad || is_nonfinite(l);
    }
    if (bad) {
        atomicOr(&any_bad, 1u);
    }
    m = wg_max(m, lid);
    for (var k = lid; k < V; k += WG) {
        let l = logits[lo + k];
        probs[lo + k] = select(0.0, exp((l - m) / temp), l == l);
    }
    if (lid == 0u) {
        opt_k = ctrl[ln].top_k;
        opt_p = ctrl[ln].top_p;
    }
    storageBarrier();
    let top_k = workgroupUniformLoad(&opt_k);
    let top_p = workgroupUniformLoad(&opt_p);
    var floor_bits = 0u;
    if (top_k > 0u && top_k < V) {
        floor_bits = threshold(f32(top_k), 0u, true, lid);
    }
    if (top_p < 1.0) {
        let kept = above(0u, floor_bits, false, lid);
        floor_bits = max(floor_bits, threshold(top_p * kept, floor_bits, false, lid));
    }
    // Chunked prefix sums of the kept mass in index order, then the chunk holding u·total.
    let chunk = (V + WG - 1u) / WG;
    let start = lid * chunk;
    let end = min(start + chunk, V);
    var s = 0.0;
    for (var k = start; k < end; k++) {
        if (bitcast<u32>(probs[lo + k]) >= floor_bits) {
            s += probs[lo + k];
        }
    }
    scan[lid] = s;
    if (lid == 0u) {
        atomicStore(&pick, 0xffffffffu);
    }
    workgroupBarrier();
    if (lid == 0u) {
        var acc = 0.0;
        for (var i = 0u; i < WG; i++) {
            let c = scan[i];
            scan[i] = acc;
            acc += c;
        }
        red[0] = acc;
    }
    workgroupBarrier();
    let goal = uniform01(ctrl[ln].seed_key, ctrl[ln].pos) * red[0];
    var cum = scan[lid];
    var last = 0xffffffffu;
    for (var k = start; k < end; k++) {
        let p = probs[lo + k];
        if (bitcast<u32>(p) >= floor_bits && p > 0.0) {
            cum += p;
            last = k;
            if (cum > goal) {
                atomicMin(&pick, k);
                break;
            }
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        var t = atomicLoad(&pick);
        if (t == 0xffffffffu) {
            // Rounding left the goal past the end: the last kept token.
            for (var k = V; k > 0u; k--) {
                if (bitcast<u32>(probs[lo + k - 1u]) >= floor_bits && probs[lo + k - 1u] > 0.0) {
                    t = k - 1u;
                    break;
                }
            }
        }
        if (t == 0xffffffffu) {
            // Nothing was kept (non-finite logits): an id inside the vocabulary all the
            // same, as argmax does, never one the next embed cannot read.
            t = 0u;
        }
        emit_token(t, atomicLoad(&any_bad) != 0u);
    }
}
