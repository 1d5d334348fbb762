// The next block's RMS pre-norm, made by the one-token kernel that finishes the residual
// (the experts' last down pass, expert_gemv.wgsl; a block's last GEMV, gemv.wgsl): the q8
// blocks of x ⊙ w (norm weights `tparams[NW_OFF..]`) without the 1/rms, which the next
// GEMV applies (gemv.wgsl's X_GROUP with one group), and Σx² per block of 32 rows
// (`tpart`), from which it takes the 1/rms. The rows go in chunks of TR = max(R, 32): a
// chunk's rows come from TR / R workgroups; each counts itself in `tcount[chunk's first
// block]` after its rows, and the one that counts last makes the chunk (and sets the count
// back to 0 for the next token). The including kernel binds the residual as `dst`
// (atomic<u32>: the last workgroup reads rows that other workgroups wrote) and writes its
// rows with `tail_add`; common.wgsl's q8_chunk writes `txq`/`txd` (Q8_BLOCK).
#if NORM_TAIL
@group(0) @binding(17) var<storage, read_write> txq: array<u32>;
@group(0) @binding(18) var<storage, read_write> txd: array<f32>;
@group(0) @binding(19) var<storage, read> tparams: array<f32>;
@group(0) @binding(20) var<storage, read_write> tpart: array<f32>;
@group(0) @binding(21) var<storage, read_write> tcount: array<atomic<u32>>;
var<workgroup> tail_last: u32;
var<workgroup> tail_sq: array<f32, TR>;

// dst[i] += v, through the atomic view (one writer per row).
fn tail_add(i: u32, v: f32) {
    atomicStore(&dst[i], bitcast<u32>(bitcast<f32>(atomicLoad(&dst[i])) + v));
}

// After the workgroup's rows from r0 went into the residual. Call from uniform control
// flow.
fn norm_tail(lid: u32, r0: u32) {
    // Release: the rows this workgroup wrote, before its count (WGSL's atomics are
    // relaxed; the barrier's device-scope fence orders them).
    storageBarrier();
    if (r0 >= M) {
        return;
    }
    let first = (r0 / TR) * TR;
    if (lid == 0u) {
        let expect = (min(first + TR, M) - first + R - 1u) / R;
        tail_last = u32(atomicAdd(&tcount[first / 32u], 1u) + 1u == expect);
    }
    if (workgroupUniformLoad(&tail_last) == 0u) {
        return;
    }
    // Acquire: the chunk's other rows, which the other workgroups released.
    storageBarrier();
    let r = first + lid;
    var x = 0.0;
    var v = 0.0;
    if (lid < TR && r < M) {
        x = bitcast<f32>(atomicLoad(&dst[r]));
        v = x * tparams[NW_OFF + r];
    }
    if (lid < TR) {
        tail_sq[lid] = x * x;
    }
    q8_chunk(v, lid, first, 0u);
    workgroupBarrier();
    if (lid < TR / 32u) {
        // In row order, whichever workgroup came last: the same bits every token.
        var s = 0.0;
        for (var i = 0u; i < 32u; i++) {
            s += tail_sq[32u * lid + i];
        }
        if (first / 32u + lid < NB) {
            tpart[first / 32u + lid] = s;
        }
    }
    if (lid == 0u) {
        atomicStore(&tcount[first / 32u], 0u);
    }
}
#endif
