// resid += out (the unfused graph's residual connection).

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> resid: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < D) {
        resid[gid.x] += src[gid.x];
    }
}
