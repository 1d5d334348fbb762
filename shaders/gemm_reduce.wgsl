// The end of a split-K GEMM (gemm.wgsl, SPLIT): y[t, Y0 + m] (=|+=) Σ_z part[z][t][m] over the
// KS slices in order, for the T = ctrl.prompt_len tokens of a block of at most PT (the
// partials' token stride), the sum times RS (the matrix's output scale).
// One invocation per (m, t).

@group(0) @binding(0) var<storage, read> part: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> ctrl: Ctrl;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let m = gid.x;
    let t = gid.y;
    if (m >= M || t >= ctrl.prompt_len) {
        return;
    }
    var s = 0.0;
    for (var z = 0u; z < KS; z++) {
        s += part[(z * PT + t) * M + m];
    }
#if O_STORE
    y[Y0 + t * YS + m] = RS * s;
#endif
#if O_ADD
    y[Y0 + t * YS + m] += RS * s;
#endif
}
