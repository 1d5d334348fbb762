// The prefill projections on cooperative matrices (tensor cores where the device has them;
// experimental in wgpu, opt-in with MAMBA2_COOPMAT=1): Y[t, m] (=|+=) Σ_k X[t, k]·W[m, k]
// for the T = ctrl.prompt_len tokens of a block, W [M, KP] in f16 or q8_0, X [T, XS] f32.
// A workgroup of eight 32-wide subgroups computes 64 tokens × 128 rows: each k-step stages
// a 64 × 32 slice of X in workgroup memory as f16; f16 weights are read as B tiles straight
// from the weight buffer when every tile lies inside it (DIRECT: M a multiple of 128, KP
// of 32), other weights are converted into workgroup memory first. Subgroup s multiplies
// tokens 16·(s%4).. by rows 64·(s/4).. into four f32 accumulators (16×16×16 tiles).

enable f16;
enable wgpu_cooperative_matrix;

#if W_F16
@group(0) @binding(0) var<storage, read> w: array<f16>;
#endif
#if W_Q8
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;
#endif
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> ctrl: Ctrl;

const BT: u32 = 64u;
const BM: u32 = 128u;
const BK: u32 = 32u;
const LDX: u32 = 40u;
const LDY: u32 = 128u;

var<workgroup> xs: array<f16, 2560>;
var<workgroup> ys: array<f32, 8192>;
#if !DIRECT
const LDW: u32 = 40u;
var<workgroup> wsh: array<f16, 5120>;
#endif

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let tokens = ctrl.prompt_len;
    let m0 = wid.x * BM;
    let t0 = wid.y * BT;
    let sg = lid / 32u;
    let tb = (sg % 4u) * 16u;
    let rb = (sg / 4u) * 64u;
    var c0: coop_mat16x16<f32, C>;
    var c1: coop_mat16x16<f32, C>;
    var c2: coop_mat16x16<f32, C>;
    var c3: coop_mat16x16<f32, C>;
    // X loader: token lid/4, columns (lid%4)·8 .. +8 of the k-step.
    let xr = lid / 4u;
    let xseg = (lid % 4u) * 8u;
    for (var k = 0u; k < KP; k += BK) {
        var lo = vec4<f32>(0.0);
        var hi = vec4<f32>(0.0);
        if (t0 + xr < tokens) {
            let base = ((t0 + xr) * XS + k + xseg) / 4u;
            lo = x[base];
            hi = x[base + 1u];
        }
        for (var i = 0u; i < 4u; i++) {
            xs[xr * LDX + xseg + i] = f16(lo[i]);
            xs[xr * LDX + xseg + 4u + i] = f16(hi[i]);
        }
#if !DIRECT
        // W loader: row lid/2, columns (lid%2)·16 .. +16 (zero past the matrix).
        let wr = lid / 2u;
        let wseg = (lid % 2u) * 16u;
#if W_Q8
        var q = vec4<u32>(0u);
        var d = 0.0;
        if (m0 + wr < M && k + wseg < KP) {
            q = w[((m0 + wr) * KP + k + wseg) / 16u];
            let si = (m0 + wr) * (KP / 32u) + (k + wseg) / 32u;
            d = unpack2x16float(ws[si / 2u])[si % 2u];
        }
        for (var j = 0u; j < 4u; j++) {
            let v = vec4<f32>(unpack4xI8(q[j])) * d;
            for (var i = 0u; i < 4u; i++) {
                wsh[wr * LDW + wseg + 4u * j + i] = f16(v[i]);
            }
        }
#else
        for (var i = 0u; i < 16u; i++) {
            var v = f16(0.0);
            if (m0 + wr < M && k + wseg + i < KP) {
                v = w[(m0 + wr) * KP + k + wseg + i];
            }
            wsh[wr * LDW + wseg + i] = v;
        }
#endif
#endif
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk += 16u) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&xs[tb * LDX + kk], LDX);
#if DIRECT
            let wb = (m0 + rb) * KP + k + kk;
            c0 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&w[wb], KP), c0);
            c1 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&w[wb + 16u * KP], KP), c1);
            c2 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&w[wb + 32u * KP], KP), c2);
            c3 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&w[wb + 48u * KP], KP), c3);
#endif
#if !DIRECT
            c0 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&wsh[rb * LDW + kk], LDW), c0);
            c1 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&wsh[(rb + 16u) * LDW + kk], LDW), c1);
            c2 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&wsh[(rb + 32u) * LDW + kk], LDW), c2);
            c3 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&wsh[(rb + 48u) * LDW + kk], LDW), c3);
#endif
        }
        workgroupBarrier();
    }
    coopStoreT(c0, &ys[tb * LDY + rb], LDY);
    coopStoreT(c1, &ys[tb * LDY + rb + 16u], LDY);
    coopStoreT(c2, &ys[tb * LDY + rb + 32u], LDY);
    coopStoreT(c3, &ys[tb * LDY + rb + 48u], LDY);
    workgroupBarrier();
    for (var e = lid; e < BT * BM; e += 256u) {
        let r = e / BM;
        let col = e % BM;
        let t = t0 + r;
        let m = m0 + col;
        if (t < tokens && m < M) {
#if O_STORE
            y[t * YS + m] = ys[r * LDY + col];
#endif
#if O_ADD
            y[t * YS + m] += ys[r * LDY + col];
#endif
        }
    }
}
