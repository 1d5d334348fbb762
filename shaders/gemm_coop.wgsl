// The prefill projections on cooperative matrices (tensor cores where the device has them):
// Y[t, m] (=|+=) Σ_k X[t, k]·W[m, k] for the T = ctrl.prompt_len tokens of a block,
// W [M, KP] in f16, q8_0 or a 4/5/6-bit block format (KP a multiple of 32), X [T, XS] f32,
// multiplied as f16 into f32 accumulators on 16×16×16 tiles.
//
// A workgroup of WT × WR subgroups of 32 computes BT tokens × BM rows; subgroup s owns
// tokens (s % WT)·FT·16.. and rows (s / WT)·FM·16.. of it, FT × FM accumulator tiles. The K
// loop takes steps of BK (16 or 32) through NS = 2 stages of workgroup memory: while the tiles
// multiply one stage, every invocation already holds the next step's slices in registers
// (16-byte loads, X converted to f16, q8_0 dequantized to f16), stored into the other stage
// before the step's one barrier. (NS = 1: larger tiles in the same memory, a second
// barrier per step.) PF register sets keep the loads of PF steps in flight: a set stores
// its step, then loads the step PF further on, so each load has PF steps of multiplies to
// arrive in. Workgroup memory holds vec2<f16> pairs (half the store
// instructions of f16 elements; the cooperative loads count their stride in pairs; an
// array of u32 pairs instead made NVIDIA's compiler fail). Rows are LD = BK + 8 halves (80
// or 48 bytes) apart, so the eight 16-byte rows a tile load reads fall in distinct banks.
//
// DIRECT: the accumulators go straight to Y (coopStoreT; O_ADD starts them from Y), with no
// f32 tile in workgroup memory: the caller guarantees M is a multiple of 16 and that Y has
// rows up to the grid's last token tile plus 16 spare rows at SPARE, where the tiles past M
// land (zero weights: their sums are never read). Rows past the block's tokens get sums of
// zero inputs (O_STORE: 0; O_ADD: Y unchanged). Only for an output scale RS of 1 (the
// epilogue through workgroup memory multiplies by RS; a split's partials take RS = 1).
//
// Without COOP (lavapipe, the tests) four stand-ins replace the cooperative ops and the
// rest of the kernel is the same: a fragment is its offset in workgroup memory (in
// halves), and invocation `lane` of a subgroup's 32 holds row lane/2, columns
// (lane%2)·8.. of each accumulator tile.
//
// GROUPED (the MoE experts of a prefill block, rows sorted by expert by moe_sort; BT = 64):
// the T = TR rows come in tiles of 64 that each belong to one expert, `tile_expert[tile]`;
// W is a bank of NE experts from E0, M rows each, and a workgroup whose expert lives in
// another bank (or none: past the used rows) returns at once. With GATHER, row r reads X row
// `pairs[r] / K` (padding rows, NONE, read zeros), else X row r.
//
// SPLIT (the short blocks of at most 64 tokens, where W's row tiles alone leave the GPU
// idle): workgroup z takes the K slice z·KLEN .. (z+1)·KLEN (KLEN a multiple of BK·PF, and
// of 256 with SC8) and stores its partial sums at y[z·PSL + t·YS + m] (PSL = 64·YS: the
// `[KS][64][M]` partials gemm_reduce sums in slice order), through workgroup memory.
//
// Constants: M, KP, KLEN (the K columns a workgroup multiplies: KP, or a slice's), XS,
// YS, Y0 (Y's first row of W's: see gemm.wgsl); BT, BM, WT, WR, FT = BT/16/WT, FM = BM/16/WR, NT = 32·WT·WR;
// BK, KQ = BK/16, XPR = BK/4 X slices (vec4) per token and step; XV = BT·XPR/NT X slices
// and WV = BM·PW/NT W slices (16 bytes) per invocation, PW slices per row and step (BK/8
// for f16, BK/16 for q8_0) of VP values each (8, 16); PF (1..4, PF·BK < 256); SPARE (DIRECT).

enable f16;

#if !W_BLOCK
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
#endif
#if W_Q8
#if SC8
// Eight scales per load: a row's scales are a whole number of 16-byte groups (KP % 256 == 0).
@group(0) @binding(1) var<storage, read> ws: array<vec4<u32>>;
#else
@group(0) @binding(1) var<storage, read> ws: array<u32>;
#endif
#endif
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if GROUPED
@group(0) @binding(5) var<storage, read> tile_expert: array<u32>;
#if GATHER
@group(0) @binding(6) var<storage, read> pairs: array<u32>;
#endif
var<workgroup> tile_e: u32;
#else
@group(0) @binding(4) var<storage, read> ctrl: Ctrl;
#endif

const LD: u32 = BK + 8u;
// K steps, rounded up to whole rounds of the PF register sets.
const STEPS: u32 = (KLEN / BK + PF - 1u) / PF * PF;
const LD2: u32 = LD / 2u;
// One stage, in pairs.
const XTILE: u32 = BT * LD2;
const WTILE: u32 = BM * LD2;

var<workgroup> xs: array<vec2<f16>, NS * XTILE>;
var<workgroup> wsh: array<vec2<f16>, NS * WTILE>;
#if !DIRECT
// One 16×16 f32 tile per subgroup on its way out.
var<workgroup> outs: array<f32, WT * WR * 256u>;
#endif

// X slice `e` of the step at column k: token t0 + e/XPR, columns k + (e%XPR)·4 .. +4.
fn x_slice(t0: u32, tokens: u32, k: u32, e: u32) -> vec4<f32> {
    let t = t0 + e / XPR;
#if GATHER
    let pair = pairs[t];
    if ((pair != NONE) & (k < KP)) {
        return x[((pair / K) * XS + k) / 4u + e % XPR];
    }
#else
    if ((t < tokens) & (k < KP)) {
        return x[(t * XS + k) / 4u + e % XPR];
    }
#endif
    return vec4<f32>(0.0);
}

// W slice `e` of the step at column k: row m0 + e/PW (of the matrix from row wrow),
// columns k + (e%PW)·VP .. +VP. The 4/5/6-bit block formats (W_BLOCK, block_quant.wgsl's
// bindings) come dequantized, as eight f16 in f16's layout (VP = 8): their loads are then
// waited for at once, not PF steps later.
fn w_slice(wrow: u32, m0: u32, k: u32, e: u32) -> vec4<u32> {
    let m = m0 + e / PW;
    if ((m < M) & (k < KP)) {
#if W_BLOCK
        let v = bq_weights8(wrow + m, k + (e % PW) * 8u);
        return vec4<u32>(
            pack2x16float(vec2<f32>(v[0], v[1])),
            pack2x16float(vec2<f32>(v[2], v[3])),
            pack2x16float(vec2<f32>(v[4], v[5])),
            pack2x16float(vec2<f32>(v[6], v[7])),
        );
#else
        return w[((wrow + m) * KP + k) / VP + e % PW];
#endif
    }
    return vec4<u32>(0u);
}

#if SC8
// The q8_0 scales of W slice `e`'s row for columns k .. k + 256 (k a multiple of 256): eight
// f16s, one 16-byte load that serves the next 256 / BK steps.
fn w_scales8(wrow: u32, m0: u32, k: u32, e: u32) -> vec4<u32> {
    let m = m0 + e / PW;
    if ((m < M) & (k < KP)) {
        return ws[((wrow + m) * (KP / 32u) + k / 32u) / 8u];
    }
    return vec4<u32>(0u);
}

// The scale of column k's block among the eight of `sc`.
fn scale_in(sc: vec4<u32>, k: u32) -> f32 {
    return unpack2x16float(sc[(k / 64u) % 4u])[(k / 32u) % 2u];
}
#endif

// The q8_0 scale of W slice `e` (its 32-value block).
fn w_scale(wrow: u32, m0: u32, k: u32, e: u32) -> f32 {
#if W_Q8
#if !SC8
    let m = m0 + e / PW;
    if ((m < M) & (k < KP)) {
        let si = (wrow + m) * (KP / 32u) + k / 32u;
        return unpack2x16float(ws[si / 2u])[si % 2u];
    }
#endif
#endif
    return 0.0;
}

fn put_x(stage: u32, e: u32, v: vec4<f32>) {
    let o = stage * XTILE + (e / XPR) * LD2 + (e % XPR) * 2u;
    xs[o] = vec2<f16>(v.xy);
    xs[o + 1u] = vec2<f16>(v.zw);
}

fn put_w(stage: u32, e: u32, q: vec4<u32>, d: f32) {
    let o = stage * WTILE + (e / PW) * LD2 + (e % PW) * (VP / 2u);
#if F16_PAIRS
    // Eight f16 (f16 weights, or block weights w_slice dequantized).
    wsh[o] = vec2<f16>(unpack2x16float(q.x));
    wsh[o + 1u] = vec2<f16>(unpack2x16float(q.y));
    wsh[o + 2u] = vec2<f16>(unpack2x16float(q.z));
    wsh[o + 3u] = vec2<f16>(unpack2x16float(q.w));
#endif
#if W_Q8
    // In f16 arithmetic: the quants are exact in f16 and d is an f16, so each product is
    // rounded once to the f16 the f32 product would convert to (f16 subnormals aside),
    // with half the instructions.
    let dh = f16(d);
    for (var j = 0u; j < 4u; j++) {
        let v = vec4<f16>(unpack4xI8(q[j])) * dh;
        wsh[o + 2u * j] = v.xy;
        wsh[o + 2u * j + 1u] = v.zw;
    }
#endif
}

#if !COOP
struct Acc {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

fn xs_half(i: u32) -> f32 {
    return f32(xs[i / 2u][i % 2u]);
}

fn wsh_half(i: u32) -> f32 {
    return f32(wsh[i / 2u][i % 2u]);
}

// c + A·B for the A tile at half a of xs (16 tokens × 16 columns, rows LD halves apart)
// and the B tile at half b of wsh (16 rows of W × 16 columns): this invocation's eight
// entries.
fn emu_mma(a: u32, b: u32, c: Acc, lane: u32) -> Acc {
    let r = lane / 2u;
    let c0 = b + (lane % 2u) * 8u * LD;
    var lo = c.lo;
    var hi = c.hi;
    for (var k = 0u; k < 16u; k++) {
        let av = xs_half(a + r * LD + k);
        lo += av * vec4<f32>(
            wsh_half(c0 + k),
            wsh_half(c0 + LD + k),
            wsh_half(c0 + 2u * LD + k),
            wsh_half(c0 + 3u * LD + k),
        );
        hi += av * vec4<f32>(
            wsh_half(c0 + 4u * LD + k),
            wsh_half(c0 + 5u * LD + k),
            wsh_half(c0 + 6u * LD + k),
            wsh_half(c0 + 7u * LD + k),
        );
    }
    return Acc(lo, hi);
}

#if DIRECT
// The tile at y[at] (rows YS apart): this invocation's eight entries, loaded or stored.
fn emu_load_y(at: u32, lane: u32) -> Acc {
    let o = at + (lane / 2u) * YS + (lane % 2u) * 8u;
    return Acc(vec4<f32>(y[o], y[o + 1u], y[o + 2u], y[o + 3u]), vec4<f32>(y[o + 4u], y[o + 5u], y[o + 6u], y[o + 7u]));
}

fn emu_store_y(c: Acc, at: u32, lane: u32) {
    let o = at + (lane / 2u) * YS + (lane % 2u) * 8u;
    for (var i = 0u; i < 4u; i++) {
        y[o + i] = c.lo[i];
        y[o + 4u + i] = c.hi[i];
    }
}
#else
fn emu_store(c: Acc, ob: u32, lane: u32) {
    let o = ob + (lane / 2u) * 16u + (lane % 2u) * 8u;
    for (var i = 0u; i < 4u; i++) {
        outs[o + i] = c.lo[i];
        outs[o + 4u + i] = c.hi[i];
    }
}
#endif
#endif

#if DIRECT
// Where the 16×16 tile of tokens tb.., rows mb.. lives in Y: its place, or the spare rows
// for tiles past M.
fn y_tile(tb: u32, mb: u32) -> u32 {
    if (mb < M) {
        return Y0 + tb * YS + mb;
    }
    return Y0 + SPARE * YS;
}
#else
// Writes (or adds) the 16×16 tile at outs[ob] to tokens tb.., rows mb.. of Y from y[base].
fn emit(ob: u32, lane: u32, tb: u32, mb: u32, tokens: u32, base: u32) {
    let col = lane % 16u;
    let m = mb + col;
    for (var r = lane / 16u; r < 16u; r += 2u) {
        let t = tb + r;
        if (t < tokens && m < M) {
#if O_STORE
            y[base + t * YS + m] = RS * outs[ob + r * 16u + col];
#endif
#if O_ADD
            y[base + t * YS + m] += RS * outs[ob + r * 16u + col];
#endif
        }
    }
}
#endif

@compute @workgroup_size(NT)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
#if GROUPED
    let tokens = TR;
    if (lid == 0u) {
        tile_e = tile_expert[wid.y];
    }
    let expert = workgroupUniformLoad(&tile_e);
    // (`|`, not `||`: naga lowers a short circuit to a branch whose result it cannot
    // prove uniform.)
    if ((expert < E0) | (expert >= E0 + NE)) {
        return;
    }
    // This expert's first row in the bank.
    let wrow = (expert - E0) * M;
#else
    let tokens = ctrl.prompt_len;
    let wrow = 0u;
#endif
    let m0 = wid.x * BM;
    let t0 = wid.y * BT;
    // This workgroup's first K column (loads take absolute columns; `k < KP` bounds them).
#if SPLIT
    let kb = wid.z * KLEN;
#else
    let kb = 0u;
#endif
    let sg = lid / 32u;
    let lane = lid % 32u;
    let tw = (sg % WT) * FT * 16u;
    let rw = (sg / WT) * FM * 16u;
#for i FT
#for j FM
#if COOP
    var c{i}_{j}: coop_mat16x16<f32, C>;
#else
    var c{i}_{j}: Acc;
#endif
#endfor
#endfor
#if DIRECT
#for i FT
#for j FM
    let at{i}_{j} = y_tile(t0 + tw + {i}u * 16u, m0 + rw + {j}u * 16u);
#if O_ADD
#if COOP
    c{i}_{j} = coopLoadT<coop_mat16x16<f32, C>>(&y[at{i}_{j}], YS);
#else
    c{i}_{j} = emu_load_y(at{i}_{j}, lane);
#endif
#endif
#endfor
#endfor
#endif
    // Step 0 into stage 0; steps 1 ..= PF into register sets 0 .. PF - 1.
    {
#for v XV
        put_x(0u, lid + {v}u * NT, x_slice(t0, tokens, kb, lid + {v}u * NT));
#endfor
#for v WV
#if SC8
        let d{v} = scale_in(w_scales8(wrow, m0, kb, lid + {v}u * NT), kb);
#else
        let d{v} = w_scale(wrow, m0, kb, lid + {v}u * NT);
#endif
        put_w(0u, lid + {v}u * NT, w_slice(wrow, m0, kb, lid + {v}u * NT), d{v});
#endfor
    }
#if SC8
    // The scales of the 256 columns being loaded and of the 256 after them, loaded a block
    // ahead so that taking one out never waits on memory.
#for v WV
    var sc{v} = w_scales8(wrow, m0, kb, lid + {v}u * NT);
    var sn{v} = w_scales8(wrow, m0, kb + 256u, lid + {v}u * NT);
#endfor
#endif
#for h PF
#for v XV
    var x{h}_{v} = x_slice(t0, tokens, kb + ({h}u + 1u) * BK, lid + {v}u * NT);
#endfor
#for v WV
    var w{h}_{v} = w_slice(wrow, m0, kb + ({h}u + 1u) * BK, lid + {v}u * NT);
#if SC8
    var wd{h}_{v} = scale_in(sc{v}, kb + ({h}u + 1u) * BK);
#else
    var wd{h}_{v} = w_scale(wrow, m0, kb + ({h}u + 1u) * BK, lid + {v}u * NT);
#endif
#endfor
#endfor
    workgroupBarrier();
    // Set h holds step t's slices while step t - 1 multiplies (t = first + h); once stored,
    // it loads step t + PF: PF steps of loads in flight behind the multiplies. STEPS is a
    // multiple of PF; steps past KP read zeros and add nothing.
    for (var first = 1u; first <= STEPS; first += PF) {
#for h PF
        {
            let t = first + {h}u;
            // Tile offsets in halves.
            let xb = ((t - 1u) % NS) * 2u * XTILE + tw * LD;
            let wb = ((t - 1u) % NS) * 2u * WTILE + rw * LD;
#for q KQ
#for i FT
#if COOP
            let a{i}_{q} = coopLoadT<coop_mat16x16<f16, A>>(&xs[(xb + {i}u * 16u * LD + {q}u * 16u) / 2u], LD2);
#else
            let a{i}_{q} = xb + {i}u * 16u * LD + {q}u * 16u;
#endif
#endfor
#for j FM
#if COOP
            let b{j}_{q} = coopLoad<coop_mat16x16<f16, B>>(&wsh[(wb + {j}u * 16u * LD + {q}u * 16u) / 2u], LD2);
#else
            let b{j}_{q} = wb + {j}u * 16u * LD + {q}u * 16u;
#endif
#endfor
#for i FT
#for j FM
#if COOP
            c{i}_{j} = coopMultiplyAdd(a{i}_{q}, b{j}_{q}, c{i}_{j});
#else
            c{i}_{j} = emu_mma(a{i}_{q}, b{j}_{q}, c{i}_{j}, lane);
#endif
#endfor
#endfor
#endfor
            if (NS == 1u) {
                // One stage: everyone is done reading it before it is overwritten.
                workgroupBarrier();
            }
            let k = kb + t * BK;
#for v XV
            put_x(t % NS, lid + {v}u * NT, x{h}_{v});
#endfor
#for v WV
            put_w(t % NS, lid + {v}u * NT, w{h}_{v}, wd{h}_{v});
#endfor
            let kn = k + PF * BK;
#for v XV
            x{h}_{v} = x_slice(t0, tokens, kn, lid + {v}u * NT);
#endfor
#for v WV
            w{h}_{v} = w_slice(wrow, m0, kn, lid + {v}u * NT);
#if SC8
            if (kn % 256u == 0u) {
                sc{v} = sn{v};
                sn{v} = w_scales8(wrow, m0, kn + 256u, lid + {v}u * NT);
            }
            wd{h}_{v} = scale_in(sc{v}, kn);
#else
            wd{h}_{v} = w_scale(wrow, m0, kn, lid + {v}u * NT);
#endif
#endfor
            workgroupBarrier();
        }
#endfor
    }
#if DIRECT
#for i FT
#for j FM
#if COOP
    coopStoreT(c{i}_{j}, &y[at{i}_{j}], YS);
#else
    emu_store_y(c{i}_{j}, at{i}_{j}, lane);
#endif
#endfor
#endfor
#else
    // Out through this subgroup's 16×16 tile of workgroup memory, one accumulator at a
    // time (the barriers are uniform: every subgroup has FT × FM of them).
    let ob = sg * 256u;
#if SPLIT
    let base = wid.z * PSL;
#else
    let base = Y0;
#endif
#for i FT
#for j FM
#if COOP
    coopStoreT(c{i}_{j}, &outs[ob], 16u);
#else
    emu_store(c{i}_{j}, ob, lane);
#endif
    workgroupBarrier();
    emit(ob, lane, t0 + tw + {i}u * 16u, m0 + rw + {j}u * 16u, tokens, base);
    workgroupBarrier();
#endfor
#endfor
#endif
}
