// Y[t, m] = Σ_k X[t, k]·W[m, k] for the T tokens of a prefill block (T = ctrl.prompt_len):
// W [M, KP] in f32, f16, bf16, q8_0 or the 4/5/6-bit block formats of block_quant.wgsl
// (dequantized into workgroup memory), X [T, XS] f32
// (XS ≥ KP, zero past K).
// A workgroup computes a 128 (rows of W) × 64 (tokens) tile in steps of 16 columns; each
// invocation owns 8 rows × 4 tokens in eight vec4 registers, fed by vec4 reads of the
// tiles in workgroup memory. O_STORE writes Y rows of YS values (W's rows from value Y0 of
// each: a part of a stacked projection whose parts are of different formats), O_ADD adds
// into them (the residual), each product times RS (the matrix's output scale: Granite's
// residual multiplier; the split partials are not scaled, gemm_reduce scales their sum).
// SPLIT (where W's row tiles and the block's token tiles alone are too few workgroups to
// fill the GPU: short blocks, and matrices of few rows such as the MoE routers): workgroup z
// takes the z-th of KS slices of the K loop and O_PART stores its partial tile at
// `y[(z·PT + t)·M + m]` (PT ≥ the block's tokens); gemm_reduce.wgsl sums the slices in order.
// GROUPED (the MoE experts of a prefill block, rows sorted by expert by moe_sort): the T = TR
// rows come in tiles of 64 that each belong to one expert, `tile_expert[tile]`; W is a bank
// of NE experts from E0, M rows each, and a tile whose expert lives in another bank (or
// no expert: past the used rows) returns at once. With GATHER, row r reads X row
// `pairs[r] / K` (the token of the (token, choice) pair sorted there; padding rows read
// zeros), else X row r.

#if W_F32
@group(0) @binding(0) var<storage, read> w: array<vec4<f32>>;
#endif
#if W_HALF
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
#endif
#if W_Q8
@group(0) @binding(0) var<storage, read> w: array<vec2<u32>>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;
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

const TM: u32 = 128u;
const TT: u32 = 64u;
const TK: u32 = 16u;

// Tiles in workgroup memory as vec4s: wt[k][m/4] (128 rows of W), xt[k][t/4] (64 tokens).
var<workgroup> wt: array<array<vec4<f32>, 33>, 16>;
var<workgroup> xt: array<array<vec4<f32>, 17>, 16>;

// Eight weights of row `row`, columns k0..k0+8 (k0 a multiple of 8).
fn weights8(row: u32, k0: u32) -> array<f32, 8> {
    var o: array<f32, 8>;
#if W_F32
    let a = w[(row * KP + k0) / 4u];
    let b = w[(row * KP + k0) / 4u + 1u];
    o = array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
#endif
#if W_HALF
    let v = w[(row * KP + k0) / 8u];
    let p0 = half2(v.x);
    let p1 = half2(v.y);
    let p2 = half2(v.z);
    let p3 = half2(v.w);
    o = array<f32, 8>(p0.x, p0.y, p1.x, p1.y, p2.x, p2.y, p3.x, p3.y);
#endif
#if W_BLOCK
    o = bq_weights8(row, k0);
#endif
#if W_Q8
    let v = w[(row * KP + k0) / 8u];
    let si = row * (KP / 32u) + k0 / 32u;
    let d = unpack2x16float(ws[si / 2u])[si % 2u];
    let a = vec4<f32>(unpack4xI8(v.x)) * d;
    let b = vec4<f32>(unpack4xI8(v.y)) * d;
    o = array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
#endif
    return o;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
#if GROUPED
    let tokens = TR;
    if (lid == 0u) {
        tile_e = tile_expert[wid.y];
    }
    let e = workgroupUniformLoad(&tile_e);
    if (e < E0 || e >= E0 + NE) {
        return;
    }
    // This expert's rows of the bank.
    let wbase = (e - E0) * M;
#else
    let tokens = ctrl.prompt_len;
    let wbase = 0u;
#endif
    let m0 = wid.x * TM;
    let t0 = wid.y * TT;
    let mg = lid % 16u;   // rows m0 + mg·8 .. +8
    let tg = lid / 16u;   // tokens t0 + tg·4 .. +4
    // Eight rows × four tokens in registers, one vec4 (over tokens) per row.
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    var c4 = vec4<f32>(0.0);
    var c5 = vec4<f32>(0.0);
    var c6 = vec4<f32>(0.0);
    var c7 = vec4<f32>(0.0);
    // Loaders: W row m0 + lid/2, columns (lid%2)·8..; X token t0 + lid/4, columns (lid%4)·4..
    let lrow = m0 + lid / 2u;
    let ltok = t0 + lid / 4u;
#if SPLIT
    let kbeg = wid.z * (KP / KS);
    let kend = kbeg + KP / KS;
#else
    let kbeg = 0u;
    let kend = KP;
#endif
    for (var k = kbeg; k < kend; k += TK) {
        var wv: array<f32, 8>;
        if (lrow < M) {
            wv = weights8(wbase + lrow, k + (lid % 2u) * 8u);
        }
        let rq = (lid / 2u) / 4u;
        let rc = (lid / 2u) % 4u;
        for (var i = 0u; i < 8u; i++) {
            wt[(lid % 2u) * 8u + i][rq][rc] = wv[i];
        }
        var xv = vec4<f32>(0.0);
#if GATHER
        let pair = pairs[ltok];
        if (pair != NONE) {
            xv = x[((pair / K) * XS + k) / 4u + lid % 4u];
        }
#else
        if (ltok < tokens) {
            xv = x[(ltok * XS + k) / 4u + lid % 4u];
        }
#endif
        let tq = (lid / 4u) / 4u;
        let tc = (lid / 4u) % 4u;
        for (var i = 0u; i < 4u; i++) {
            xt[(lid % 4u) * 4u + i][tq][tc] = xv[i];
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            let a0 = wt[kk][mg * 2u];
            let a1 = wt[kk][mg * 2u + 1u];
            let b = xt[kk][tg];
            c0 += a0.x * b;
            c1 += a0.y * b;
            c2 += a0.z * b;
            c3 += a0.w * b;
            c4 += a1.x * b;
            c5 += a1.y * b;
            c6 += a1.z * b;
            c7 += a1.w * b;
        }
        workgroupBarrier();
    }
    let acc = array<vec4<f32>, 8>(c0, c1, c2, c3, c4, c5, c6, c7);
    for (var i = 0u; i < 8u; i++) {
        let m = m0 + mg * 8u + i;
        if (m < M) {
            for (var j = 0u; j < 4u; j++) {
                let t = t0 + tg * 4u + j;
                if (t < tokens) {
#if O_STORE
                    y[Y0 + t * YS + m] = RS * acc[i][j];
#endif
#if O_ADD
                    y[Y0 + t * YS + m] += RS * acc[i][j];
#endif
#if O_PART
                    y[(wid.z * PT + t) * M + m] = acc[i][j];
#endif
                }
            }
        }
    }
}
