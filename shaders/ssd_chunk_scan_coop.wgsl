// Chunked SSD, step 5 on cooperative matrices (tensor cores): the outputs of a chunk,
//   y_i[p] = D_h·x_i[p] + Σ_n (exp(Λ_i)·C_i[n])·S_c[p,n] + Σ_j M[i,j]·x_j[p],
//   M[i,j] = CB[i,j]·exp(min(Λ_i − Λ_j, 0))·δ_j for j ≤ i (0 above the diagonal),
// as one product of [exp(Λ)∘C | M] (positions × (N + positions)) and [Sᵀ ; X] in f16 with
// f32 accumulators that start from D_h·x (exact, in f32, written to y first).
// A workgroup of 4 subgroups of 32 takes 64 positions (block ib of the chunk) × 64 channels
// of one chunk and head (Q and P multiples of 64, N of 32): subgroup s owns positions
// (s%2)·32.., channels (s/2)·32.. as 2 × 2 accumulators. The K dimension comes in steps of
// 32: N/32 steps over the state, then the (ib+1)·2 steps of positions j up to the block's
// last, through two stages of workgroup memory (the loads of the next step held in
// registers during the products, one barrier per step), as in gemm_coop.wgsl. Both parts
// stage B as 32 rows of K × 64 channels, so one loop with the same cooperative loads serves
// them (naga's uniformity analysis would reject cooperative ops under a branch on the step):
// S is transposed on the way in (an invocation loads two channel rows and stores pairs).
// S comes in f16 (ssd_state_pass's `cst16`), u in f16 or f32 (conv_out.wgsl); the loads are
// held raw and converted only when stored, after the products: converting them where they
// were loaded made the H200 wait for each load before the products (33.3 → 39.8 ms with
// f16 S, 47.6 with f16 u too; 33.1 held raw: BENCHMARKS.md, runs 84–85).
// Λ and δ of the chunk are staged once, so forming M costs one exp per value. Without
// COOP, stand-ins replace the cooperative ops (a fragment is its offset in workgroup memory).

enable f16;

@group(0) @binding(0) var<storage, read> mix: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read> lam: array<f32>;
@group(0) @binding(3) var<storage, read> cb: array<vec4<f32>>;
// The states entering the chunks in f16 (ssd_state_pass's `cst16`: rounded as staging
// would round them).
@group(0) @binding(4) var<storage, read> cst: array<vec2<u32>>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;
@group(0) @binding(6) var<storage, read> ctrl: Ctrl;
#if U16
@group(0) @binding(7) var<storage, read> u: array<vec2<u32>>;
#else
@group(0) @binding(7) var<storage, read> u: array<vec4<f32>>;
#endif

const BK: u32 = 32u;
// Rows of the staged operands in halves, 8 of padding: A (64 positions × 32 columns of K),
// B (32 rows of K × 64 channels).
const LDA: u32 = 40u;
const LDB: u32 = 72u;
// One stage of each operand, in pairs.
const ASTAGE: u32 = 64u * LDA / 2u;
const BSTAGE: u32 = 32u * LDB / 2u;
// Steps over the state; the positions follow.
const S1: u32 = N / BK;

var<workgroup> block_tokens: u32;
var<workgroup> sa: array<vec2<f16>, 2u * ASTAGE>;
var<workgroup> sb: array<vec2<f16>, 2u * BSTAGE>;
// The chunk's Λ and δ (zeros past the block).
var<workgroup> lam_s: array<f32, Q>;
var<workgroup> dt_s: array<f32, Q>;

// The workgroup's place: chunk, head, group, first position and channel, positions held.
var<private> wc: u32;
var<private> wh: u32;
var<private> wg: u32;
var<private> wi0: u32;
var<private> wp0: u32;
var<private> imax: u32;

#if !COOP
struct Acc {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

fn sa_half(i: u32) -> f32 {
    return f32(sa[i / 2u][i % 2u]);
}

fn sb_half(i: u32) -> f32 {
    return f32(sb[i / 2u][i % 2u]);
}

// c + A·B for the A tile at half a of sa (16 × 16, rows LDA apart) and the B tile at half
// b of sb (rows LDB apart): this invocation's eight entries (row lane/2, columns
// (lane%2)·8..).
fn emu_mma(a: u32, b: u32, c: Acc, lane: u32) -> Acc {
    let r = lane / 2u;
    let c0 = b + (lane % 2u) * 8u;
    var lo = c.lo;
    var hi = c.hi;
    for (var k = 0u; k < 16u; k++) {
        let av = sa_half(a + r * LDA + k);
        let bo = c0 + k * LDB;
        lo += av * vec4<f32>(sb_half(bo), sb_half(bo + 1u), sb_half(bo + 2u), sb_half(bo + 3u));
        hi += av * vec4<f32>(sb_half(bo + 4u), sb_half(bo + 5u), sb_half(bo + 6u), sb_half(bo + 7u));
    }
    return Acc(lo, hi);
}

// The tile at y[at] (rows DI apart): this invocation's eight entries, loaded or stored.
fn emu_load_y(at: u32, lane: u32) -> Acc {
    let o = at + (lane / 2u) * DI + (lane % 2u) * 8u;
    return Acc(vec4<f32>(y[o], y[o + 1u], y[o + 2u], y[o + 3u]), vec4<f32>(y[o + 4u], y[o + 5u], y[o + 6u], y[o + 7u]));
}

fn emu_store_y(c: Acc, at: u32, lane: u32) {
    let o = at + (lane / 2u) * DI + (lane % 2u) * 8u;
    for (var i = 0u; i < 4u; i++) {
        y[o + i] = c.lo[i];
        y[o + 4u + i] = c.hi[i];
    }
}
#endif

// A slice `e` of step s (64 rows × 8 slices of 4), raw (converted by put_a, after the
// products: see conv_out.wgsl): the state part reads C (row i, columns n0..; `u_raw`), the
// position part CB (row i, columns j0..; f32 bits); zero past the block.
fn a_slice(s: u32, e: u32) -> vec4<u32> {
    let i = wi0 + e / 8u;
    if (i >= imax) {
        return vec4<u32>(0u);
    }
    if (s < S1) {
        let n0 = s * BK + (e % 8u) * 4u;
        return u_raw(((wc * Q + i) * CD + DI + G * N + wg * N + n0) / 4u);
    }
    let j0 = (s - S1) * BK + (e % 8u) * 4u;
    return bitcast<vec4<u32>>(cb[(((wc * G + wg) * Q + i) * Q + j0) / 4u]);
}

// B's load `v` (of 4) for invocation `lid` at step s: in the state part, S_c at channel
// row 2·(f/8) + v%2, columns n0 + (f%8)·4 .. +4 of the pair f = lid + (v/2)·128; in the
// position part, x at position j0 + e/16, channels (e%16)·4 .. +4 of slice e = lid + v·128.
// Raw, as a_slice: S's four f16 values in the first two words, x as `u_raw`.
fn b_slice(s: u32, lid: u32, v: u32) -> vec4<u32> {
    if (s < S1) {
        let f = lid + (v / 2u) * 128u;
        let n0 = s * BK + (f % 8u) * 4u;
        let p = 2u * (f / 8u) + v % 2u;
        return vec4<u32>(cst[(((wc * H + wh) * P + wp0 + p) * N + n0) / 4u], 0u, 0u);
    }
    let e = lid + v * 128u;
    let j = (s - S1) * BK + e / 16u;
    if (j >= imax) {
        return vec4<u32>(0u);
    }
    return u_raw(((wc * Q + j) * CD + wh * P + wp0) / 4u + e % 16u);
}

// Stores A slice `e` of step s: C scaled by exp(Λ_i), or M's four entries.
fn put_a(stage: u32, s: u32, e: u32, raw: vec4<u32>) {
    let r = e / 8u;
    let i = wi0 + r;
    var m = vec4<f32>(0.0);
    if (s < S1) {
        m = u_values(raw) * exp(lam_s[i]);
    } else {
        let v = bitcast<vec4<f32>>(raw);
        let j0 = (s - S1) * BK + (e % 8u) * 4u;
        let li = lam_s[i];
        for (var q = 0u; q < 4u; q++) {
            let j = j0 + q;
            // (Entries past the block are never multiplied: whatever a stale CB holds.)
            if (j <= i && j < imax) {
                m[q] = v[q] * exp(min(li - lam_s[j], 0.0)) * dt_s[j];
            }
        }
    }
    let o = stage * ASTAGE + r * (LDA / 2u) + (e % 8u) * 2u;
    sa[o] = vec2<f16>(m.xy);
    sa[o + 1u] = vec2<f16>(m.zw);
}

// Four f16 values in the first two words of a raw slice.
fn f16_values(r: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(r.x), unpack2x16float(r.y));
}

// Stores B's four loads of step s (`b_slice`): S transposed, each pair of channel rows
// as four pairs of one state column; x rows as they are.
fn put_b(stage: u32, s: u32, lid: u32, b0: vec4<u32>, b1: vec4<u32>, b2: vec4<u32>, b3: vec4<u32>) {
    let o = stage * BSTAGE;
    if (s < S1) {
        for (var h = 0u; h < 2u; h++) {
            let f = lid + h * 128u;
            let lo = f16_values(select(b0, b2, h == 1u));
            let hi = f16_values(select(b1, b3, h == 1u));
            let at = o + (f % 8u) * 4u * (LDB / 2u) + f / 8u;
            for (var r = 0u; r < 4u; r++) {
                sb[at + r * (LDB / 2u)] = vec2<f16>(f16(lo[r]), f16(hi[r]));
            }
        }
    } else {
        let v = array<vec4<f32>, 4>(u_values(b0), u_values(b1), u_values(b2), u_values(b3));
        for (var i = 0u; i < 4u; i++) {
            let e = lid + i * 128u;
            let at = o + (e / 16u) * (LDB / 2u) + (e % 16u) * 2u;
            sb[at] = vec2<f16>(v[i].xy);
            sb[at + 1u] = vec2<f16>(v[i].zw);
        }
    }
}

@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let ib = wid.x % (Q / 64u);
    wp0 = (wid.x / (Q / 64u)) * 64u;
    wh = wid.y;
    wc = wid.z;
    if (lid == 0u) {
        block_tokens = ctrl.prompt_len;
    }
    // (Control flow from values naga knows to be uniform: the cooperative ops follow.)
    let tokens = workgroupUniformLoad(&block_tokens);
    if (wid.z * Q >= tokens) {
        return;
    }
    wg = wh / (H / G);
    wi0 = ib * 64u;
    imax = min(Q, tokens - wc * Q);
    let lbase = (wc * H + wh) * Q;
    for (var j = lid; j < Q; j += 128u) {
        var l = 0.0;
        var d = 0.0;
        if (j < imax) {
            l = lam[lbase + j];
            d = mix[(wc * Q + j) * DIP + DI + CD + wh];
        }
        lam_s[j] = l;
        dt_s[j] = d;
    }
    // y starts as D_h·x (zero past the block), the accumulators' first value.
    let dh = params[D_OFF + wh];
    for (var e = lid; e < 1024u; e += 128u) {
        let i = wi0 + e / 16u;
        var v = vec4<f32>(0.0);
        if (i < imax) {
            v = dh * u4(((wc * Q + i) * CD + wh * P + wp0) / 4u + e % 16u);
        }
        let o = (wc * Q + i) * DI + wh * P + wp0 + (e % 16u) * 4u;
        y[o] = v.x;
        y[o + 1u] = v.y;
        y[o + 2u] = v.z;
        y[o + 3u] = v.w;
    }
    storageBarrier();
    let sg = lid / 32u;
    let lane = lid % 32u;
    let ti = (sg % 2u) * 32u;
    let tj = (sg / 2u) * 32u;
#for i 2
#for j 2
    let at{i}_{j} = (wc * Q + wi0 + ti + {i}u * 16u) * DI + wh * P + wp0 + tj + {j}u * 16u;
#if COOP
    var c{i}_{j} = coopLoadT<coop_mat16x16<f32, C>>(&y[at{i}_{j}], DI);
#else
    var c{i}_{j} = emu_load_y(at{i}_{j}, lane);
#endif
#endfor
#endfor
    // Step 0 into stage 0, after Λ and δ are in.
    workgroupBarrier();
#for v 4
    var ar{v} = a_slice(0u, lid + {v}u * 128u);
    var br{v} = b_slice(0u, lid, {v}u);
    put_a(0u, 0u, lid + {v}u * 128u, ar{v});
#endfor
    put_b(0u, 0u, lid, br0, br1, br2, br3);
    workgroupBarrier();
    let steps = S1 + (ib + 1u) * (64u / BK);
    for (var s = 0u; s < steps; s++) {
        let more = s + 1u < steps;
        if (more) {
#for v 4
            ar{v} = a_slice(s + 1u, lid + {v}u * 128u);
            br{v} = b_slice(s + 1u, lid, {v}u);
#endfor
        }
        // Tile offsets in halves.
        let ab = (s % 2u) * 2u * ASTAGE + ti * LDA;
        let bs = (s % 2u) * 2u * BSTAGE;
#for q 2
#for i 2
#if COOP
        let a{i}_{q} = coopLoadT<coop_mat16x16<f16, A>>(&sa[(ab + {i}u * 16u * LDA + {q}u * 16u) / 2u], LDA / 2u);
#else
        let a{i}_{q} = ab + {i}u * 16u * LDA + {q}u * 16u;
#endif
#endfor
#for j 2
#if COOP
        let b{j}_{q} = coopLoadT<coop_mat16x16<f16, B>>(&sb[(bs + {q}u * 16u * LDB + tj + {j}u * 16u) / 2u], LDB / 2u);
#endif
#for i 2
#if COOP
        c{i}_{j} = coopMultiplyAdd(a{i}_{q}, b{j}_{q}, c{i}_{j});
#else
        c{i}_{j} = emu_mma(a{i}_{q}, bs + {q}u * 16u * LDB + tj + {j}u * 16u, c{i}_{j}, lane);
#endif
#endfor
#endfor
#endfor
        if (more) {
            let next = (s + 1u) % 2u;
#for v 4
            put_a(next, s + 1u, lid + {v}u * 128u, ar{v});
#endfor
            put_b(next, s + 1u, lid, br0, br1, br2, br3);
        }
        workgroupBarrier();
    }
#for i 2
#for j 2
#if COOP
    coopStoreT(c{i}_{j}, &y[at{i}_{j}], DI);
#else
    emu_store_y(c{i}_{j}, at{i}_{j}, lane);
#endif
#endfor
#endfor
}
