// The routed experts' outputs back into the residual of a prefill block: for token
// t < ctrl.prompt_len, resid[t·OS + j] += RS · Σ_k w[t·K + k] · y[pos[t·K + k], j], summed
// in choice order (y: the down projections of the rows moe_sort laid out, D wide; grid row
// y = token; RS: the down banks' output scale, which the expert GEMMs leave to this
// kernel). STORE writes the sum instead (a latent MoE's sum, before fc2_latent_proj).

@group(0) @binding(0) var<storage, read> y: array<f32>;
@group(0) @binding(1) var<storage, read> pos: array<u32>;
@group(0) @binding(2) var<storage, read> wts: array<f32>;
@group(0) @binding(3) var<storage, read_write> resid: array<f32>;
@group(0) @binding(4) var<storage, read> ctrl: Ctrl;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let t = gid.y;
    if (j >= D || t >= ctrl.prompt_len) {
        return;
    }
    var acc = 0.0;
    for (var k = 0u; k < K; k++) {
        acc += wts[t * K + k] * y[pos[t * K + k] * D + j];
    }
#if STORE
    resid[t * OS + j] = RS * acc;
#else
    resid[t * OS + j] += RS * acc;
#endif
}
