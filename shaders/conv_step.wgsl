// The unfused graph's conv step: turns the raw in_proj rows [DI, DI + CD + H) of `dst`
// into u = silu(conv) and δ = softplus(dt + dt_bias), updating the conv state (the same
// mixer_row the fused in_proj runs in its epilogue). One thread per row.

@group(0) @binding(3) var<storage, read> params: array<f32>;
@group(0) @binding(5) var<storage, read_write> dst: array<f32>;
@group(0) @binding(6) var<storage, read_write> conv_state: array<f32>;
@group(0) @binding(7) var<storage, read> ctrl: array<Ctrl>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = DI + gid.x;
    if (row < DI + CD + H) {
        mixer_row(0u, row, dst[row]);
    }
}
