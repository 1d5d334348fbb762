// The q8 blocks of T rows of f32 values, `src [T][SS]` with K values a row: `xq [T][DS/4]`,
// `xd [T][DS/32]` (DS a multiple of 32, blocks zero past K up to NB·32), the q8_0 rule of
// every other q8 output (common.wgsl's q8_chunk). For a vector that a GEMV stored in f32
// and that block-format weights read next: a latent MoE's fc1 output, the routed experts'
// input. One workgroup row (grid y) per token; chunks of WG by a grid-stride loop.

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> xq: array<u32>;
@group(0) @binding(2) var<storage, read_write> xd: array<f32>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let t = wid.y;
    for (var first = wid.x * WG; first < NB * 32u; first += WG * nwg.x) {
        let k = first + lid;
        var v = 0.0;
        if (k < K) {
            v = src[t * SS + k];
        }
        q8_chunk(v, lid, first, t * DS);
    }
}
