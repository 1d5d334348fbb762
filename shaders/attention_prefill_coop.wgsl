// Causal attention of a prefill block on cooperative matrices (tensor cores where the
// device has them): token t (position ctrl.kv_len + t) of the T = ctrl.prompt_len tokens
// attends to cache rows 0 ..= kv_len + t, all stored by kv_store first. Same buffers and
// output as attention_prefill.wgsl: `o [T][OS]` rows normalized, the x = 0 workgroups
// zero the tail past H·HD.
//
// Workgroup (x, y) takes RW = 16·NSG query rows: tokens [y·QT, y·QT + QT) × GB query heads
// of kv head x / NGC (row r = token r / GB, head r % GB; rows past QT·GB are zero queries).
// Subgroup s owns rows 16s..16s+16: its queries stay loaded as HD/16 A fragments (f16,
// pre-scaled), and it walks the keys its rows can see in tiles of KT = 32, twice:
//  1. S = Q·Kᵀ (f32 accumulators) into workgroup memory; each row's maximum;
//  2. S again (the same products in the same order, so each row's maximum is exact), then
//     P = exp(S − max) rounded to f16 (≤ 1), the row sums of those rounded P, and
//     O += P·V in HD/16 accumulators that never need rescaling.
// Two passes over K instead of an online softmax: the accumulators are opaque, so a running
// maximum could not rescale them without a round trip through workgroup memory per tile.
// O leaves through workgroup memory, divided by its row sum. K and V of a tile take turns
// in one stage (V loads while the probabilities are formed). Nothing of size T × keys leaves
// the workgroup.
//
// Without COOP (lavapipe, the tests) stand-ins replace the cooperative ops and the rest is
// the same: a fragment is its offset in workgroup memory (in halves), and invocation `lane`
// of a subgroup holds row lane/2, columns (lane%2)·8.. of each accumulator.
//
// Constants: H, HKV, HD, G, QS, OS, CTX, SCALE (attn.rs), NSG, GB, NGC, QT, ND = HD/16.
// Flag KV_F32: f32 caches (else f16, eight values per 16-byte load).

enable f16;

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
#if KV_F32
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f32>>;
#else
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<u32>>;
#endif
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;
@group(0) @binding(4) var<storage, read_write> o: array<f32>;

const KT: u32 = 32u;
const NT: u32 = 32u * NSG;
const RW: u32 = 16u * NSG;
// Row strides in workgroup memory: halves for Q and K/V rows (HD + 8: eight 16-byte rows
// of a fragment fall in distinct banks), halves for P, f32 for S.
const LDK: u32 = HD + 8u;
const LDP: u32 = KT + 8u;
const LDS: u32 = KT + 4u;
// The -∞ of masked scores (finite: -inf is not a WGSL literal).
const NEG: f32 = -3.0e38;

// The block's token count and cache length, read once into values naga knows to be
// uniform (the early return and the key loops surround cooperative ops).
var<workgroup> wg_tokens: u32;
var<workgroup> wg_base: u32;
var<workgroup> qs: array<vec2<f16>, RW * LDK / 2u>;
var<workgroup> kvs: array<vec2<f16>, KT * LDK / 2u>;
var<workgroup> ss: array<f32, RW * LDS>;
var<workgroup> ps: array<vec2<f16>, RW * LDP / 2u>;
// Per row and half of a tile's keys: partial maxima, then partial sums.
var<workgroup> row_part: array<f32, 2u * RW>;
var<workgroup> row_lim: array<u32, RW>;

// Keys (values with `v`) [j0, j0 + KT) of kv head `kvh` into kvs as f16 rows, zero from
// `end` on.
fn load_kv(v: bool, kvh: u32, j0: u32, end: u32, lid: u32) {
    for (var i = lid; i < KT * (HD / 8u); i += NT) {
        let j = i / (HD / 8u);
        let c = i % (HD / 8u);
        let at = j * (LDK / 2u) + c * 4u;
#if KV_F32
        var a = vec4<f32>(0.0);
        var b = vec4<f32>(0.0);
        if (j0 + j < end) {
            let src = ((j0 + j) * HKV + kvh) * (HD / 4u) + 2u * c;
            if (v) {
                a = v_cache[src];
                b = v_cache[src + 1u];
            } else {
                a = k_cache[src];
                b = k_cache[src + 1u];
            }
        }
        kvs[at] = vec2<f16>(a.xy);
        kvs[at + 1u] = vec2<f16>(a.zw);
        kvs[at + 2u] = vec2<f16>(b.xy);
        kvs[at + 3u] = vec2<f16>(b.zw);
#else
        var w = vec4<u32>(0u);
        if (j0 + j < end) {
            let src = ((j0 + j) * HKV + kvh) * (HD / 8u) + c;
            if (v) {
                w = v_cache[src];
            } else {
                w = k_cache[src];
            }
        }
        kvs[at] = vec2<f16>(unpack2x16float(w.x));
        kvs[at + 1u] = vec2<f16>(unpack2x16float(w.y));
        kvs[at + 2u] = vec2<f16>(unpack2x16float(w.z));
        kvs[at + 3u] = vec2<f16>(unpack2x16float(w.w));
#endif
    }
}

#if !COOP
struct Acc {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

fn qs_half(i: u32) -> f32 {
    return f32(qs[i / 2u][i % 2u]);
}

fn kvs_half(i: u32) -> f32 {
    return f32(kvs[i / 2u][i % 2u]);
}

fn ps_half(i: u32) -> f32 {
    return f32(ps[i / 2u][i % 2u]);
}

// c + Q·Kᵀ for the Q tile at half a of qs (16 rows × 16 dims, rows LDK apart) and the keys
// at half b of kvs (16 keys × 16 dims, keys LDK apart): this invocation's eight entries.
fn emu_qk(a: u32, b: u32, c: Acc, lane: u32) -> Acc {
    let r = lane / 2u;
    let k0 = b + (lane % 2u) * 8u * LDK;
    var lo = c.lo;
    var hi = c.hi;
    for (var d = 0u; d < 16u; d++) {
        let av = qs_half(a + r * LDK + d);
        lo += av * vec4<f32>(kvs_half(k0 + d), kvs_half(k0 + LDK + d), kvs_half(k0 + 2u * LDK + d), kvs_half(k0 + 3u * LDK + d));
        hi += av * vec4<f32>(kvs_half(k0 + 4u * LDK + d), kvs_half(k0 + 5u * LDK + d), kvs_half(k0 + 6u * LDK + d), kvs_half(k0 + 7u * LDK + d));
    }
    return Acc(lo, hi);
}

// c + P·V for the P tile at half a of ps (16 rows × 16 keys, rows LDP apart) and the
// values at half b of kvs (16 keys × 16 dims, keys LDK apart).
fn emu_pv(a: u32, b: u32, c: Acc, lane: u32) -> Acc {
    let r = lane / 2u;
    let d0 = b + (lane % 2u) * 8u;
    var lo = c.lo;
    var hi = c.hi;
    for (var j = 0u; j < 16u; j++) {
        let av = ps_half(a + r * LDP + j);
        let vo = d0 + j * LDK;
        lo += av * vec4<f32>(kvs_half(vo), kvs_half(vo + 1u), kvs_half(vo + 2u), kvs_half(vo + 3u));
        hi += av * vec4<f32>(kvs_half(vo + 4u), kvs_half(vo + 5u), kvs_half(vo + 6u), kvs_half(vo + 7u));
    }
    return Acc(lo, hi);
}

// The 16×16 tile into ss at `at` (rows LDS apart).
fn emu_store(c: Acc, at: u32, lane: u32) {
    let b = at + (lane / 2u) * LDS + (lane % 2u) * 8u;
    for (var i = 0u; i < 4u; i++) {
        ss[b + i] = c.lo[i];
        ss[b + 4u + i] = c.hi[i];
    }
}
#endif

@compute @workgroup_size(NT)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    if (lid == 0u) {
        wg_tokens = ctrl.prompt_len;
        wg_base = ctrl.kv_len;
    }
    let tokens = workgroupUniformLoad(&wg_tokens);
    let base = workgroupUniformLoad(&wg_base);
    let t0 = wid.y * QT;
    if (t0 >= tokens) {
        return;
    }
    let kvh = wid.x / NGC;
    let g0 = (wid.x % NGC) * GB;
    let t_end = min(t0 + QT, tokens);
    let k_end = min(base + t_end, CTX);
    let sg = lid / 32u;
    let lane = lid % 32u;
    let r0 = sg * 16u;
    // In the softmax steps this invocation takes row lr, keys kh.. kh+16 of each tile.
    let lr = r0 + lane / 2u;
    let kh = (lane % 2u) * 16u;

    // The queries, pre-scaled, as f16 (zero for rows past the block's tokens or the heads).
    for (var i = lid; i < RW * (HD / 2u); i += NT) {
        let r = i / (HD / 2u);
        let d = (i % (HD / 2u)) * 2u;
        let t = t0 + r / GB;
        let g = g0 + r % GB;
        var x = vec2<f32>(0.0);
        if (r < GB * QT && t < t_end && g < G) {
            let at = t * QS + (kvh * G + g) * HD + d;
            x = vec2<f32>(qkv[at], qkv[at + 1u]) * SCALE;
        }
        qs[r * (LDK / 2u) + d / 2u] = vec2<f16>(x);
    }
    if (lid < RW) {
        let t = min(t0 + lid / GB, t_end - 1u);
        row_lim[lid] = min(base + t, k_end - 1u);
    }
    workgroupBarrier();
    let lim = row_lim[lr];
#for d ND
#if COOP
    let qa{d} = coopLoadT<coop_mat16x16<f16, A>>(&qs[(r0 * LDK + {d}u * 16u) / 2u], LDK / 2u);
#else
    let qa{d} = r0 * LDK + {d}u * 16u;
#endif
#endfor

    // Pass 1: each row's largest score.
    var mx = NEG;
    for (var j0 = 0u; j0 < k_end; j0 += KT) {
        load_kv(false, kvh, j0, k_end, lid);
        workgroupBarrier();
#for j 2
#if COOP
        var s{j}: coop_mat16x16<f32, C>;
#else
        var s{j}: Acc;
#endif
#endfor
#for d ND
#for j 2
#if COOP
        s{j} = coopMultiplyAdd(qa{d}, coopLoad<coop_mat16x16<f16, B>>(&kvs[({j}u * 16u * LDK + {d}u * 16u) / 2u], LDK / 2u), s{j});
#else
        s{j} = emu_qk(qa{d}, {j}u * 16u * LDK + {d}u * 16u, s{j}, lane);
#endif
#endfor
#endfor
#for j 2
#if COOP
        coopStoreT(s{j}, &ss[r0 * LDS + {j}u * 16u], LDS);
#else
        emu_store(s{j}, r0 * LDS + {j}u * 16u, lane);
#endif
#endfor
        workgroupBarrier();
        for (var i = 0u; i < 16u; i++) {
            if (j0 + kh + i <= lim) {
                mx = max(mx, ss[lr * LDS + kh + i]);
            }
        }
        // K and S are spent before the next tile overwrites them.
        workgroupBarrier();
    }
    row_part[2u * lr + lane % 2u] = mx;
    workgroupBarrier();
    let m = max(row_part[2u * lr], row_part[2u * lr + 1u]);

    // Pass 2: the probabilities and O.
    var lsum = 0.0;
#for d ND
#if COOP
    var o{d}: coop_mat16x16<f32, C>;
#else
    var o{d}: Acc;
#endif
#endfor
    for (var j0 = 0u; j0 < k_end; j0 += KT) {
        load_kv(false, kvh, j0, k_end, lid);
        workgroupBarrier();
#for j 2
#if COOP
        var s{j}: coop_mat16x16<f32, C>;
#else
        var s{j}: Acc;
#endif
#endfor
#for d ND
#for j 2
#if COOP
        s{j} = coopMultiplyAdd(qa{d}, coopLoad<coop_mat16x16<f16, B>>(&kvs[({j}u * 16u * LDK + {d}u * 16u) / 2u], LDK / 2u), s{j});
#else
        s{j} = emu_qk(qa{d}, {j}u * 16u * LDK + {d}u * 16u, s{j}, lane);
#endif
#endfor
#endfor
#for j 2
#if COOP
        coopStoreT(s{j}, &ss[r0 * LDS + {j}u * 16u], LDS);
#else
        emu_store(s{j}, r0 * LDS + {j}u * 16u, lane);
#endif
#endfor
        workgroupBarrier();
        // K is spent: V takes its place while the probabilities are formed.
        load_kv(true, kvh, j0, k_end, lid);
        for (var i = 0u; i < 16u; i += 2u) {
            let j = j0 + kh + i;
            var p = vec2<f32>(0.0);
            if (j <= lim) {
                p.x = exp(ss[lr * LDS + kh + i] - m);
            }
            if (j + 1u <= lim) {
                p.y = exp(ss[lr * LDS + kh + i + 1u] - m);
            }
            let ph = vec2<f16>(p);
            // The sum of the rounded probabilities the product multiplies.
            lsum += f32(ph.x) + f32(ph.y);
            ps[(lr * LDP + kh + i) / 2u] = ph;
        }
        workgroupBarrier();
#for q 2
#if COOP
        let pa{q} = coopLoadT<coop_mat16x16<f16, A>>(&ps[(r0 * LDP + {q}u * 16u) / 2u], LDP / 2u);
#else
        let pa{q} = r0 * LDP + {q}u * 16u;
#endif
#for d ND
#if COOP
        o{d} = coopMultiplyAdd(pa{q}, coopLoadT<coop_mat16x16<f16, B>>(&kvs[({q}u * 16u * LDK + {d}u * 16u) / 2u], LDK / 2u), o{d});
#else
        o{d} = emu_pv(pa{q}, {q}u * 16u * LDK + {d}u * 16u, o{d}, lane);
#endif
#endfor
#endfor
        // V and P are spent before the next tile overwrites them.
        workgroupBarrier();
    }
    row_part[2u * lr + lane % 2u] = lsum;
    workgroupBarrier();
    let l = row_part[2u * lr] + row_part[2u * lr + 1u];

    // O out through this subgroup's rows of ss, 16 columns at a time, normalized.
    let t = t0 + lr / GB;
    let g = g0 + lr % GB;
    let live = lr < GB * QT && t < t_end && g < G;
    let out = t * OS + (kvh * G + g) * HD + (lane % 2u) * 8u;
#for d ND
#if COOP
    coopStoreT(o{d}, &ss[r0 * LDS], LDS);
#else
    emu_store(o{d}, r0 * LDS, lane);
#endif
    workgroupBarrier();
    if (live) {
        for (var i = 0u; i < 8u; i++) {
            o[out + {d}u * 16u + i] = ss[lr * LDS + (lane % 2u) * 8u + i] / l;
        }
    }
    workgroupBarrier();
#endfor
    if (wid.x == 0u) {
        let pad = max(OS - H * HD, 1u);
        for (var i = lid; i < (t_end - t0) * (OS - H * HD); i += NT) {
            o[(t0 + i / pad) * OS + H * HD + i % pad] = 0.0;
        }
    }
}
