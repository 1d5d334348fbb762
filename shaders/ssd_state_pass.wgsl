// Chunked SSD, step 4: the state entering each chunk, S_0 = the sequence's state and
// S_{c+1} = exp(Λ_last,c)·S_c + s_c, written over s_c in `cst`; the sequence's state
// becomes the state after the block. Sequential over chunks, parallel over H·P·N.
// An invocation owns V consecutive state values (16-byte accesses when V = 4) and takes
// the chunks 16 (then 4) at a time, all their loads issued before the stores, so many
// loads are in flight: Codestral's 4096 tokens (32 chunks × 64 layers) took 83 ms one value
// and one chunk at a time, 7.9 with V = 4 and four chunks, 6.5 with eight, 5.1 with 16
// (H200, BENCHMARKS.md).

@group(0) @binding(0) var<storage, read> lam: array<f32>;
// V state values per invocation.
#if VEC4
alias Sv = vec4<f32>;
const V: u32 = 4u;
#else
alias Sv = f32;
const V: u32 = 1u;
#endif
@group(0) @binding(1) var<storage, read_write> cst: array<Sv>;
@group(0) @binding(2) var<storage, read_write> state: array<Sv>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;
#if S16
// (VEC4 only.) The entering states in f16, the operand the tensor-core chunk scan
// multiplies, to their own buffer (half the bytes written and read again; the same
// rounding the scan applied to f32 ones): `cst` keeps the chunk states.
@group(0) @binding(4) var<storage, read_write> cst16: array<vec4<f16>>;
#endif

// Stores the state entering a chunk at index i of `cst` (or `cst16`).
fn put_entering(i: u32, s: Sv) {
#if S16
    cst16[i] = vec4<f16>(s);
#else
    cst[i] = s;
#endif
}

// State values, and invocations.
const HPN: u32 = H * P * N;
const HPNV: u32 = HPN / V;

// exp(Λ) at the last position of chunk c for head h: the decay across the whole chunk.
fn chunk_decay(c: u32, h: u32) -> f32 {
    return exp(lam[(c * H + h) * Q + Q - 1u]);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * 256u;
    if (idx >= HPNV) {
        return;
    }
    let h = idx * V / (P * N);
    let chunks = (ctrl.prompt_len + Q - 1u) / Q;
    var s = state[idx];
    var c = 0u;
    for (; c + 16u <= chunks; c += 16u) {
#for i 16
        let add_{i} = cst[(c + {i}u) * HPNV + idx];
#endfor
#for i 16
        put_entering((c + {i}u) * HPNV + idx, s);
        s = chunk_decay(c + {i}u, h) * s + add_{i};
#endfor
    }
    for (; c + 4u <= chunks; c += 4u) {
#for i 4
        let add_{i} = cst[(c + {i}u) * HPNV + idx];
#endfor
#for i 4
        put_entering((c + {i}u) * HPNV + idx, s);
        s = chunk_decay(c + {i}u, h) * s + add_{i};
#endfor
    }
    for (; c < chunks; c++) {
        let add = cst[c * HPNV + idx];
        put_entering(c * HPNV + idx, s);
        s = chunk_decay(c, h) * s + add;
    }
    state[idx] = s;
}
