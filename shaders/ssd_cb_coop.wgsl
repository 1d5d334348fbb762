// Chunked SSD, step 2 on cooperative matrices (tensor cores): CB[c,g,i,j] = C_i·B_j per
// chunk and group in f16 with f32 accumulators, for the 64×64 tiles on or below the
// diagonal (the scan reads j ≤ i only). A workgroup of 4 subgroups of 32 takes one tile
// (Q a multiple of 64, N of 32): subgroup s owns rows (s%2)·32.., columns (s/2)·32.. as
// 2 × 2 accumulators, stored straight into `cb`. C and B rows (contiguous along n) are
// staged alike, 64 rows × 32 values per step, through two stages of workgroup memory
// (16-byte loads of the next step held in registers during the products, one barrier per
// step), as in gemm_coop.wgsl; B's rows are read column-major as Bᵀ. Rows past the block
// get zeros. Without COOP, stand-ins replace the cooperative ops.

enable f16;

#if U16
@group(0) @binding(0) var<storage, read> u: array<vec2<u32>>;
#else
@group(0) @binding(0) var<storage, read> u: array<vec4<f32>>;
#endif
@group(0) @binding(1) var<storage, read_write> cb: array<f32>;
@group(0) @binding(2) var<storage, read> ctrl: Ctrl;

const BK: u32 = 32u;
// Staged rows in halves, 8 of padding; one stage of one operand, in pairs.
const LD: u32 = 40u;
const STAGE: u32 = 64u * LD / 2u;
const STEPS: u32 = N / BK;

var<workgroup> block_tokens: u32;
var<workgroup> sc: array<vec2<f16>, 2u * STAGE>;
var<workgroup> sbm: array<vec2<f16>, 2u * STAGE>;

#if !COOP
struct Acc {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

fn sc_half(i: u32) -> f32 {
    return f32(sc[i / 2u][i % 2u]);
}

fn sb_half(i: u32) -> f32 {
    return f32(sbm[i / 2u][i % 2u]);
}

// c + A·Bᵀ for the C tile at half a of sc and the B tile at half b of sbm (16 rows × 16
// values each, rows LD apart): this invocation's eight entries (row lane/2, columns
// (lane%2)·8..).
fn emu_mma(a: u32, b: u32, c: Acc, lane: u32) -> Acc {
    let r = lane / 2u;
    let c0 = b + (lane % 2u) * 8u * LD;
    var lo = c.lo;
    var hi = c.hi;
    for (var k = 0u; k < 16u; k++) {
        let av = sc_half(a + r * LD + k);
        let bo = c0 + k;
        lo += av * vec4<f32>(sb_half(bo), sb_half(bo + LD), sb_half(bo + 2u * LD), sb_half(bo + 3u * LD));
        hi += av * vec4<f32>(sb_half(bo + 4u * LD), sb_half(bo + 5u * LD), sb_half(bo + 6u * LD), sb_half(bo + 7u * LD));
    }
    return Acc(lo, hi);
}

fn emu_store(c: Acc, at: u32, lane: u32) {
    let o = at + (lane / 2u) * Q + (lane % 2u) * 8u;
    for (var i = 0u; i < 4u; i++) {
        cb[o + i] = c.lo[i];
        cb[o + 4u + i] = c.hi[i];
    }
}
#endif

// Slice `e` of the step at n0 of the rows from position `first` (col: C or B's offset in a
// row of u): row first + e/8, values n0 + (e%8)·4 .. +4; zero at positions ≥ `rows`. Raw
// (`u_raw`: converted by put, after the products).
fn slice(chunk: u32, first: u32, rows: u32, col: u32, n0: u32, e: u32) -> vec4<u32> {
    let i = first + e / 8u;
    if (i >= rows) {
        return vec4<u32>(0u);
    }
    return u_raw(((chunk * Q + i) * CD + col + n0) / 4u + e % 8u);
}

fn put(stage: u32, e: u32, raw: vec4<u32>, to_c: bool) {
    let v = u_values(raw);
    let o = stage * STAGE + (e / 8u) * (LD / 2u) + (e % 8u) * 2u;
    if (to_c) {
        sc[o] = vec2<f16>(v.xy);
        sc[o + 1u] = vec2<f16>(v.zw);
    } else {
        sbm[o] = vec2<f16>(v.xy);
        sbm[o + 1u] = vec2<f16>(v.zw);
    }
}

@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let ib = wid.x;
    let jb = wid.y;
    let c = wid.z / G;
    let g = wid.z % G;
    if (lid == 0u) {
        block_tokens = ctrl.prompt_len;
    }
    // (Control flow from values naga knows to be uniform: the cooperative ops follow; `|`,
    // not `||`, whose short circuit naga lowers to a branch it cannot prove uniform.)
    let tokens = workgroupUniformLoad(&block_tokens);
    if ((jb > ib) | (c * Q >= tokens)) {
        return;
    }
    let rows = min(Q, tokens - c * Q);
    let bofs = DI + g * N;
    let cofs = DI + G * N + g * N;
    let sg = lid / 32u;
    let lane = lid % 32u;
    let ti = (sg % 2u) * 32u;
    let tj = (sg / 2u) * 32u;
#for i 2
#for j 2
#if COOP
    var c{i}_{j}: coop_mat16x16<f32, C>;
#else
    var c{i}_{j}: Acc;
#endif
#endfor
#endfor
#for v 4
    var cr{v} = slice(c, ib * 64u, rows, cofs, 0u, lid + {v}u * 128u);
    var br{v} = slice(c, jb * 64u, rows, bofs, 0u, lid + {v}u * 128u);
    put(0u, lid + {v}u * 128u, cr{v}, true);
    put(0u, lid + {v}u * 128u, br{v}, false);
#endfor
    workgroupBarrier();
    for (var s = 0u; s < STEPS; s++) {
        let more = s + 1u < STEPS;
        if (more) {
            let n0 = (s + 1u) * BK;
#for v 4
            cr{v} = slice(c, ib * 64u, rows, cofs, n0, lid + {v}u * 128u);
            br{v} = slice(c, jb * 64u, rows, bofs, n0, lid + {v}u * 128u);
#endfor
        }
        // Tile offsets in halves.
        let ab = (s % 2u) * 2u * STAGE + ti * LD;
        let bs = (s % 2u) * 2u * STAGE + tj * LD;
#for q 2
#for i 2
#if COOP
        let a{i}_{q} = coopLoadT<coop_mat16x16<f16, A>>(&sc[(ab + {i}u * 16u * LD + {q}u * 16u) / 2u], LD / 2u);
#else
        let a{i}_{q} = ab + {i}u * 16u * LD + {q}u * 16u;
#endif
#endfor
#for j 2
#if COOP
        let b{j}_{q} = coopLoad<coop_mat16x16<f16, B>>(&sbm[(bs + {j}u * 16u * LD + {q}u * 16u) / 2u], LD / 2u);
#endif
#for i 2
#if COOP
        c{i}_{j} = coopMultiplyAdd(a{i}_{q}, b{j}_{q}, c{i}_{j});
#else
        c{i}_{j} = emu_mma(a{i}_{q}, bs + {j}u * 16u * LD + {q}u * 16u, c{i}_{j}, lane);
#endif
#endfor
#endfor
#endfor
        if (more) {
            let next = (s + 1u) % 2u;
#for v 4
            put(next, lid + {v}u * 128u, cr{v}, true);
            put(next, lid + {v}u * 128u, br{v}, false);
#endfor
        }
        workgroupBarrier();
    }
#for i 2
#for j 2
    let at{i}_{j} = ((c * G + g) * Q + ib * 64u + ti + {i}u * 16u) * Q + jb * 64u + tj + {j}u * 16u;
#if COOP
    coopStoreT(c{i}_{j}, &cb[at{i}_{j}], Q);
#else
    emu_store(c{i}_{j}, at{i}_{j}, lane);
#endif
#endfor
#endfor
}
