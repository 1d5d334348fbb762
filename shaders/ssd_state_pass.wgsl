// Chunked SSD, step 4: the state entering each chunk, S_0 = the sequence's state and
// S_{c+1} = exp(Λ_last,c)·S_c + s_c, written over s_c in `cst`; the sequence's state
// becomes the state after the block. Sequential over chunks, parallel over H·P·N.

@group(0) @binding(0) var<storage, read> lam: array<f32>;
@group(0) @binding(1) var<storage, read_write> cst: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;

const HPN: u32 = H * P * N;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * 256u;
    if (idx >= HPN) {
        return;
    }
    let h = idx / (P * N);
    let chunks = (ctrl.prompt_len + Q - 1u) / Q;
    var s = state[idx];
    for (var c = 0u; c < chunks; c++) {
        let add = cst[c * HPN + idx];
        cst[c * HPN + idx] = s;
        s = exp(lam[(c * H + h) * Q + Q - 1u]) * s + add;
    }
    state[idx] = s;
}
