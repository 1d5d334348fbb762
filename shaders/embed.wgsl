// resid = embedding[ctrl.token]: one row of the [V, D] table (f32, f16 or q8_0 rows padded
// to KP columns, the same buffers the tied lm_head reads). One thread per element.

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
@group(0) @binding(2) var<storage, read> ctrl: Ctrl;
@group(0) @binding(3) var<storage, read_write> resid: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let k = gid.x;
    if (k >= D) {
        return;
    }
    let row = min(ctrl.token, V - 1u);
#if W_F32
    resid[k] = w[row * KP + k];
#endif
#if W_F16
    resid[k] = unpack2x16float(w[(row * KP + k) / 2u])[k % 2u];
#endif
#if W_Q8
    let q = unpack4xI8(w[(row * KP + k) / 4u])[k % 4u];
    let si = row * (KP / 32u) + k / 32u;
    resid[k] = f32(q) * unpack2x16float(ws[si / 2u])[si % 2u];
#endif
}
