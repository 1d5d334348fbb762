// The MoE router for T tokens (workgroup x = token): router logits [T, E] → the chosen
// expert ids [T, KS] (u32, best first; KS = K chosen + S shared-expert slices) and their
// weights [T, KS]; COUNT also adds one to counts[COUNT_OFF + id] per choice (the
// inspector's expert load). The selection and the weights are route_select.wgsl's.

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;
#if GROUPED
@group(0) @binding(1) var<storage, read> params: array<f32>;
#endif
#if COUNT
@group(0) @binding(4) var<storage, read_write> counts: array<atomic<u32>>;
#endif
#if PROMPT
@group(0) @binding(5) var<storage, read> ctrl: Ctrl;
#endif

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let t = wid.x;
#if PROMPT
    // Uniform per workgroup: the whole workgroup returns.
    if (t >= ctrl.prompt_len) {
        return;
    }
#endif
    route_select(t, lid);
    route_write(t, lid);
}
