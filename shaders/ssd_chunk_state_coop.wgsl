// Chunked SSD, step 3 on cooperative matrices (tensor cores): the state each chunk adds,
// s_c[h,p,n] = Σ_j exp(min(Λ_last − Λ_j, 0))·δ_j·x_j[p]·B_j[n], as the product of
// X'ᵀ (P × Q, the weighted x rows) and B (Q × N) in f16 with f32 accumulators.
// A workgroup of 8 subgroups of 32 takes 64 channels × 128 state columns of one chunk and
// head (P a multiple of 64, N of 128): subgroup s owns channels (s%4)·16.., columns
// (s/4)·64.. as four 16×16 accumulators, stored straight into `cst`. The positions come in
// steps of 32 through two stages of workgroup memory (vec2<f16> pairs; 16-byte loads of the
// next step held in registers during the products, one barrier per step), as in
// gemm_coop.wgsl; the positions' weights are formed once per chunk. Without COOP the same
// stand-ins as there replace the cooperative ops.

enable f16;

@group(0) @binding(0) var<storage, read> mix: array<f32>;
@group(0) @binding(1) var<storage, read> lam: array<f32>;
@group(0) @binding(2) var<storage, read_write> cst: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;
#if U16
@group(0) @binding(4) var<storage, read> u: array<vec2<u32>>;
#else
@group(0) @binding(4) var<storage, read> u: array<vec4<f32>>;
#endif

const BK: u32 = 32u;
// Rows of the staged X' (64 channels) and B (128 columns), in halves with 8 of padding.
const LDA: u32 = 72u;
const LDB: u32 = 136u;
const ATILE: u32 = BK * LDA / 2u;
// Steps over a chunk: a constant count keeps the cooperative ops in uniform control flow
// (naga's analysis), and steps past the block's last position multiply zeros.
const STEPS: u32 = (Q + BK - 1u) / BK;
const BTILE: u32 = BK * LDB / 2u;

// The block's token count, read once into a value naga knows to be uniform (the early
// return for chunks past the block precedes cooperative ops).
var<workgroup> block_tokens: u32;
// Each position's weight exp(min(Λ_last − Λ_j, 0))·δ_j (zero past the block, up to the last
// step's end), formed once per chunk so a step's loads are only the x and B rows.
var<workgroup> wt: array<f32, STEPS * BK>;
var<workgroup> xa: array<vec2<f16>, 2u * ATILE>;
var<workgroup> bb: array<vec2<f16>, 2u * BTILE>;

#if !COOP
struct Acc {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

fn xa_half(i: u32) -> f32 {
    return f32(xa[i / 2u][i % 2u]);
}

fn bb_half(i: u32) -> f32 {
    return f32(bb[i / 2u][i % 2u]);
}

// c + A·B for A = X'ᵀ at half a of xa (16 channels × 16 positions, column-major: a
// position's channels are contiguous) and B at half b of bb (16 positions × 16 columns,
// row-major): this invocation's eight entries (row lane/2, columns (lane%2)·8..).
fn emu_mma(a: u32, b: u32, c: Acc, lane: u32) -> Acc {
    let r = lane / 2u;
    let c0 = (lane % 2u) * 8u;
    var lo = c.lo;
    var hi = c.hi;
    for (var k = 0u; k < 16u; k++) {
        let av = xa_half(a + k * LDA + r);
        let bo = b + k * LDB + c0;
        lo += av * vec4<f32>(bb_half(bo), bb_half(bo + 1u), bb_half(bo + 2u), bb_half(bo + 3u));
        hi += av * vec4<f32>(bb_half(bo + 4u), bb_half(bo + 5u), bb_half(bo + 6u), bb_half(bo + 7u));
    }
    return Acc(lo, hi);
}

fn emu_store(c: Acc, o: u32, lane: u32) {
    let base = o + (lane / 2u) * N + (lane % 2u) * 8u;
    for (var i = 0u; i < 4u; i++) {
        cst[base + i] = c.lo[i];
        cst[base + 4u + i] = c.hi[i];
    }
}
#endif

// x slice `e` of the step at position j0: position j0 + e/16, channels p0 + (e%16)·4 ..
// +4 (zero past the block; put_x weights it), raw (`u_raw`: converted by put_x, after the
// products).
fn x_slice(c: u32, h: u32, p0: u32, jmax: u32, j0: u32, e: u32) -> vec4<u32> {
    let j = j0 + e / 16u;
    if (j >= jmax) {
        return vec4<u32>(0u);
    }
    return u_raw(((c * Q + j) * CD + h * P + p0) / 4u + e % 16u);
}

// B slice `e` of the step at position j0: position j0 + e/32, columns n0 + (e%32)·4 .. +4,
// raw as x_slice.
fn b_slice(c: u32, g: u32, n0: u32, jmax: u32, j0: u32, e: u32) -> vec4<u32> {
    let j = j0 + e / 32u;
    if (j >= jmax) {
        return vec4<u32>(0u);
    }
    return u_raw(((c * Q + j) * CD + DI + g * N + n0) / 4u + e % 32u);
}

// Stores x slice `e` of the step at position j0 as X' (weighted).
fn put_x(stage: u32, j0: u32, e: u32, x: vec4<u32>) {
    let v = wt[j0 + e / 16u] * u_values(x);
    let o = stage * ATILE + (e / 16u) * (LDA / 2u) + (e % 16u) * 2u;
    xa[o] = vec2<f16>(v.xy);
    xa[o + 1u] = vec2<f16>(v.zw);
}

fn put_b(stage: u32, e: u32, raw: vec4<u32>) {
    let v = u_values(raw);
    let o = stage * BTILE + (e / 32u) * (LDB / 2u) + (e % 32u) * 2u;
    bb[o] = vec2<f16>(v.xy);
    bb[o + 1u] = vec2<f16>(v.zw);
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let p0 = wid.x * 64u;
    let n0 = wid.y * 128u;
    let c = wid.z / H;
    let h = wid.z % H;
    if (lid == 0u) {
        block_tokens = ctrl.prompt_len;
    }
    let tokens = workgroupUniformLoad(&block_tokens);
    if (c * Q >= tokens) {
        return;
    }
    let g = h / (H / G);
    let last = lam[(c * H + h) * Q + Q - 1u];
    let jmax = min(Q, tokens - c * Q);
    let sg = lid / 32u;
    let lane = lid % 32u;
    let pb = (sg % 4u) * 16u;
    let nb = (sg / 4u) * 64u;
#for j 4
#if COOP
    var c{j}: coop_mat16x16<f32, C>;
#else
    var c{j}: Acc;
#endif
#endfor
    // Step 0 into stage 0 (its loads issued before the weights' scattered loads, so their
    // latencies overlap); then each step loads the next one's slices into registers (two
    // X' and four B slices per invocation), multiplies its own stage, and stores the next
    // stage before the one barrier.
#for v 2
    var xr{v} = x_slice(c, h, p0, jmax, 0u, lid + {v}u * 256u);
#endfor
#for v 4
    var br{v} = b_slice(c, g, n0, jmax, 0u, lid + {v}u * 256u);
    put_b(0u, lid + {v}u * 256u, br{v});
#endfor
    for (var j = lid; j < STEPS * BK; j += 256u) {
        var wj = 0.0;
        if (j < jmax) {
            wj = exp(min(last - lam[(c * H + h) * Q + j], 0.0)) * mix[(c * Q + j) * DIP + DI + CD + h];
        }
        wt[j] = wj;
    }
    workgroupBarrier();
#for v 2
    put_x(0u, 0u, lid + {v}u * 256u, xr{v});
#endfor
    workgroupBarrier();
    for (var s = 0u; s < STEPS; s++) {
        let more = s + 1u < STEPS;
        if (more) {
            let j0 = (s + 1u) * BK;
#for v 2
            xr{v} = x_slice(c, h, p0, jmax, j0, lid + {v}u * 256u);
#endfor
#for v 4
            br{v} = b_slice(c, g, n0, jmax, j0, lid + {v}u * 256u);
#endfor
        }
        // Tile offsets in halves.
        let ab = (s % 2u) * 2u * ATILE + pb;
        let bs = (s % 2u) * 2u * BTILE + nb;
#for q 2
#if COOP
        let a{q} = coopLoad<coop_mat16x16<f16, A>>(&xa[(ab + {q}u * 16u * LDA) / 2u], LDA / 2u);
#else
        let a{q} = ab + {q}u * 16u * LDA;
#endif
#for j 4
#if COOP
        c{j} = coopMultiplyAdd(a{q}, coopLoadT<coop_mat16x16<f16, B>>(&bb[(bs + {q}u * 16u * LDB + {j}u * 16u) / 2u], LDB / 2u), c{j});
#else
        c{j} = emu_mma(a{q}, bs + {q}u * 16u * LDB + {j}u * 16u, c{j}, lane);
#endif
#endfor
#endfor
        if (more) {
            let next = (s + 1u) % 2u;
#for v 2
            put_x(next, (s + 1u) * BK, lid + {v}u * 256u, xr{v});
#endfor
#for v 4
            put_b(next, lid + {v}u * 256u, br{v});
#endfor
        }
        workgroupBarrier();
    }
    let o = ((c * H + h) * P + p0 + pb) * N + n0 + nb;
#for j 4
#if COOP
    coopStoreT(c{j}, &cst[o + {j}u * 16u], N);
#else
    emu_store(c{j}, o + {j}u * 16u, lane);
#endif
#endfor
}
