// The prefill projections on cooperative matrices (tensor cores where the device has them;
// experimental in wgpu, opt-in with MAMBA2_COOPMAT=1): Y[t, m] (=|+=) Σ_k X[t, k]·W[m, k]
// for the T = ctrl.prompt_len tokens of a block, W [M, KP] in f16 or q8_0, X [T, XS] f32.
// A workgroup of four 32-wide subgroups computes 64 tokens × 64 rows: each k-step stages a
// 64 × 32 slice of X and of W in workgroup memory as f16, then subgroup s multiplies its
// 16 tokens by the four 16-row blocks of W with f32 accumulators (16×16×16 tiles).

enable f16;
enable wgpu_cooperative_matrix;

#if W_F16
@group(0) @binding(0) var<storage, read> w: array<f16>;
#endif
#if W_Q8
@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;
#endif
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> ctrl: Ctrl;

const BT: u32 = 64u;
const BM: u32 = 64u;
const BK: u32 = 32u;
const LDX: u32 = 40u;
const LDW: u32 = 40u;
const LDY: u32 = 68u;

var<workgroup> xs: array<f16, 2560>;
var<workgroup> wsh: array<f16, 2560>;
var<workgroup> ys: array<f32, 4352>;

fn weight(m: u32, k: u32) -> f32 {
#if W_F16
    return f32(w[m * KP + k]);
#endif
#if W_Q8
    let q = unpack4xI8(w[(m * KP + k) / 4u])[k % 4u];
    let si = m * (KP / 32u) + k / 32u;
    return f32(q) * unpack2x16float(ws[si / 2u])[si % 2u];
#endif
}

@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let tokens = ctrl.prompt_len;
    let m0 = wid.x * BM;
    let t0 = wid.y * BT;
    let sg = lid / 32u;
    var c0: coop_mat16x16<f32, C>;
    var c1: coop_mat16x16<f32, C>;
    var c2: coop_mat16x16<f32, C>;
    var c3: coop_mat16x16<f32, C>;
    for (var k = 0u; k < KP; k += BK) {
        for (var e = lid; e < BT * BK; e += 128u) {
            let r = e / BK;
            let kk = e % BK;
            let t = t0 + r;
            var v = 0.0;
            if (t < tokens && k + kk < XS) {
                v = x[t * XS + k + kk];
            }
            xs[r * LDX + kk] = f16(v);
            let m = m0 + r;
            var wv = 0.0;
            if (m < M && k + kk < KP) {
                wv = weight(m, k + kk);
            }
            wsh[r * LDW + kk] = f16(wv);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk += 16u) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&xs[sg * 16u * LDX + kk], LDX);
            c0 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&wsh[0u * LDW + kk], LDW), c0);
            c1 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&wsh[16u * LDW + kk], LDW), c1);
            c2 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&wsh[32u * LDW + kk], LDW), c2);
            c3 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&wsh[48u * LDW + kk], LDW), c3);
        }
        workgroupBarrier();
    }
    coopStoreT(c0, &ys[sg * 16u * LDY], LDY);
    coopStoreT(c1, &ys[sg * 16u * LDY + 16u], LDY);
    coopStoreT(c2, &ys[sg * 16u * LDY + 32u], LDY);
    coopStoreT(c3, &ys[sg * 16u * LDY + 48u], LDY);
    workgroupBarrier();
    for (var e = lid; e < BT * BM; e += 128u) {
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
