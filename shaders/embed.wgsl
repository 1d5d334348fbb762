// Embedding rows into the residual: resid [D] = embedding[ctrl.token] (decode), or with
// PROMPT resid [T, D] = embedding[prompt[t]] for the T = ctrl.prompt_len tokens of a
// prefill block (grid row y = token). Decode over lanes (grid z = lane): lane l's row
// resid [l][D] from ctrl[l].token. The [V, D] table is f32, f16, bf16, q8_0 or a 4/5/6-bit
// block format (block_quant.wgsl) with rows padded to KP columns (the same buffers the
// tied lm_head reads), times SCALE (Granite's embedding multiplier; 1 elsewhere). One
// thread per element.

#if W_F32
@group(0) @binding(0) var<storage, read> w: array<f32>;
#endif
#if W_HALF
@group(0) @binding(0) var<storage, read> w: array<u32>;
#endif
#if W_Q8
@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;
#endif
@group(0) @binding(2) var<storage, read> ctrl: array<Ctrl>;
@group(0) @binding(3) var<storage, read_write> resid: array<f32>;
#if PROMPT
@group(0) @binding(4) var<storage, read> prompt: array<u32>;
#endif

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let k = gid.x;
#if PROMPT
    let t = gid.y;
    if (k >= D || t >= ctrl[0].prompt_len) {
        return;
    }
    let row = min(prompt[t], V - 1u);
#else
    let t = gid.z;
    if (k >= D) {
        return;
    }
    let row = min(ctrl[t].token, V - 1u);
#endif
    let i = t * D + k;
#if W_F32
    resid[i] = SCALE * w[row * KP + k];
#endif
#if W_HALF
    resid[i] = SCALE * half2(w[(row * KP + k) / 2u])[k % 2u];
#endif
#if W_BLOCK
    let e = bq_weights8(row, k - k % 8u);
    resid[i] = SCALE * e[k % 8u];
#endif
#if W_Q8
    let q = unpack4xI8(w[(row * KP + k) / 4u])[k % 4u];
    let si = row * (KP / 32u) + k / 32u;
    resid[i] = SCALE * f32(q) * unpack2x16float(ws[si / 2u])[si % 2u];
#endif
}
