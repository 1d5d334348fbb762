// The MoE block's pre-norm and router folded into the decode up pass that routes its token
// (expert_gemv.wgsl with ROUTE and RT_FOLD, q8 inputs): one dispatch instead of the
// norm+router GEMV and the up pass, so the token pays one dispatch boundary fewer per MoE
// layer and the shared expert's slices stream while the router runs.
//
// The grid's first NRW workgroups are the router's: each makes RPW = WG / RTEAM rows of
// the logits, as the one-token router GEMV (gemv.wgsl with X_NORM, EARLY_F32) makes them —
// the same norm order (`norm_rstd` in a workgroup of NWG, NORM_WIDE), the same lanes over
// the same vectors and the same team sum over RTEAM lanes — so the logits, and the routing,
// are the bits of the unfolded graph and of a batch's lanes. Router workgroup 0 also writes
// the normed vector `h_out` and its q8 blocks (`hq`, `hd`) for the dispatches after this
// one (a shared expert of its own shape reads them).
//
// Every other workgroup makes the normed vector's q8 blocks in its own memory (the norm
// kernel's values), where its products read them. A routed slot's workgroup then takes the
// logits as the router's workgroups write them: `logits` holds RT_EMPTY (a NaN no
// arithmetic makes) between tokens, each invocation reads its logits through atomics until
// they are written, and each value carries its own readiness, so no order between two
// locations is assumed. The GPU writes them early: the router's workgroups come first in
// the grid and never wait themselves. The wait is bounded: after RT_SPIN reads the
// workgroup makes every logit itself, in the same order, so a device that runs workgroups
// in another order gets the same bits, later. The first down pass after this one writes
// RT_EMPTY back (RT_RESET), when no workgroup of this pass reads the logits any more.

@group(0) @binding(17) var<storage, read> rsd: array<f32>;
@group(0) @binding(18) var<storage, read> rw: array<vec4<f32>>;
@group(0) @binding(20) var<storage, read_write> h_out: array<f32>;
@group(0) @binding(21) var<storage, read_write> hq: array<u32>;
@group(0) @binding(22) var<storage, read_write> hd: array<f32>;

// The normed vector's q8 blocks, which the products read.
var<workgroup> xq_loc: array<vec4<u32>, KP / 16u>;
var<workgroup> xd_loc: array<f32, KP / 32u>;
// The token's logits as the routing reads them: the router's, or the workgroup's own after
// a wait that ran out.
var<workgroup> rt_own: array<f32, E>;
// Which of `rt_own` hold the router's value; how many were not written in a round.
var<workgroup> rt_own_set: array<u32, E>;
var<workgroup> rt_missing: atomic<u32>;
var<workgroup> rt_left: u32;
// A logit not written yet.
const RT_EMPTY: u32 = 0xffffffffu;
var<private> nrm_rstd: f32;

fn norm_x(i: u32) -> f32 {
    return rsd[i];
}

fn norm_w(k: u32) -> f32 {
    return params[NW_OFF + k];
}

// Value k of the normed vector (the norm kernel's expression; zero past D).
fn rt_normed(k: u32) -> f32 {
    var v = 0.0;
    if (k < D) {
        v = norm_x(k) * nrm_rstd * norm_w(k);
    }
    return v;
}

// Logit i, as the routing reads it (route_select.wgsl's `rt_logit`).
fn rt_logit(i: u32) -> f32 {
    return rt_own[i % E];
}

// The normed vector's q8 blocks (q8_chunk's values: d = amax/127, q = round(v/d) ties to
// even, four int8 a word), WG values at a time through `red` (the norm's sums are done
// with it): into this workgroup's memory (`local`: all KP/32 blocks), or to `h_out` and
// the q8 buffers for the later dispatches (the ⌈D/32⌉ blocks). Call from uniform control
// flow, after `nrm_rstd`.
fn rt_q8(lid: u32, local: bool) {
    for (var first = 0u; first < KP; first += WG) {
        let v = rt_normed(first + lid);
        red[lid] = v;
        if (!local && first + lid < D) {
            h_out[first + lid] = v;
        }
        workgroupBarrier();
        let b = first / 32u + lid;
        let live = select((D + 31u) / 32u, KP / 32u, local);
        if (lid < WG / 32u && b < live) {
            var amax = 0.0;
            for (var i = 0u; i < 32u; i++) {
                amax = max(amax, abs(red[32u * lid + i]));
            }
            let d = amax / 127.0;
            var inv = 0.0;
            if (d > 0.0) {
                inv = 1.0 / d;
            }
            var words: array<u32, 8>;
            for (var j = 0u; j < 8u; j++) {
                let o = 32u * lid + 4u * j;
                let f = vec4<f32>(red[o], red[o + 1u], red[o + 2u], red[o + 3u]) * inv;
                words[j] = pack4xI8(clamp(vec4<i32>(round(f)), vec4<i32>(-127), vec4<i32>(127)));
            }
            if (local) {
                xq_loc[2u * b] = vec4<u32>(words[0], words[1], words[2], words[3]);
                xq_loc[2u * b + 1u] = vec4<u32>(words[4], words[5], words[6], words[7]);
                xd_loc[b] = d;
            } else {
                for (var j = 0u; j < 8u; j++) {
                    hq[8u * b + j] = words[j];
                }
                hd[b] = d;
            }
        }
        workgroupBarrier();
    }
}

// The sum over a team of RTEAM consecutive invocations, in `team_sum`'s order for teams of
// RTEAM (pieces of RSUB by a butterfly, then the pieces in order; or a workgroup-memory
// tree). The team's first lane gets the total. Call from uniform control flow.
fn rt_team_sum(v: f32, lid: u32) -> f32 {
#if TEAM_SHUFFLE
    var s = v;
    for (var o = RSUB / 2u; o > 0u; o /= 2u) {
        s += subgroupShuffleXor(s, o);
    }
    if (RTEAM == RSUB) {
        return s;
    }
    if (lid % RSUB == 0u) {
        team_red[lid / RSUB] = s;
    }
    workgroupBarrier();
    var t = 0.0;
    if (lid % RTEAM == 0u) {
        let first = lid / RSUB;
        for (var i = 0u; i < RTEAM / RSUB; i++) {
            t += team_red[first + i];
        }
    }
    workgroupBarrier();
    return t;
#else
    team_red[lid] = v;
    workgroupBarrier();
    for (var o = RTEAM / 2u; o > 0u; o /= 2u) {
        if ((lid % RTEAM) < o) {
            team_red[lid] += team_red[lid + o];
        }
        workgroupBarrier();
    }
    let t = team_red[lid - lid % RTEAM];
    workgroupBarrier();
    return t;
#endif
}

// Input vector v of the router's row: four normed values, as gemv.wgsl's `x_vec4` makes
// them for the router GEMV.
fn rt_x4(v: u32) -> vec4<f32> {
    var r = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) {
        let k = 4u * v + c;
        if (k < D) {
            r[c] = norm_x(k) * nrm_rstd * norm_w(k);
        }
    }
    return r;
}

// Logit `row` (clamped to E − 1) from this team's lanes: lane l takes vectors l, l + RTEAM,
// … (RNVT of them), one after the other, as gemv.wgsl's EARLY_F32 path.
fn rt_row(row: u32, lid: u32) -> f32 {
    let lane = lid % RTEAM;
    let base = min(row, E - 1u) * RNV;
    var acc = 0.0;
#for u RNVT
    if (lane + {u}u * RTEAM < RNV) {
        acc += dot(rw[base + lane + {u}u * RTEAM], rt_x4(lane + {u}u * RTEAM));
    }
#endfor
    return rt_team_sum(acc, lid);
}

// A router workgroup: its RPW logits, then (workgroup 0) the normed vector and its q8
// blocks for the later dispatches, then its count. Call from uniform control flow.
fn rt_router(rwg: u32, lid: u32, sg_lane: u32, sg_size: u32) {
    nrm_rstd = norm_rstd(0u, lid, sg_lane, sg_size);
    let row = rwg * RPW + lid / RTEAM;
    let total = rt_row(row, lid);
    if (lid % RTEAM == 0u && row < E) {
        atomicStore(&logits[row], bitcast<u32>(total));
    }
    if (rwg == 0u) {
        rt_q8(lid, false);
    }
}

// A routed slot's workgroup: the router's logits into `rt_own`, in rounds that read the
// logits not yet written (at most RT_SPIN rounds; 0 reads none, for testing), or, if one
// was not written by then, every logit made here. Call from uniform control flow, after
// `nrm_rstd`.
fn rt_wait(lid: u32) {
    for (var e = lid; e < E; e += WG) {
        rt_own_set[e] = 0u;
    }
    var missing = E;
    for (var n = 0u; n < RT_SPIN && missing > 0u; n++) {
        if (lid == 0u) {
            atomicStore(&rt_missing, 0u);
        }
        workgroupBarrier();
        for (var e = lid; e < E; e += WG) {
            if (rt_own_set[e] == 0u) {
                let v = atomicLoad(&logits[e]);
                if (v == RT_EMPTY) {
                    atomicAdd(&rt_missing, 1u);
                } else {
                    rt_own[e] = bitcast<f32>(v);
                    rt_own_set[e] = 1u;
                }
            }
        }
        workgroupBarrier();
        if (lid == 0u) {
            rt_left = atomicLoad(&rt_missing);
        }
        missing = workgroupUniformLoad(&rt_left);
    }
    if (missing > 0u) {
        for (var r0 = 0u; r0 < E; r0 += RPW) {
            let row = r0 + lid / RTEAM;
            let total = rt_row(row, lid);
            if (lid % RTEAM == 0u && row < E) {
                rt_own[row] = total;
            }
        }
    }
    workgroupBarrier();
}
