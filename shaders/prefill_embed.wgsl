// resid [T, D] = embedding rows of the prefill block's tokens `prompt [T]` (any weight
// format; the same table as the decode embed and the tied lm_head).

#if W_F32
@group(0) @binding(0) var<storage, read> w: array<f32>;
#endif
#if W_F16
@group(0) @binding(0) var<storage, read> w: array<u32>;
#endif
#if W_Q8
@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;
#endif
@group(0) @binding(2) var<storage, read> prompt: array<u32>;
@group(0) @binding(3) var<storage, read_write> resid: array<f32>;
@group(0) @binding(4) var<storage, read> ctrl: Ctrl;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let k = gid.x;
    let t = gid.y;
    if (k >= D || t >= ctrl.prompt_len) {
        return;
    }
    let row = min(prompt[t], V - 1u);
#if W_F32
    resid[t * D + k] = w[row * KP + k];
#endif
#if W_F16
    resid[t * D + k] = unpack2x16float(w[(row * KP + k) / 2u])[k % 2u];
#endif
#if W_Q8
    let q = unpack4xI8(w[(row * KP + k) / 4u])[k % 4u];
    let si = row * (KP / 32u) + k / 32u;
    resid[t * D + k] = f32(q) * unpack2x16float(ws[si / 2u])[si % 2u];
#endif
}
