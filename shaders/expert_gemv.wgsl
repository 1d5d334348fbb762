// The routed experts' projections, reading the chosen ids from the router's buffers (the
// dispatch never changes; only the chosen experts' rows are read). W is a bank of NE
// experts starting at expert E0: [NE·M, KP] in f32, f16, q8_0 or a 4/5/6-bit block format
// (block_quant.wgsl's layouts), expert e's M rows at
// (e − E0)·M. Teams of TEAM invocations own a row, as in gemv.wgsl. Input vectors are XR
// values apart: XS (KP rounded up to 32), as the norms and activations write them, or for
// an up pass over a batch's lanes the lane stride (IN_LANES: their q8 blocks too, XL).
// LANES_INNER (a batch's lanes): grid z's ZN items (the up pass's choices, the down pass's
// lanes) run side by side for each row block instead, numbered in x and y fastest, so the
// rows of an expert that several lanes chose are read while they are still in cache.
// UP (grid z = t·KS + s, the token's s-th slot): dst[(t·KS + s)·MS + M0 + row] = W_id[row] · x_t
//   (MS = M, M0 = 0 but where an expert's [gate; up] is two banks, each writing its half)
//   where x_t is the token's normed input (f32 `src [T][KP]` or q8 blocks); a workgroup whose
//   expert lives in another bank returns at once. With ROUTE (decode) the pass routes the
//   token in its prologue (route_select.wgsl, the routing kernel's code) instead of
//   reading the ids, and writes the ids and weights for the down pass.
// DOWN (grid z = t): dst[t·MS + row] += Σ_s w[t·KS + s] · W_id(s)[row] · x_(t·KS + s), the
//   slots' activations as inputs: the weighted sum of the experts goes straight into the
//   residual (each bank adds the slots it holds); STORE (the first bank of a latent MoE)
//   writes instead of adding. NORM_TAIL (one token or a batch's lanes, the last bank): the next block's
//   pre-norm made from the finished residual (see `norm_tail`).
// Inputs are q8 blocks with Q8_IN (the quantized formats, the usual case: q8_0 here, the
// 4/5/6-bit blocks through gemv_units.wgsl with block_quant.wgsl's bindings), else f32
// (f32/f16 weights, and q8_0 ones then unpack their int8 values). Every row's total is
// multiplied by RS, the bank's output scale (Granite's residual multiplier on the down
// projections; 1 elsewhere).

#if W_F32
@group(0) @binding(0) var<storage, read> w: array<vec4<f32>>;
const VW: u32 = 4u;
#endif
#if W_F16
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
const VW: u32 = 8u;
#endif
#if W_Q8
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;
const VW: u32 = 16u;
#endif
#if Q8_IN
@group(0) @binding(3) var<storage, read> xq_in: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> xd_in: array<f32>;
#else
@group(0) @binding(2) var<storage, read> src: array<vec4<f32>>;
#endif
#if NORM_TAIL
// The residual, written and read back through atomics: the last workgroup of a q8 block
// reads rows that other workgroups wrote.
@group(0) @binding(5) var<storage, read_write> dst: array<atomic<u32>>;
#else
@group(0) @binding(5) var<storage, read_write> dst: array<f32>;
#endif
#if ROUTE
@group(0) @binding(6) var<storage, read_write> ids: array<u32>;
@group(0) @binding(7) var<storage, read_write> wts: array<f32>;
@group(0) @binding(11) var<storage, read> logits: array<f32>;
#if GROUPED
@group(0) @binding(12) var<storage, read> params: array<f32>;
#endif
#if COUNT
@group(0) @binding(13) var<storage, read_write> counts: array<atomic<u32>>;
#endif
#else
@group(0) @binding(6) var<storage, read> ids: array<u32>;
#endif
#if DOWN
@group(0) @binding(7) var<storage, read> wts: array<f32>;
var<workgroup> down_id: array<u32, KS>;
var<workgroup> down_w: array<f32, KS>;
#if NORM_TAIL
// The next block's RMS pre-norm, made where the residual is finished (decode, per token):
// the q8 blocks of x ⊙ w (norm weights `nparams[NW_OFF..]`) without the 1/rms, which
// the next GEMV applies (gemv.wgsl's X_GROUP with one group), and Σx² per block of 32
// rows (`npart`) from which it takes the 1/rms. The rows go in chunks of TR = max(R, 32):
// a chunk's rows come from TR / R workgroups; each counts itself in `ncount[chunk's first
// block]` after its rows, and the one that counts last makes the chunk (and sets the
// count back to 0 for the next token).
@group(0) @binding(9) var<storage, read_write> xq: array<u32>;
@group(0) @binding(10) var<storage, read_write> xd: array<f32>;
@group(0) @binding(14) var<storage, read> nparams: array<f32>;
@group(0) @binding(15) var<storage, read_write> npart: array<f32>;
@group(0) @binding(16) var<storage, read_write> ncount: array<atomic<u32>>;
var<workgroup> tail_last: u32;
var<workgroup> tail_sq: array<f32, TR>;

// After the workgroup's rows from r0 of token t (a batch's lane) went into the residual.
// A lane's q8 blocks lie TL values apart, its sums and counts NB apart. Call from uniform
// control flow.
fn norm_tail(lid: u32, r0: u32, t: u32) {
    // Release: the rows this workgroup wrote, before its count (WGSL's atomics are
    // relaxed; the barrier's device-scope fence orders them).
    storageBarrier();
    if (r0 >= M) {
        return;
    }
    let first = (r0 / TR) * TR;
    if (lid == 0u) {
        let expect = (min(first + TR, M) - first + R - 1u) / R;
        tail_last = u32(atomicAdd(&ncount[t * NB + first / 32u], 1u) + 1u == expect);
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
        x = bitcast<f32>(atomicLoad(&dst[t * M + r]));
        v = x * nparams[NW_OFF + r];
    }
    if (lid < TR) {
        tail_sq[lid] = x * x;
    }
    q8_chunk(v, lid, first, t * TL);
    workgroupBarrier();
    if (lid < TR / 32u) {
        // In row order, whichever workgroup came last: the same bits every token.
        var s = 0.0;
        for (var i = 0u; i < 32u; i++) {
            s += tail_sq[32u * lid + i];
        }
        if (first / 32u + lid < NB) {
            npart[t * NB + first / 32u + lid] = s;
        }
    }
    if (lid == 0u) {
        atomicStore(&ncount[t * NB + first / 32u], 0u);
    }
}
#endif
#else
var<workgroup> up_id: u32;
#endif
#if ACT
// The folded activation's output: rows of XM values (M, or with ACT_GATED the MH = M/2
// rows of silu(gate)·up, rounded up to 32), and with Q8_OUT
// their q8 blocks (what the down pass reads).
@group(0) @binding(8) var<storage, read_write> mid: array<f32>;
#if Q8_OUT
@group(0) @binding(9) var<storage, read_write> xq: array<u32>;
@group(0) @binding(10) var<storage, read_write> xd: array<f32>;
#endif
// (A total per team: R rows, or R gate rows then R up rows with ACT_GATED.)
var<workgroup> act_rows: array<f32, WG / TEAM>;
#endif

const NV: u32 = KP / VW;

#if Q8_IN
// The q8 input as gemv_units.wgsl reads it (no group norm here).
fn x_q(i: u32) -> vec4<u32> {
#if IN_LANES
    // Vector i / (KP/16) is a batch's lane: lanes lie XL values apart.
    return xq_in[(i / (KP / 16u)) * (XL / 16u) + i % (KP / 16u)];
#else
    return xq_in[i];
#endif
}

fn x_d(i: u32) -> f32 {
#if IN_LANES
    return xd_in[(i / (KP / 32u)) * (XL / 32u) + i % (KP / 32u)];
#else
    return xd_in[i];
#endif
}

fn col_scale(k: u32) -> f32 {
    return 1.0;
}

#if W_Q8
// Weight vector v of row `row` and the same columns of q8 input `x`: their loads
// (`unit_load`) apart from their product (`unit_dot`), so a lane can have several in
// flight (the block formats' pair is gemv_units.wgsl's).
struct Unit {
    wv: vec4<u32>,
    a: vec4<u32>,
    dw: u32,
    dx: f32,
}

fn unit_load(row: u32, x: u32, v: u32) -> Unit {
    let si = row * (KP / 32u) + v / 2u;
    return Unit(w[row * NV + v], x_q(x * NV + v), ws[si / 2u], x_d(x * (KP / 32u) + v / 2u));
}

fn unit_dot(l: Unit, row: u32, v: u32) -> f32 {
    let si = row * (KP / 32u) + v / 2u;
    return f32(dot16(l.wv, l.a)) * (unpack2x16float(l.dw)[si % 2u] * l.dx);
}
#endif
#endif

// Row `row` of this bank (weights) dotted with input vector `x` (activations), one lane's
// share.
fn lane_dot(row: u32, x: u32, lane: u32) -> f32 {
    var acc = 0.0;
#if Q8_IN
    // UNROLL vectors per round, every load issued before the first product (the sum keeps
    // the order of one vector at a time).
    for (var v0 = lane; v0 < NV; v0 += UNROLL * TEAM) {
#for u UNROLL
        let v{u} = min(v0 + {u}u * TEAM, NV - 1u);
        let l{u} = unit_load(row, x, v{u});
#endfor
#for u UNROLL
        if (v0 + {u}u * TEAM < NV) {
            acc += unit_dot(l{u}, row, v{u});
        }
#endfor
    }
#else
    for (var v = lane; v < NV; v += TEAM) {
        acc += vec_dot(row, x, v);
    }
#endif
    return acc;
}

#if !Q8_IN
// The 16-byte weight vector `v` of row `row` against the same columns of f32 input `x`.
fn vec_dot(row: u32, x: u32, v: u32) -> f32 {
    let base = row * NV;
    var acc = 0.0;
    {
        let wv = w[base + v];
#if W_Q8
        // q8_0 weights against f32 inputs (the latent vector, made by a GEMV).
        let xb = x * (XR / 4u) + 4u * v;
        let sc = unpack2x16float(ws[(row * (KP / 32u) + v / 2u) / 2u])[(row * (KP / 32u) + v / 2u) % 2u];
        acc += sc * (dot(vec4<f32>(unpack4xI8(wv.x)), src[xb]) + dot(vec4<f32>(unpack4xI8(wv.y)), src[xb + 1u])
            + dot(vec4<f32>(unpack4xI8(wv.z)), src[xb + 2u]) + dot(vec4<f32>(unpack4xI8(wv.w)), src[xb + 3u]));
#endif
#if W_F16
        let xa = src[x * (XR / 4u) + 2u * v];
        let xb = src[x * (XR / 4u) + 2u * v + 1u];
        acc += dot(vec4<f32>(unpack2x16float(wv.x), unpack2x16float(wv.y)), xa)
            + dot(vec4<f32>(unpack2x16float(wv.z), unpack2x16float(wv.w)), xb);
#endif
#if W_F32
        acc += dot(wv, src[x * (XR / 4u) + v]);
#endif
    }
    return acc;
}
#endif

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let lane = lid % TEAM;
    // Row block rb, item zi of grid z.
#if LANES_INNER
    let rb = (wid.x + wid.y * nwg.x) / ZN;
    let zi = (wid.x + wid.y * nwg.x) % ZN;
#else
    let rb = wid.x + wid.y * nwg.x;
    let zi = wid.z;
#endif
#if ACT_GATED
    // R activation rows a workgroup: its first R teams take the gate rows rb·R + j of
    // [gate; up], the next R the up rows MH + rb·R + j.
    let row_raw = select(0u, MH, lid / TEAM >= R) + rb * R + (lid / TEAM) % R;
#else
    let row_raw = rb * R + lid / TEAM;
#endif
    let row = min(row_raw, M - 1u);
#if DOWN
    let t = zi;
    // The token's choices and weights, read once (each load of a weight vector then
    // waits for no other load).
    if (lid < KS) {
        down_id[lid] = ids[t * KS + lid];
        down_w[lid] = wts[t * KS + lid];
    }
    workgroupBarrier();
    // The team's lanes stride over every (choice, vector) pair of the row: all K choices'
    // loads in flight together, none of the lanes idle at the end of one choice.
    var acc = 0.0;
#if Q8_IN
    // UNROLL pairs per round, every load issued before the first product (the sum keeps
    // the order of one pair at a time); a choice in another bank loads its bank's first
    // expert and adds nothing.
    for (var i0 = lane; i0 < KS * NV; i0 += UNROLL * TEAM) {
#for u UNROLL
        let i{u} = min(i0 + {u}u * TEAM, KS * NV - 1u);
        let s{u} = i{u} / NV;
        let id{u} = down_id[s{u}];
        let in{u} = id{u} >= E0 && id{u} < E0 + NE;
        let r{u} = select(0u, id{u} - E0, in{u}) * M + row;
        let l{u} = unit_load(r{u}, t * KS + s{u}, i{u} % NV);
#endfor
#for u UNROLL
        if (i0 + {u}u * TEAM < KS * NV && in{u}) {
            acc += down_w[s{u}] * unit_dot(l{u}, r{u}, i{u} % NV);
        }
#endfor
    }
#else
    for (var i = lane; i < KS * NV; i += TEAM) {
        let s = i / NV;
        let id = down_id[s];
        if (id >= E0 && id < E0 + NE) {
            acc += down_w[s] * vec_dot((id - E0) * M + row, t * KS + s, i % NV);
        }
    }
#endif
    let total = RS * team_sum(acc, lid);
    if (lane == 0u && row_raw < M) {
#if STORE
        dst[t * MS + row] = total;
#else
#if NORM_TAIL
        let i = t * M + row;
        atomicStore(&dst[i], bitcast<u32>(bitcast<f32>(atomicLoad(&dst[i])) + total));
#else
        dst[t * MS + row] += total;
#endif
#endif
    }
#if NORM_TAIL
    norm_tail(lid, rb * R, t);
#endif
#else
    let z = zi;
#if ROUTE
    // The token's routing, redone by every workgroup of a chosen slot (on the H200 that
    // costs the pass less than a routing dispatch before it costs the token); the first
    // workgroup of the token's first slot writes it out for the down pass and the expert
    // load. The shared expert's slots need none.
    let s = z % KS;
#if RT_SHUFFLE
    // (route_rank: the counts summed by shuffles, and the slot's id written by the
    // invocation that ranks it: two barriers fewer before the first weight load.)
    if (s < K) {
        route_rank(z / KS, lid, s);
    } else if (lid == 0u) {
        rt_want_id = E + s - K;
    }
    if (s == 0u && rb == 0u) {
        workgroupBarrier();
        route_write(z / KS, lid);
    }
    let id = workgroupUniformLoad(&rt_want_id);
#else
    if (s < K) {
        route_select(z / KS, lid);
    }
    if (s == 0u && rb == 0u) {
        route_write(z / KS, lid);
    }
    if (lid == 0u) {
        up_id = select(E + s - K, rt_slot_id[min(s, K - 1u)], s < K);
    }
    let id = workgroupUniformLoad(&up_id);
#endif
#else
    if (lid == 0u) {
        up_id = ids[z];
    }
    let id = workgroupUniformLoad(&up_id);
#endif
    if (id < E0 || id >= E0 + NE) {
        return;
    }
    let total = RS * team_sum(lane_dot((id - E0) * M + row, z / KS, lane), lid);
#if ACT
    // relu(u)² (or silu(g)·u) of the workgroup's R rows (a multiple of 32: whole q8
    // blocks, zero past M or MH), as the activation kernel would write them: the dispatch
    // between the passes is gone.
    if (lane == 0u) {
        act_rows[lid / TEAM] = total;
    }
    workgroupBarrier();
    let r0 = rb * R;
    var a = 0.0;
#if ACT_GATED
    if (lid < R && r0 + lid < MH) {
        a = silu(act_rows[lid]) * act_rows[R + lid];
    }
#else
    if (lid < R && r0 + lid < M) {
        let r = max(act_rows[lid], 0.0);
        a = r * r;
    }
#endif
    if (lid < R && r0 + lid < XM) {
        mid[z * XM + r0 + lid] = a;
    }
#if Q8_OUT
    q8_chunk(a, lid, r0, z * XM);
#endif
#else
    if (lane == 0u && row_raw < M) {
        dst[z * MS + M0 + row] = total;
    }
#endif
#endif
}
