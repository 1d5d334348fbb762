// Chunked SSD, step 1: per chunk c and head h, the inclusive cumsum Λ[c,h,i] of δ·A over
// the chunk's positions (past the block's end δ counts as 0, so Λ stays at its last
// value). `mix` rows of DIP = [z | x B C | δ]; T = ctrl.prompt_len.

@group(0) @binding(0) var<storage, read> mix: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read_write> lam: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let h = gid.x;
    let c = gid.y;
    let tokens = ctrl.prompt_len;
    if (h >= H || c * Q >= tokens) {
        return;
    }
    let a = params[A_OFF + h];
    var acc = 0.0;
    for (var i = 0u; i < Q; i++) {
        let t = c * Q + i;
        if (t < tokens) {
            acc += mix[t * DIP + DI + CD + h] * a;
        }
        lam[(c * H + h) * Q + i] = acc;
    }
}
