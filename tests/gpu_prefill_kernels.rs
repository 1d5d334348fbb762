//! The chunked-prefill kernels one at a time against CPU references, the ggml
//! test-backend-ops way: one table of (kernel, shape, tolerance) cases (`cases`), shapes
//! named after real models — token counts cut so lavapipe finishes, widths cut only where
//! the name says so — and small odd shapes (head dim 6 or 12, G 2 or 3, N not a multiple of
//! 16, chunks that are not multiples of 16).
//!
//! Every case feeds several blocks through the same buffers, as the engine does: a later,
//! shorter block finds the previous block's rows in every buffer, the carried state (conv
//! state, SSM state) moves on from block to block, and token counts are not multiples of
//! the chunk. Buffers start out as NaN, so a read outside the block's rows shows. Dispatches
//! are recorded with `record_tokens(pass, Some(T))` and the token axes `prefill.rs` gives
//! them. Each output is split into the entries the kernel computes (NMSE against the f64
//! reference ≤ 1e-7), entries it may leave in any state, and entries it must not write
//! (compared bit for bit).
//!
//! Kernel inputs are made on the host for each kernel alone (not taken from the previous
//! kernel's output), and `cpu_step_references_compose_to_scan_chunked` checks that the
//! step references here compose to `reference::scan_chunked`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use mamba2_wgpu::gpu::context::GpuContext;
use mamba2_wgpu::gpu::graph::Ctrl;
use mamba2_wgpu::gpu::kernels::chunk::ChunkConsts;
use mamba2_wgpu::gpu::kernels::gemm::{
    GemmOutput, TILE, block_slices, gemm, gemm_split, part_slices, part_values,
};
use mamba2_wgpu::gpu::kernels::gemm_coop::{self, TILES, Tile as CoopTile, gemm_coop, specialize};
use mamba2_wgpu::gpu::kernels::gemm_reduce::gemm_reduce;
use mamba2_wgpu::gpu::kernels::gemv::MixerConsts;
use mamba2_wgpu::gpu::kernels::prefill_conv::{ConvBuffers, prefill_conv, prefill_conv_state};
use mamba2_wgpu::gpu::kernels::ssd_chunk_scan::{ScanBuffers, ssd_chunk_scan};
use mamba2_wgpu::gpu::kernels::{
    Dispatch, Kernels, ssd_cb, ssd_cb_coop, ssd_chunk_scan_coop, ssd_chunk_state,
    ssd_chunk_state_coop, ssd_coop_check, ssd_cumsum, ssd_state_pass,
};
use mamba2_wgpu::gpu::shader::{Const, assemble};

/// How the cooperative SSD kernels read u (their first source after common.wgsl).
const CONV_OUT: &str = include_str!("../shaders/conv_out.wgsl");
use mamba2_wgpu::gpu::weights::DeviceMatrix;
use mamba2_wgpu::model::quant::{WeightFormat, pack, unpack};
use mamba2_wgpu::reference::math::{silu, softplus};
use mamba2_wgpu::reference::{ScanDims, ScanInputs, scan_chunked};
use mamba2_wgpu::sampling::uniform;

use GemmOutput::{Add, Store};
use WeightFormat::{BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0};

// ---------------------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------------------

/// NMSE bound of every f32 path (MAMBA2.md, oracle 4). The q8_0 and f16 GEMMs are held to
/// it too, against the product of the dequantized weights (`model::quant::unpack`): the
/// kernels dequantize exactly as `unpack` does (an int8 times an f16 scale needs 8 + 11
/// significant bits, exact in f32) and take f32 activations, so only the summation order
/// differs; a looser bound would hide a wrong scale or a misplaced block.
const F32_TOL: f64 = 1e-7;
/// An f16 rounding of values up to the largest: half a step, 2⁻¹¹ of it, and f32's slack.
const F16_HALF_STEP: f64 = 1.0 / 2048.0 + F32_TOL;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kernel {
    Gemm(WeightFormat, GemmOutput),
    /// `gemm_split`: the K loop split over workgroup slices, then `gemm_reduce` (blocks of at
    /// most one token tile).
    GemmSplit(WeightFormat, GemmOutput),
    /// `gemm_split` over blocks of more than one token tile (the K slices `block_slices`
    /// gives: matrices of few rows such as the MoE routers split, the rest run plain).
    GemmBlockSplit(WeightFormat, GemmOutput),
    /// `gemm_coop.wgsl` for these weights and output on every tile of `COOP_TILES`, with the
    /// cooperative ops and with their stand-ins: parsed, validated and translated to SPIR-V
    /// by naga (lavapipe has no cooperative matrices to run them on).
    GemmCoopWgsl(WeightFormat, GemmOutput),
    /// `gemm_coop` run with its portable stand-ins for the cooperative ops on tile
    /// `EMULATED_TILES[i]`: the staging, indexing and output of the tensor-core kernel;
    /// `true`: into a Y with the rows of the direct epilogue (M a multiple of 16).
    GemmCoopEmulated(WeightFormat, GemmOutput, usize, bool),
    /// `gemm_coop_split` (a short block's K loop split over workgroup slices on the tensor
    /// cores) with its stand-ins, then `gemm_reduce`, on the device's split tile.
    GemmCoopSplitEmulated(WeightFormat, GemmOutput),
    /// `prefill_conv` then `prefill_conv_state`, in one pass as the block graph records them;
    /// `true`: u written in f16 (`ChunkConsts::u_f16`).
    Conv(bool),
    Cumsum,
    Cb,
    ChunkState,
    /// `ssd_chunk_state_coop` with its stand-ins for the cooperative ops, against the
    /// reference of the f16-rounded operands it multiplies; `true`: reading u from f16 (the
    /// three cooperative SSD kernels alike).
    ChunkStateCoopEmulated(bool),
    StatePass,
    /// `ssd_state_pass` writing the entering states in f16 to their own buffer, as the
    /// tensor-core chunk scan reads them (the chunk states stay).
    StatePassF16,
    ChunkScan,
    /// `ssd_cb_coop` with its stand-ins for the cooperative ops.
    CbCoopEmulated(bool),
    /// `ssd_chunk_scan_coop` with its stand-ins for the cooperative ops.
    ChunkScanCoopEmulated(bool),
}

impl Kernel {
    fn label(self) -> String {
        let out = |o: GemmOutput| if o == Store { "store" } else { "add" };
        match self {
            Kernel::Gemm(w, o) => format!("gemm {} {}", w.name(), out(o)),
            Kernel::GemmSplit(w, o) => format!("gemm split-K {} {}", w.name(), out(o)),
            Kernel::GemmBlockSplit(w, o) => {
                format!("gemm split-K, long blocks {} {}", w.name(), out(o))
            }
            Kernel::GemmCoopSplitEmulated(w, o) => {
                format!("gemm_coop split-K emulated {} {}", w.name(), out(o))
            }
            Kernel::GemmCoopWgsl(w, o) => format!("gemm_coop wgsl {} {}", w.name(), out(o)),
            Kernel::GemmCoopEmulated(w, o, t, direct) => format!(
                "gemm_coop emulated {} {} tile {}{}",
                w.name(),
                out(o),
                EMULATED_TILES[t],
                if direct { ", direct" } else { "" }
            ),
            Kernel::Conv(u16) => format!("prefill_conv+state{}", u_tag(u16)),
            Kernel::Cumsum => "ssd_cumsum".into(),
            Kernel::Cb => "ssd_cb".into(),
            Kernel::ChunkState => "ssd_chunk_state".into(),
            Kernel::ChunkStateCoopEmulated(u16) => {
                format!("ssd_chunk_state_coop emulated{}", u_tag(u16))
            }
            Kernel::StatePass => "ssd_state_pass".into(),
            Kernel::StatePassF16 => "ssd_state_pass, f16 entering states".into(),
            Kernel::ChunkScan => "ssd_chunk_scan".into(),
            Kernel::ChunkScanCoopEmulated(u16) => {
                format!("ssd_chunk_scan_coop emulated{}", u_tag(u16))
            }
            Kernel::CbCoopEmulated(u16) => format!("ssd_cb_coop emulated{}", u_tag(u16)),
        }
    }

    /// Whether u is stored in f16 for this kernel.
    fn u_f16(self) -> bool {
        matches!(
            self,
            Kernel::Conv(true)
                | Kernel::ChunkStateCoopEmulated(true)
                | Kernel::CbCoopEmulated(true)
                | Kernel::ChunkScanCoopEmulated(true)
        )
    }
}

fn u_tag(u16: bool) -> &'static str {
    if u16 { ", u in f16" } else { "" }
}

/// A Mamba2 mixer's sizes (d_inner = heads · head_dim).
#[derive(Clone, Copy, Debug)]
struct Mixer {
    heads: usize,
    head_dim: usize,
    groups: usize,
    d_state: usize,
    /// Conv kernel width K.
    conv: usize,
    /// δ is clamped to this (time_step_limit).
    dt_limit: (f64, f64),
}

const NO_LIMIT: (f64, f64) = (0.0, f64::INFINITY);
const fn mixer(heads: usize, head_dim: usize, groups: usize, d_state: usize) -> Mixer {
    Mixer {
        heads,
        head_dim,
        groups,
        d_state,
        conv: 4,
        dt_limit: NO_LIMIT,
    }
}
const MAMBA2_130M: Mixer = mixer(24, 64, 1, 128);
const MAMBA2_2_7B: Mixer = mixer(80, 64, 1, 128);
const CODESTRAL_7B: Mixer = mixer(128, 64, 8, 128);
const NEMOTRON_H_8B: Mixer = mixer(128, 64, 8, 128);

/// `Y [T][ys] (=|+=) X [T][ceil32(k)] · Wᵀ`, W `[m, k]`, in each of `formats`.
struct GemmShape {
    name: &'static str,
    m: usize,
    k: usize,
    ys: usize,
    /// Where W's rows start in each Y row (a part of a stacked projection).
    y0: usize,
    /// The matrix's output scale (Granite's residual multiplier on a block's last
    /// projection).
    rs: f32,
    out: GemmOutput,
    formats: &'static [WeightFormat],
    /// Block capacity (buffer rows, the full grid).
    cap: usize,
    /// Tokens of each block, fed in order through the same buffers.
    blocks: &'static [usize],
}

/// A mixer's chunked SSD in chunks of `q`, blocks of `blocks` tokens through buffers for
/// `cap` tokens.
struct SsdShape {
    name: &'static str,
    mixer: Mixer,
    q: usize,
    cap: usize,
    blocks: &'static [usize],
}

const fn tile(bt: usize, bm: usize, wt: usize, wr: usize, stages: usize) -> CoopTile {
    tile_k(bt, bm, wt, wr, stages, 32)
}

const fn tile_k(bt: usize, bm: usize, wt: usize, wr: usize, stages: usize, bk: usize) -> CoopTile {
    CoopTile {
        bt,
        bm,
        wt,
        wr,
        stages,
        bk,
    }
}

/// Tiles the tensor-core GEMM is validated on: the default, and the others measured for
/// BENCHMARKS.md.
const COOP_TILES: &[CoopTile] = &[
    TILES[0],
    TILES[1],
    TILES[2],
    tile_k(128, 256, 4, 4, 2, 16),
    tile(128, 128, 2, 2, 2),
    tile(128, 128, 2, 4, 2),
    tile(128, 64, 4, 2, 2),
    tile(64, 128, 2, 2, 2),
    tile(32, 32, 1, 1, 2),
    tile(256, 128, 8, 2, 1),
    tile(128, 128, 4, 2, 1),
    tile_k(128, 128, 4, 2, 2, 16),
];

/// Tiles small enough for lavapipe's 32 KiB of workgroup memory, run with the stand-ins:
/// one subgroup, subgroups along tokens only (one stage), along rows only, and both; K steps
/// of 32 and 16.
const EMULATED_TILES: &[CoopTile] = &[
    tile(32, 32, 1, 1, 2),
    tile(64, 32, 2, 1, 1),
    tile(32, 64, 1, 2, 2),
    tile(64, 64, 2, 2, 2),
    tile_k(32, 32, 1, 1, 2, 16),
    tile_k(64, 64, 2, 2, 2, 16),
];

const GEMMS: &[GemmShape] = &[
    GemmShape {
        name: "mamba2-130m in_proj: M 3352, K 768",
        m: 3352,
        k: 768,
        ys: 3352,
        y0: 0,
        rs: 1.0,
        out: Store,
        formats: &[
            F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
        ],
        cap: 100,
        blocks: &[100, 37],
    },
    GemmShape {
        name: "mamba2-130m out_proj + residual: M 768, K 1536",
        m: 768,
        k: 1536,
        ys: 768,
        y0: 0,
        rs: 1.0,
        out: Add,
        formats: &[F32, F16, Q8_0, Q4_K, Q5_K, Q6_K],
        cap: 100,
        blocks: &[100, 37],
    },
    GemmShape {
        name: "codestral-7b out_proj + residual (M 4096 → 512 rows): K 8192",
        m: 512,
        k: 8192,
        ys: 512,
        y0: 0,
        rs: 1.0,
        out: Add,
        formats: &[F16, Q8_0, Q4_K],
        cap: 40,
        blocks: &[40, 17],
    },
    GemmShape {
        name: "nemotron-h-8b in_proj (M 18560 → 640 rows): K 4096",
        m: 640,
        k: 4096,
        ys: 640,
        y0: 0,
        rs: 1.0,
        out: Store,
        formats: &[F32, Q8_0, Q6_K],
        cap: 40,
        blocks: &[33],
    },
    GemmShape {
        name: "mamba2-130m out_proj + residual, short blocks: M 768, K 1536",
        m: 768,
        k: 1536,
        ys: 768,
        y0: 0,
        rs: 1.0,
        out: Add,
        formats: &[
            F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
        ],
        cap: 64,
        blocks: &[64, 17, 1],
    },
    GemmShape {
        name: "odd short: M 37, K 70, rows of 40",
        m: 37,
        k: 70,
        ys: 40,
        y0: 0,
        rs: 1.0,
        out: Store,
        formats: &[F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1],
        cap: 64,
        blocks: &[23, 2],
    },
    GemmShape {
        name: "odd: M 37, K 70, rows of 40",
        m: 37,
        k: 70,
        ys: 40,
        y0: 0,
        rs: 1.0,
        out: Store,
        formats: &[F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1],
        cap: 80,
        blocks: &[70, 5, 1],
    },
    GemmShape {
        name: "odd: M 129, K 33",
        m: 129,
        k: 33,
        ys: 129,
        y0: 0,
        rs: 1.0,
        out: Add,
        formats: &[F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1],
        cap: 80,
        blocks: &[65, 64],
    },
    GemmShape {
        name: "MoE router (Granite-4.0-H-Tiny's 64 × 1536, f32) over blocks of 300",
        m: 64,
        k: 1536,
        ys: 64,
        y0: 0,
        rs: 1.0,
        out: Store,
        formats: &[F32],
        cap: 300,
        blocks: &[300, 129, 65],
    },
    GemmShape {
        name: "a block's last projection scaled by Granite's residual multiplier: M 208, K 96",
        m: 208,
        k: 96,
        ys: 208,
        y0: 0,
        rs: 0.22,
        out: Add,
        formats: &[F32, F16, Q8_0, Q4_0, Q5_1],
        cap: 100,
        blocks: &[100, 37],
    },
    GemmShape {
        name: "the same over short blocks (split over K): M 208, K 1024, ×0.22",
        m: 208,
        k: 1024,
        ys: 208,
        y0: 0,
        rs: 0.22,
        out: Add,
        formats: &[F32, Q8_0, Q4_K, Q6_K],
        cap: 64,
        blocks: &[64, 17, 1],
    },
    GemmShape {
        name: "the v part of a parted qkv projection: M 96 from row 48 of rows of 160, K 256",
        m: 96,
        k: 256,
        ys: 160,
        y0: 48,
        rs: 1.0,
        out: Store,
        formats: &[F32, F16, Q8_0, Q4_0, Q4_K, Q6_K],
        cap: 70,
        blocks: &[70, 5],
    },
    GemmShape {
        name: "a part of odd rows from an odd row, short blocks: M 37 from row 9 of rows of 50, K 64",
        m: 37,
        k: 64,
        ys: 50,
        y0: 9,
        rs: 1.0,
        out: Store,
        formats: &[F32, Q8_0, Q5_1],
        cap: 64,
        blocks: &[64, 3],
    },
    GemmShape {
        name: "rows in whole 16s but not whole tiles: M 208, K 96, rows of 224",
        m: 208,
        k: 96,
        ys: 224,
        y0: 0,
        rs: 1.0,
        out: Store,
        formats: &[F16, Q8_0],
        cap: 70,
        blocks: &[70, 33],
    },
];

const SSDS: &[SsdShape] = &[
    SsdShape {
        name: "mamba2-130m: H 24, P 64, N 128, G 1",
        mixer: MAMBA2_130M,
        q: 16,
        cap: 64,
        blocks: &[64, 37],
    },
    SsdShape {
        name: "mamba2-130m: H 24, P 64, N 128, G 1",
        mixer: MAMBA2_130M,
        q: 64,
        cap: 100,
        blocks: &[100, 45],
    },
    SsdShape {
        name: "mamba2-130m (its chunk 256: 4×4 tiles)",
        mixer: MAMBA2_130M,
        q: 256,
        cap: 100,
        blocks: &[100, 29],
    },
    SsdShape {
        name: "mamba2-2.7b: H 80, P 64, N 128, G 1",
        mixer: MAMBA2_2_7B,
        q: 64,
        cap: 96,
        blocks: &[96, 50],
    },
    SsdShape {
        name: "codestral-7b: H 128, P 64, N 128, G 8",
        mixer: CODESTRAL_7B,
        q: 16,
        cap: 48,
        blocks: &[48, 21],
    },
    SsdShape {
        name: "nemotron-h-8b: H 128, P 64, N 128, G 8 (its chunk 128)",
        mixer: NEMOTRON_H_8B,
        q: 128,
        cap: 100,
        blocks: &[100, 16],
    },
    SsdShape {
        name: "odd: H 4, P 6, N 12, G 2, K 4, δ clamped to [0.01, 0.5]",
        mixer: Mixer {
            heads: 4,
            head_dim: 6,
            groups: 2,
            d_state: 12,
            conv: 4,
            dt_limit: (0.01, 0.5),
        },
        q: 8,
        cap: 32,
        blocks: &[19, 2, 1, 32],
    },
    SsdShape {
        name: "odd: H 6, P 12, N 20, G 2, K 3",
        mixer: Mixer {
            heads: 6,
            head_dim: 12,
            groups: 2,
            d_state: 20,
            conv: 3,
            dt_limit: NO_LIMIT,
        },
        q: 16,
        cap: 48,
        blocks: &[37, 16, 48],
    },
    SsdShape {
        name: "odd: H 3, P 70, N 72, G 3, K 2 (two 64-tiles of P and N)",
        mixer: Mixer {
            heads: 3,
            head_dim: 70,
            groups: 3,
            d_state: 72,
            conv: 2,
            dt_limit: NO_LIMIT,
        },
        q: 24,
        cap: 60,
        blocks: &[60, 25],
    },
    SsdShape {
        name: "odd: H 2, P 5, N 7, G 1, K 4 (P·N not whole vectors; 21 chunks: 16 + 4 + 1)",
        mixer: Mixer {
            heads: 2,
            head_dim: 5,
            groups: 1,
            d_state: 7,
            conv: 4,
            dt_limit: NO_LIMIT,
        },
        q: 4,
        cap: 84,
        blocks: &[84, 9],
    },
    SsdShape {
        name: "codestral-7b, 21 chunks of 4 (16 + 4 + 1 at a time, four values per invocation)",
        mixer: CODESTRAL_7B,
        q: 4,
        cap: 84,
        blocks: &[84],
    },
];

#[derive(Clone, Copy)]
enum Shape {
    Gemm(&'static GemmShape),
    Ssd(&'static SsdShape),
}

struct Case {
    kernel: Kernel,
    shape: Shape,
    tol: f64,
}

impl Case {
    fn name(&self) -> String {
        let (shape, q, cap, blocks) = match self.shape {
            Shape::Gemm(s) => (s.name, None, s.cap, s.blocks),
            Shape::Ssd(s) => (s.name, Some(s.q), s.cap, s.blocks),
        };
        let chunk = q.map_or(String::new(), |q| format!("chunk {q}, "));
        format!(
            "{} | {shape} | {chunk}blocks {blocks:?} of ≤ {cap}",
            self.kernel.label()
        )
    }
}

/// The table: every GEMM shape in each of its formats (and gemm_coop's WGSL for the f16
/// and q8_0 ones), every chunked-SSD kernel at every SSD shape.
fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for s in GEMMS {
        for &w in s.formats {
            let shape = Shape::Gemm(s);
            v.push(Case {
                kernel: Kernel::Gemm(w, s.out),
                shape,
                tol: F32_TOL,
            });
            // Blocks of at most one token tile also run split over K; longer ones where
            // their matrix has few rows (f32: the routers, which the tensor cores never take).
            if s.blocks.iter().all(|&t| t <= TILE.1) {
                v.push(Case {
                    kernel: Kernel::GemmSplit(w, s.out),
                    shape,
                    tol: F32_TOL,
                });
            } else if w == F32 {
                v.push(Case {
                    kernel: Kernel::GemmBlockSplit(w, s.out),
                    shape,
                    tol: F32_TOL,
                });
            }
            // gemm_coop reads f16 and q8_0 rows padded to 32 (the rest take gemm everywhere).
            if matches!(w, F16 | Q8_0) && w.padded_cols(s.k) % 32 == 0 {
                v.push(Case {
                    kernel: Kernel::GemmCoopWgsl(w, s.out),
                    shape,
                    tol: 0.0,
                });
                // Each shape and format on the tiles that take its format, in turn, through
                // workgroup memory and (M a multiple of 16) straight into Y.
                for direct in [false, true] {
                    if direct && !s.m.is_multiple_of(16) {
                        continue;
                    }
                    let n = EMULATED_TILES.len();
                    let tile = (0..n)
                        .map(|i| (v.len() / 3 + i) % n)
                        .find(|&i| EMULATED_TILES[i].check(w, direct).is_ok())
                        .expect("an emulated tile for every format");
                    v.push(Case {
                        kernel: Kernel::GemmCoopEmulated(w, s.out, tile, direct),
                        shape,
                        tol: F32_TOL,
                    });
                }
                if s.blocks.iter().all(|&t| t <= TILE.1) {
                    v.push(Case {
                        kernel: Kernel::GemmCoopSplitEmulated(w, s.out),
                        shape,
                        tol: F32_TOL,
                    });
                }
            }
        }
    }
    for kernel in [
        Kernel::Conv(false),
        Kernel::Cumsum,
        Kernel::Cb,
        Kernel::ChunkState,
        Kernel::StatePass,
        Kernel::ChunkScan,
    ] {
        for s in SSDS {
            // The cooperative kernels read u from f32 and from f16 (f16-representable
            // values both ways: the same sums).
            for u16 in [false, true] {
                if kernel == Kernel::ChunkState && coop_takes(s) {
                    v.push(Case {
                        kernel: Kernel::ChunkStateCoopEmulated(u16),
                        shape: Shape::Ssd(s),
                        tol: F32_TOL,
                    });
                }
                if kernel == Kernel::Cb && ssd_cb_coop::takes(&Sz::new(s.mixer, s.q, s.cap).cc()) {
                    v.push(Case {
                        kernel: Kernel::CbCoopEmulated(u16),
                        shape: Shape::Ssd(s),
                        tol: F32_TOL,
                    });
                }
                if kernel == Kernel::ChunkScan && scan_coop_takes(s) {
                    v.push(Case {
                        kernel: Kernel::ChunkScanCoopEmulated(u16),
                        shape: Shape::Ssd(s),
                        tol: F32_TOL,
                    });
                }
            }
            // The conv writing u in f16: within half an f16 step of the reference's value
            // (2⁻¹¹ of the largest), where the conv takes four columns at a time.
            if kernel == Kernel::Conv(false) && conv_writes_f16(s) {
                v.push(Case {
                    kernel: Kernel::Conv(true),
                    shape: Shape::Ssd(s),
                    tol: F16_HALF_STEP,
                });
            }
            if kernel == Kernel::StatePass && scan_coop_takes(s) {
                v.push(Case {
                    kernel: Kernel::StatePassF16,
                    shape: Shape::Ssd(s),
                    tol: F32_TOL,
                });
            }
            v.push(Case {
                kernel,
                shape: Shape::Ssd(s),
                tol: F32_TOL,
            });
        }
    }
    v
}

// ---------------------------------------------------------------------------------------
// The tests: one per kernel, each iterating its rows of the table
// ---------------------------------------------------------------------------------------

#[test]
fn gemm_every_format() {
    run_cases(|k| matches!(k, Kernel::Gemm(..)));
}

#[test]
fn gemm_split_k_every_format() {
    run_cases(|k| matches!(k, Kernel::GemmSplit(..)));
}

/// Long blocks split over K for matrices of one row tile: the router shape does (16 slices
/// over 5 token tiles), the wider f32 ones run the plain GEMM through the same call.
#[test]
fn gemm_split_k_long_blocks() {
    if let Some(k) = common::kernels(1 << 24) {
        let s = GEMMS
            .iter()
            .find(|s| s.name.starts_with("MoE router"))
            .unwrap();
        let p = pack(F32, &rand(1, s.m * s.k, -1.0, 1.0), s.m, s.k);
        let mat = DeviceMatrix::upload(&k.ctx, "w", &p).unwrap();
        assert!(block_slices(&k, &mat, s.cap) >= 4, "{}", s.name);
        let wide = pack(F32, &rand(2, 768 * 1536, -1.0, 1.0), 768, 1536);
        let wide = DeviceMatrix::upload(&k.ctx, "w", &wide).unwrap();
        assert_eq!(
            block_slices(&k, &wide, 100),
            1,
            "a 768-row matrix in 100-token blocks"
        );
    }
    run_cases(|k| matches!(k, Kernel::GemmBlockSplit(..)));
}

#[test]
fn gemm_coop_emulated_every_format() {
    run_cases(|k| matches!(k, Kernel::GemmCoopEmulated(..)));
}

#[test]
fn gemm_coop_split_k_emulated() {
    run_cases(|k| matches!(k, Kernel::GemmCoopSplitEmulated(..)));
}

#[test]
fn gemm_coop_wgsl_validates() {
    run_cases(|k| matches!(k, Kernel::GemmCoopWgsl(..)));
}

#[test]
fn prefill_conv_and_conv_state() {
    run_cases(|k| matches!(k, Kernel::Conv(_)));
}

#[test]
fn ssd_cumsum_kernel() {
    run_cases(|k| k == Kernel::Cumsum);
}

#[test]
fn ssd_cb_kernel() {
    run_cases(|k| k == Kernel::Cb);
}

#[test]
fn ssd_cb_coop_emulated() {
    run_cases(|k| matches!(k, Kernel::CbCoopEmulated(_)));
}

/// The cooperative C·Bᵀ's WGSL with the cooperative ops, for every SSD shape it takes,
/// through naga's parser, validator and SPIR-V writer.
#[test]
fn ssd_cb_coop_wgsl_validates() {
    let src = include_str!("../shaders/ssd_cb_coop.wgsl");
    let mut checked = 0;
    for shape in SSDS {
        let cc = Sz::new(shape.mixer, shape.q, shape.cap).cc();
        if !ssd_cb_coop::takes(&cc) {
            continue;
        }
        let sources = ["enable wgpu_cooperative_matrix;\n", CONV_OUT, src];
        // u read from f32 and from f16.
        for flags in [&["COOP"][..], &["COOP", "U16"]] {
            let text = assemble("ssd_cb_coop", &sources, &cc.consts(), flags).unwrap();
            naga_check(&text).unwrap_or_else(|e| panic!("{}: {e}", shape.name));
        }
        checked += 1;
    }
    assert!(checked > 0, "no SSD shape the cooperative C·Bᵀ takes");
}

/// The engine's load-time checks of the cooperative kernels (`gemm_coop::self_check`, which
/// also runs q8_0 weights, and `ssd_coop_check::self_check`) pass on the
/// stand-ins: their CPU sums agree with kernels known to be right, so on a device a failure
/// means the device's cooperative ops.
#[test]
fn coop_load_checks_pass_on_the_stand_ins() {
    let _one = ONE_DEVICE_TEST_AT_A_TIME.lock();
    let Some(g) = Gpu::new() else { return };
    gemm_coop::self_check(&g.k, true).unwrap();
    ssd_coop_check::self_check(&g.k, true).unwrap();
}

#[test]
fn ssd_chunk_state_kernel() {
    run_cases(|k| k == Kernel::ChunkState);
}

#[test]
fn ssd_chunk_state_coop_emulated() {
    run_cases(|k| matches!(k, Kernel::ChunkStateCoopEmulated(_)));
}

/// The cooperative chunk state's WGSL with the cooperative ops, for every SSD shape it
/// takes, through naga's parser, validator and SPIR-V writer.
#[test]
fn ssd_chunk_state_coop_wgsl_validates() {
    let src = include_str!("../shaders/ssd_chunk_state_coop.wgsl");
    let mut checked = 0;
    for shape in SSDS.iter().filter(|s| coop_takes(s)) {
        let cc = Sz::new(shape.mixer, shape.q, shape.cap).cc();
        let sources = ["enable wgpu_cooperative_matrix;\n", CONV_OUT, src];
        // u read from f32 and from f16.
        for flags in [&["COOP"][..], &["COOP", "U16"]] {
            let text = assemble("ssd_chunk_state_coop", &sources, &cc.consts(), flags).unwrap();
            naga_check(&text).unwrap_or_else(|e| panic!("{}: {e}", shape.name));
        }
        checked += 1;
    }
    assert!(
        checked > 0,
        "no SSD shape the cooperative chunk state takes"
    );
}

/// Whether the conv can write u in f16 at this shape (four columns per invocation).
fn conv_writes_f16(s: &SsdShape) -> bool {
    let z = Sz::new(s.mixer, s.q, s.cap);
    z.kc <= 4 && [z.dip, z.di, z.cd, z.h].iter().all(|n| n % 4 == 0)
}

/// Whether `ssd_chunk_state_coop` takes this SSD shape.
fn coop_takes(s: &SsdShape) -> bool {
    ssd_chunk_state_coop::takes(&Sz::new(s.mixer, s.q, s.cap).cc())
}

#[test]
fn ssd_state_pass_kernel() {
    run_cases(|k| matches!(k, Kernel::StatePass | Kernel::StatePassF16));
}

#[test]
fn ssd_chunk_scan_kernel() {
    run_cases(|k| k == Kernel::ChunkScan);
}

#[test]
fn ssd_chunk_scan_coop_emulated() {
    run_cases(|k| matches!(k, Kernel::ChunkScanCoopEmulated(_)));
}

/// The cooperative chunk scan's WGSL with the cooperative ops, for every SSD shape it
/// takes, through naga's parser, validator and SPIR-V writer.
#[test]
fn ssd_chunk_scan_coop_wgsl_validates() {
    let src = include_str!("../shaders/ssd_chunk_scan_coop.wgsl");
    let mut checked = 0;
    for shape in SSDS.iter().filter(|s| scan_coop_takes(s)) {
        let cc = Sz::new(shape.mixer, shape.q, shape.cap).cc();
        let mut consts = cc.consts();
        consts.push(("D_OFF", Const::U32(0)));
        let sources = ["enable wgpu_cooperative_matrix;\n", CONV_OUT, src];
        // u read from f32 and from f16.
        for flags in [&["COOP"][..], &["COOP", "U16"]] {
            let text = assemble("ssd_chunk_scan_coop", &sources, &consts, flags).unwrap();
            naga_check(&text).unwrap_or_else(|e| panic!("{}: {e}", shape.name));
        }
        checked += 1;
    }
    assert!(checked > 0, "no SSD shape the cooperative chunk scan takes");
}

/// Whether `ssd_chunk_scan_coop` takes this SSD shape.
fn scan_coop_takes(s: &SsdShape) -> bool {
    ssd_chunk_scan_coop::takes(&Sz::new(s.mixer, s.q, s.cap).cc())
}

/// lavapipe spreads every dispatch over all cores, so GPU tests side by side only fight
/// over them: on 2 cores this file took 75 s with the harness's parallel tests and 30 s
/// with the device tests one at a time.
static ONE_DEVICE_TEST_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs the table's rows whose kernel `pick` selects, prints one line per case (worst
/// NMSE, worst max error relative to the largest reference value, time) and fails with
/// every failing case named.
fn run_cases(pick: impl Fn(Kernel) -> bool) {
    let rows: Vec<Case> = cases().into_iter().filter(|c| pick(c.kernel)).collect();
    assert!(!rows.is_empty(), "no rows in the table");
    let needs_gpu = !matches!(rows[0].kernel, Kernel::GemmCoopWgsl(..));
    // A failed test poisons the lock; the next one runs anyway.
    let _turn = needs_gpu.then(|| {
        ONE_DEVICE_TEST_AT_A_TIME
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    });
    let gpu = if needs_gpu { Gpu::new() } else { None };
    if needs_gpu && gpu.is_none() {
        return;
    }
    let mut failures = Vec::new();
    for (i, case) in rows.iter().enumerate() {
        let name = case.name();
        let seed = 1 + 1000 * i as u64 + hash(&name) % 1000;
        let start = Instant::now();
        let result = match (case.kernel, case.shape, &gpu) {
            (Kernel::GemmCoopWgsl(w, out), Shape::Gemm(s), _) => coop_wgsl(w, out, s),
            (Kernel::Gemm(w, out), Shape::Gemm(s), Some(g)) => run_gemm(g, seed, w, out, s, false),
            (Kernel::GemmSplit(w, out), Shape::Gemm(s), Some(g)) => {
                run_gemm(g, seed, w, out, s, true)
            }
            (Kernel::GemmBlockSplit(w, out), Shape::Gemm(s), Some(g)) => {
                run_gemm_with(g, seed, w, out, s, GemmPath::BlockSplitK)
            }
            (Kernel::GemmCoopEmulated(w, out, t, direct), Shape::Gemm(s), Some(g)) => {
                run_gemm_coop_emulated(g, seed, w, out, s, EMULATED_TILES[t], direct)
            }
            (Kernel::GemmCoopSplitEmulated(w, out), Shape::Gemm(s), Some(g)) => {
                run_gemm_with(g, seed, w, out, s, GemmPath::CoopSplitEmulated)
            }
            (kernel, Shape::Ssd(s), Some(g)) => run_ssd(g, seed, kernel, s),
            _ => Err("kernel and shape do not go together".into()),
        };
        let secs = start.elapsed().as_secs_f64();
        match result {
            Ok(stats) => {
                // NaN-propagating maxima: a NaN anywhere shows in the summary.
                let max = |a: f64, b: f64| {
                    if a.is_nan() || b.is_nan() {
                        f64::NAN
                    } else {
                        a.max(b)
                    }
                };
                let worst = stats.iter().fold((0f64, 0f64), |(e, m), s| {
                    (max(e, s.nmse), max(m, s.max_rel))
                });
                let bad: Vec<&Stat> = stats
                    .iter()
                    .filter(|s| s.nmse.is_nan() || s.nmse > case.tol)
                    .collect();
                let verdict = if bad.is_empty() { "ok  " } else { "FAIL" };
                eprintln!(
                    "{verdict} {name}: NMSE {:.1e}, max rel err {:.1e}, {secs:.2} s",
                    worst.0, worst.1
                );
                for s in bad {
                    failures.push(format!(
                        "{name}: {}: NMSE {:e} > {:e} (max rel err {:e})",
                        s.what, s.nmse, case.tol, s.max_rel
                    ));
                }
            }
            Err(e) => {
                eprintln!("FAIL {name}: {e}");
                failures.push(format!("{name}: {e}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Device helpers (after tests/gpu_kernels.rs)
// ---------------------------------------------------------------------------------------

struct Gpu {
    k: Kernels,
}

type Res<T> = std::result::Result<T, String>;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Gpu {
    fn new() -> Option<Self> {
        common::kernels(1 << 27).map(|k| Gpu { k })
    }
    fn ctx(&self) -> &Arc<GpuContext> {
        &self.k.ctx
    }
    fn buf(&self, v: &[f32]) -> Res<wgpu::Buffer> {
        self.ctx()
            .storage_with("test", bytemuck::cast_slice(v))
            .map_err(err)
    }
    fn write(&self, b: &wgpu::Buffer, v: &[f32]) {
        self.ctx().queue.write_buffer(b, 0, bytemuck::cast_slice(v));
    }
    /// The control block of a block of `tokens` tokens (`ctrl.prompt_len`).
    fn set_tokens(&self, ctrl: &wgpu::Buffer, tokens: usize) {
        let c = Ctrl {
            prompt_len: tokens as u32,
            ..Default::default()
        };
        self.ctx()
            .queue
            .write_buffer(ctrl, 0, bytemuck::bytes_of(&c));
    }
    /// Records `ds` in one compute pass with grids for `tokens` tokens, as the block graph
    /// does, and waits for them.
    fn run(&self, ds: &[&Dispatch], tokens: usize) -> Res<()> {
        let mut enc = self
            .ctx()
            .device
            .create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            for d in ds {
                d.record_tokens(&mut pass, Some(tokens as u32));
            }
        }
        self.ctx().queue.submit([enc.finish()]);
        self.ctx().wait().map_err(err)
    }
    fn read(&self, b: &wgpu::Buffer, n: usize) -> Res<Vec<f32>> {
        self.ctx().read_f32(b, n).map_err(err)
    }
}

fn hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn rand(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| lo + (hi - lo) * uniform(seed, i))
        .collect()
}

/// How the entries of an output buffer are judged.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Region {
    /// Computed by the kernel: NMSE against the reference.
    Live,
    /// Written or not, nobody reads it.
    Free,
    /// Must keep its contents (rows past the block, chunks past its last): bit for bit.
    Kept,
}

struct Stat {
    what: String,
    nmse: f64,
    /// max |got − want| / max |want| over the live entries.
    max_rel: f64,
}

/// `got` against `want` (the reference on live entries, the previous contents elsewhere).
fn compare(what: &str, got: &[f32], want: &[f32], region: impl Fn(usize) -> Region) -> Res<Stat> {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        match region(i) {
            Region::Live => {
                g.push(a);
                w.push(b);
            }
            Region::Free => {}
            Region::Kept => {
                if a.to_bits() != b.to_bits() {
                    return Err(format!(
                        "{what}: entry {i} must be left alone but went from {b} to {a}"
                    ));
                }
            }
        }
    }
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let max_rel = g
        .iter()
        .zip(&w)
        .map(|(a, b)| ((a - b).abs() / scale) as f64)
        .fold(0f64, |m, e| {
            if m.is_nan() || e.is_nan() {
                f64::NAN
            } else {
                m.max(e)
            }
        });
    Ok(Stat {
        what: what.to_string(),
        nmse: common::nmse(&g, &w),
        max_rel,
    })
}

// ---------------------------------------------------------------------------------------
// gemm
// ---------------------------------------------------------------------------------------

/// Which GEMM dispatch `run_gemm_with` builds.
#[derive(Clone, Copy)]
enum GemmPath {
    Plain,
    SplitK,
    BlockSplitK,
    CoopEmulated(CoopTile, bool),
    CoopSplitEmulated,
}

fn run_gemm(
    g: &Gpu,
    seed: u64,
    w: WeightFormat,
    out: GemmOutput,
    s: &GemmShape,
    split: bool,
) -> Res<Vec<Stat>> {
    let path = if split {
        GemmPath::SplitK
    } else {
        GemmPath::Plain
    };
    run_gemm_with(g, seed, w, out, s, path)
}

/// The tensor-core kernel with its stand-ins, held to the f32 bound against products of
/// the operands as it multiplies them: X and the dequantized weights rounded to f16.
/// `direct`: Y gets the rows of `gemm_coop::y_rows`, so where M is a multiple of 16 the
/// accumulators go straight to it (and its rows past the block are scratch).
fn run_gemm_coop_emulated(
    g: &Gpu,
    seed: u64,
    w: WeightFormat,
    out: GemmOutput,
    s: &GemmShape,
    tile: CoopTile,
    direct: bool,
) -> Res<Vec<Stat>> {
    run_gemm_with(g, seed, w, out, s, GemmPath::CoopEmulated(tile, direct))
}

fn run_gemm_with(
    g: &Gpu,
    seed: u64,
    w: WeightFormat,
    out: GemmOutput,
    s: &GemmShape,
    path: GemmPath,
) -> Res<Vec<Stat>> {
    let (m, k, ys, y0) = (s.m, s.k, s.ys, s.y0);
    // The split GEMM's buffers hold one token tile.
    let cap = if matches!(path, GemmPath::SplitK | GemmPath::CoopSplitEmulated) {
        TILE.1
    } else {
        s.cap
    };
    let xs = k.next_multiple_of(32);
    let p = pack(w, &rand(seed, m * k, -1.0, 1.0), m, k);
    let f16_operands = matches!(
        path,
        GemmPath::CoopEmulated(..) | GemmPath::CoopSplitEmulated
    );
    // The direct epilogue's Y: rows up to the grid's end and the spare rows.
    let direct = matches!(path, GemmPath::CoopEmulated(_, true));
    let y_len = if direct {
        gemm_coop::y_rows(cap) * ys
    } else {
        cap * ys
    };
    let to_f16 = |v: f32| {
        if f16_operands {
            half::f16::from_f32(v).to_f32()
        } else {
            v
        }
    };
    let deq: Vec<f32> = unpack(&p).into_iter().map(to_f16).collect();
    let mat = DeviceMatrix::upload(g.ctx(), "w", &p)
        .map_err(err)?
        .scaled(s.rs);
    let mut xh = vec![f32::NAN; cap * xs];
    let mut yh = vec![f32::NAN; y_len];
    let (xb, yb, ctrl) = (g.buf(&xh)?, g.buf(&yh)?, g.buf(&[0.0; 16])?);
    let ds = match path {
        GemmPath::SplitK => {
            // (A K whose padded width has no whole slices runs the plain GEMM: checked too.)
            let slices = part_slices(&g.k, &mat);
            let part = g.buf(&vec![f32::NAN; slices * TILE.1 * m])?;
            gemm_split(
                &g.k, "gemm", &mat, TILE.1, &xb, &part, &yb, ys, y0, out, &ctrl,
            )
            .map_err(err)?
        }
        GemmPath::BlockSplitK => {
            // The partials exactly as the engine sizes them.
            let part = g.buf(&vec![f32::NAN; part_values(&g.k, &mat, cap).max(1)])?;
            gemm_split(&g.k, "gemm", &mat, cap, &xb, &part, &yb, ys, y0, out, &ctrl).map_err(err)?
        }
        GemmPath::CoopSplitEmulated => {
            // The engine's slice count (across the table: 16 slices of 512 or 256 columns,
            // 12 of 128, 6 of 256, and one where the K rounds allow no split).
            let slices = gemm_coop::split_slices(&mat, gemm_coop::split_tile(&g.k));
            let part = g.buf(&vec![f32::NAN; slices * TILE.1 * m])?;
            vec![
                gemm_coop::gemm_coop_split(
                    &g.k,
                    "gemm_coop",
                    &mat,
                    &xb,
                    &part,
                    &ctrl,
                    slices,
                    true,
                )
                .map_err(err)?,
                gemm_reduce(
                    &g.k,
                    "reduce",
                    m,
                    slices,
                    (TILE.1, TILE.1),
                    &part,
                    &yb,
                    ys,
                    y0,
                    s.rs,
                    out,
                    &ctrl,
                )
                .map_err(err)?,
            ]
        }
        GemmPath::Plain => {
            vec![gemm(&g.k, "gemm", &mat, cap, &xb, &yb, ys, y0, out, &ctrl).map_err(err)?]
        }
        GemmPath::CoopEmulated(tile, _) => vec![
            gemm_coop(
                &g.k,
                "gemm_coop",
                &mat,
                cap,
                &xb,
                &yb,
                ys,
                y0,
                out,
                &ctrl,
                tile,
                true,
            )
            .map_err(err)?,
        ],
    };
    let mut stats = Vec::new();
    for (b, &t) in s.blocks.iter().enumerate() {
        let seed = seed + 100 * (b as u64 + 1);
        // Rows of X as the batched norms leave them: K values, zeros up to a multiple of 32.
        let x = rand(seed, t * k, -2.0, 2.0);
        for r in 0..t {
            xh[r * xs..(r + 1) * xs].fill(0.0);
            xh[r * xs..r * xs + k].copy_from_slice(&x[r * k..(r + 1) * k]);
        }
        g.write(&xb, &xh);
        if out == Add {
            let resid = rand(seed + 1, t * m, -3.0, 3.0);
            for r in 0..t {
                yh[r * ys + y0..r * ys + y0 + m].copy_from_slice(&resid[r * m..(r + 1) * m]);
            }
            g.write(&yb, &yh);
        }
        g.set_tokens(&ctrl, t);
        g.run(&ds.iter().collect::<Vec<_>>(), t)?;
        let got = g.read(&yb, y_len)?;
        let mut want = yh.clone();
        let xq: Vec<f32> = x.iter().map(|&v| to_f16(v)).collect();
        for r in 0..t {
            let xr = &xq[r * k..(r + 1) * k];
            for row in 0..m {
                let dot: f64 = deq[row * k..(row + 1) * k]
                    .iter()
                    .zip(xr)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                let base = if out == Add {
                    yh[r * ys + y0 + row] as f64
                } else {
                    0.0
                };
                want[r * ys + y0 + row] = (base + s.rs as f64 * dot) as f32;
            }
        }
        let direct_taken = direct && m % 16 == 0 && y0 % 4 == 0 && s.rs == 1.0;
        let region = |i: usize| {
            if i / ys < t && (y0..y0 + m).contains(&(i % ys)) {
                Region::Live
            } else if direct_taken && i / ys >= t {
                // The direct epilogue's scratch: rows past the block's tokens.
                Region::Free
            } else {
                Region::Kept
            }
        };
        stats.push(compare(
            &format!("Y, block {b} ({t} tokens)"),
            &got,
            &want,
            region,
        )?);
        yh = got;
    }
    Ok(stats)
}

/// Parses, validates and translates a kernel's WGSL to SPIR-V with naga.
fn naga_check(text: &str) -> Res<()> {
    let module =
        naga::front::wgsl::parse_str(text).map_err(|e| e.emit_to_string(text).to_string())?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string(text))?;
    let spv =
        naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None)
            .map_err(|e| format!("SPIR-V: {e}"))?;
    if spv.len() <= 100 {
        return Err(format!("SPIR-V of {} words", spv.len()));
    }
    Ok(())
}

/// gemm_coop's WGSL for this shape on every tile of `COOP_TILES`, with the cooperative ops
/// and with their stand-ins, through naga's parser, validator and SPIR-V writer.
fn coop_wgsl(w: WeightFormat, out: GemmOutput, s: &GemmShape) -> Res<Vec<Stat>> {
    let kp = w.padded_cols(s.k);
    // Every format has a tile without the direct epilogue (Y buffers without its rows).
    if !TILES.iter().any(|t| t.check(w, false).is_ok()) {
        return Err(format!(
            "no tile of TILES takes {} without the direct epilogue",
            w.name()
        ));
    }
    // (Tiles that cannot take this format, such as q8_0's 32-byte rows over too many
    // invocations, are refused by `check` and never built; the direct epilogue only where M
    // is a multiple of 16.)
    for &tile in COOP_TILES {
        for direct in [false, true] {
            if tile.check(w, direct).is_err() || (direct && !s.m.is_multiple_of(16)) {
                continue;
            }
            let spare = direct.then_some(256);
            for emulate in [false, true] {
                let (sources, consts, flags) = specialize(
                    w, s.m, kp, s.k, s.ys, s.y0, s.rs, out, tile, spare, None, emulate,
                );
                let what = format!("tile {tile}, {flags:?}");
                let text = assemble("gemm_coop", sources, &consts, &flags).map_err(err)?;
                naga_check(&text).map_err(|e| format!("{what}: {e}"))?;
            }
        }
    }
    // A short block's split-K partial sums, on both split tiles, in four slices.
    for tile in [gemm_coop::SPLIT_TILE, gemm_coop::SMALL_SPLIT_TILE] {
        if tile.check(w, false).is_err() {
            continue;
        }
        for emulate in [false, true] {
            let (sources, consts, flags) =
                gemm_coop::specialize_split(w, s.m, kp, s.k, tile, 4, emulate);
            let what = format!("split tile {tile}, {flags:?}");
            let text = assemble("gemm_coop", sources, &consts, &flags).map_err(err)?;
            naga_check(&text).map_err(|e| format!("{what}: {e}"))?;
        }
    }
    // The MoE experts' grouped tiles, gathered and not, each way out.
    for top_k in [Some(3), None] {
        for direct in [false, true] {
            if direct && !s.m.is_multiple_of(16) {
                continue;
            }
            let grouped = gemm_coop::Grouped {
                rows: 640,
                first: 2,
                count: 5,
                top_k,
            };
            let spare = direct.then_some(640);
            let tile = gemm_coop::GROUPED_TILE;
            for emulate in [false, true] {
                let (sources, consts, flags) = specialize(
                    w,
                    s.m,
                    kp,
                    s.k,
                    s.ys,
                    0,
                    1.0,
                    Store,
                    tile,
                    spare,
                    Some(grouped),
                    emulate,
                );
                let what = format!("grouped tile {tile}, {flags:?}");
                let text = assemble("gemm_coop", sources, &consts, &flags).map_err(err)?;
                naga_check(&text).map_err(|e| format!("{what}: {e}"))?;
            }
        }
    }
    Ok(Vec::new())
}

// ---------------------------------------------------------------------------------------
// The chunked SSD: sizes, layouts, CPU references of each step
// ---------------------------------------------------------------------------------------

/// Sizes of an SSD case. Layouts (chunk.rs): `mix [T][DIP] = [z | x B C | dt]`,
/// `u [T][CD] = [x | B | C]`, `lam [NC][H][Q]`, `cb [NC][G][Q][Q]`, `cst [NC][H][P][N]`,
/// `y [T][DI]`, conv state `[CD][K−1]`, SSM state `[H][P][N]`.
#[derive(Clone, Copy)]
struct Sz {
    m: Mixer,
    h: usize,
    p: usize,
    g: usize,
    n: usize,
    di: usize,
    cd: usize,
    dip: usize,
    kc: usize,
    q: usize,
    cap: usize,
}

/// Offsets in the layer's small-parameter vector (not at 0, to catch a missing offset).
struct Params {
    cw: usize,
    cb: usize,
    dtb: usize,
    a: usize,
    d: usize,
    len: usize,
}

impl Sz {
    fn new(m: Mixer, q: usize, cap: usize) -> Self {
        let di = m.heads * m.head_dim;
        let cd = di + 2 * m.groups * m.d_state;
        Sz {
            m,
            h: m.heads,
            p: m.head_dim,
            g: m.groups,
            n: m.d_state,
            di,
            cd,
            dip: di + cd + m.heads,
            kc: m.conv,
            q,
            cap,
        }
    }
    fn hpn(&self) -> usize {
        self.h * self.p * self.n
    }
    /// Chunks of the full block (buffer sizes).
    fn nc(&self) -> usize {
        self.cap.div_ceil(self.q)
    }
    fn cc(&self) -> ChunkConsts {
        ChunkConsts {
            heads: self.h,
            head_dim: self.p,
            groups: self.g,
            d_state: self.n,
            d_inner: self.di,
            conv_dim: self.cd,
            d_in_proj: self.dip,
            q: self.q,
            max_tokens: self.cap,
            u_f16: false,
        }
    }
    fn params(&self) -> Params {
        let cw = 5;
        let cb = cw + self.cd * self.kc;
        let dtb = cb + self.cd;
        let a = dtb + self.h;
        let d = a + self.h;
        Params {
            cw,
            cb,
            dtb,
            a,
            d,
            len: d + self.h,
        }
    }
    fn mc(&self) -> MixerConsts {
        let p = self.params();
        MixerConsts {
            d_inner: self.di,
            conv_dim: self.cd,
            heads: self.h,
            kernel: self.kc,
            cw_off: p.cw,
            cb_off: p.cb,
            dtb_off: p.dtb,
            dt_limit: self.m.dt_limit,
        }
    }
    fn group(&self, h: usize) -> usize {
        h / (self.h / self.g)
    }
    fn delta(&self, mix: &[f32], t: usize, h: usize) -> f64 {
        mix[t * self.dip + self.di + self.cd + h] as f64
    }
    fn x(&self, u: &[f32], t: usize, h: usize, p: usize) -> f64 {
        u[t * self.cd + h * self.p + p] as f64
    }
    fn b(&self, u: &[f32], t: usize, g: usize, n: usize) -> f64 {
        u[t * self.cd + self.di + g * self.n + n] as f64
    }
    fn c(&self, u: &[f32], t: usize, g: usize, n: usize) -> f64 {
        u[t * self.cd + self.di + (self.g + g) * self.n + n] as f64
    }
    /// Positions of chunk `c` inside a block of `t` tokens.
    fn len_of(&self, c: usize, t: usize) -> usize {
        self.q.min(t - c * self.q)
    }
}

/// The conv over a block of `t` tokens from the raw `mix` rows and the cached columns:
/// `u [t][CD]`, δ `[t][H]` and the new conv state.
fn ref_conv(s: &Sz, mix: &[f32], par: &[f32], state: &[f32], t: usize) -> [Vec<f32>; 3] {
    let (k, pr) = (s.kc, s.params());
    let input = |tt: isize, col: usize| -> f64 {
        if tt >= 0 {
            mix[tt as usize * s.dip + s.di + col] as f64
        } else {
            state[col * (k - 1) + (k as isize - 1 + tt) as usize] as f64
        }
    };
    let mut u = vec![0f32; t * s.cd];
    for tt in 0..t {
        for col in 0..s.cd {
            let mut acc = par[pr.cb + col] as f64;
            for j in 0..k {
                acc += par[pr.cw + col * k + j] as f64
                    * input(tt as isize - (k as isize - 1) + j as isize, col);
            }
            u[tt * s.cd + col] = silu(acc) as f32;
        }
    }
    let (lo, hi) = s.m.dt_limit;
    let mut dt = vec![0f32; t * s.h];
    for tt in 0..t {
        for h in 0..s.h {
            let raw = s.delta(mix, tt, h) + par[pr.dtb + h] as f64;
            dt[tt * s.h + h] = softplus(raw).clamp(lo, hi) as f32;
        }
    }
    let mut next = vec![0f32; s.cd * (k - 1)];
    for col in 0..s.cd {
        for j in 0..k - 1 {
            next[col * (k - 1) + j] = input(t as isize - (k as isize - 1) + j as isize, col) as f32;
        }
    }
    [u, dt, next]
}

/// Step 1: `lam [NC_T][H][Q]`, the inclusive cumsum of δ·A per chunk; past the block's end
/// δ counts as 0 (Λ keeps its last value: the chunk-state and state-passing steps read
/// Λ at Q − 1 for the tail chunk).
fn ref_cumsum(s: &Sz, mix: &[f32], a: &[f32], t: usize) -> Vec<f32> {
    let nct = t.div_ceil(s.q);
    let mut lam = vec![0f32; nct * s.h * s.q];
    for c in 0..nct {
        for h in 0..s.h {
            let mut acc = 0f64;
            for i in 0..s.q {
                if c * s.q + i < t {
                    acc += s.delta(mix, c * s.q + i, h) * a[h] as f64;
                }
                lam[(c * s.h + h) * s.q + i] = acc as f32;
            }
        }
    }
    lam
}

/// Step 2: `cb [NC_T][G][Q][Q]`, C_i·B_j for j ≤ i inside the block; NaN elsewhere (no one
/// may read it). With `f16`: of C and B rounded to f16, as the tensor cores multiply them.
fn ref_cb(s: &Sz, u: &[f32], t: usize, f16: bool) -> Vec<f32> {
    let round = |v: f64| {
        if f16 {
            half::f16::from_f32(v as f32).to_f64()
        } else {
            v
        }
    };
    let (q, nct) = (s.q, t.div_ceil(s.q));
    let mut cb = vec![f32::NAN; nct * s.g * q * q];
    for c in 0..nct {
        let len = s.len_of(c, t);
        for g in 0..s.g {
            for i in 0..len {
                for j in 0..=i {
                    let dot: f64 = (0..s.n)
                        .map(|n| round(s.c(u, c * q + i, g, n)) * round(s.b(u, c * q + j, g, n)))
                        .sum();
                    cb[((c * s.g + g) * q + i) * q + j] = dot as f32;
                }
            }
        }
    }
    cb
}

/// Step 3: `cst [NC_T][H][P][N]`, s_c = Σ_j exp(min(Λ_last − Λ_j, 0))·δ_j·x_j ⊗ B_j.
/// With `f16`: of the operands the tensor cores multiply, w·x and B rounded to f16 (w·x
/// formed in f32 first, as the kernel does).
fn ref_chunk_state(s: &Sz, mix: &[f32], u: &[f32], lam: &[f32], t: usize, f16: bool) -> Vec<f32> {
    let round = |v: f64| {
        if f16 {
            half::f16::from_f32(v as f32).to_f64()
        } else {
            v
        }
    };
    let (q, pn, nct) = (s.q, s.p * s.n, t.div_ceil(s.q));
    let mut cst = vec![0f32; nct * s.h * pn];
    let mut acc = vec![0f64; pn];
    for c in 0..nct {
        for h in 0..s.h {
            let g = s.group(h);
            let lb = (c * s.h + h) * q;
            let last = lam[lb + q - 1] as f64;
            acc.fill(0.0);
            for j in 0..s.len_of(c, t) {
                let tt = c * q + j;
                let w = (last - lam[lb + j] as f64).min(0.0).exp() * s.delta(mix, tt, h);
                for p in 0..s.p {
                    let wx = if f16 {
                        // The kernel's f32 product of its f32 weight and x.
                        round((w as f32 * s.x(u, tt, h, p) as f32) as f64)
                    } else {
                        w * s.x(u, tt, h, p)
                    };
                    for n in 0..s.n {
                        acc[p * s.n + n] += wx * round(s.b(u, tt, g, n));
                    }
                }
            }
            for (o, &a) in cst[(c * s.h + h) * pn..][..pn].iter_mut().zip(&acc) {
                *o = a as f32;
            }
        }
    }
    cst
}

/// Step 4: the state entering each chunk, S_0 = `state`, S_{c+1} = exp(Λ_last,c)·S_c + s_c
/// (`[NC_T][H][P][N]`), and the state after the block.
fn ref_state_pass(s: &Sz, lam: &[f32], cst: &[f32], state: &[f32], t: usize) -> [Vec<f32>; 2] {
    let (hpn, nct) = (s.hpn(), t.div_ceil(s.q));
    let mut enter = vec![0f32; nct * hpn];
    let mut next = vec![0f32; hpn];
    for idx in 0..hpn {
        let h = idx / (s.p * s.n);
        let mut v = state[idx] as f64;
        for c in 0..nct {
            enter[c * hpn + idx] = v as f32;
            let decay = (lam[(c * s.h + h) * s.q + s.q - 1] as f64).exp();
            v = decay * v + cst[c * hpn + idx] as f64;
        }
        next[idx] = v as f32;
    }
    [enter, next]
}

/// Step 5: `y [t][DI]`, y_i = exp(Λ_i)·C_i·S_c + Σ_{j≤i} CB[i,j]·exp(min(Λ_i − Λ_j, 0))·δ_j·x_j
/// plus D·x_i, with S_c the state entering the chunk (`enter`). `f16`: the cooperative
/// kernel's operands, each rounded to f16 from its f32 value (exp(Λ_i)·C_i, the weights
/// CB·exp(·)·δ, S and x; D·x stays exact).
#[allow(clippy::too_many_arguments)]
fn ref_chunk_scan(
    s: &Sz,
    mix: &[f32],
    u: &[f32],
    d: &[f32],
    lam: &[f32],
    cb: &[f32],
    enter: &[f32],
    t: usize,
    f16: bool,
) -> Vec<f32> {
    let round = |v: f32| {
        if f16 {
            half::f16::from_f32(v).to_f64()
        } else {
            v as f64
        }
    };
    let (q, pn) = (s.q, s.p * s.n);
    let mut y = vec![0f32; t * s.di];
    for c in 0..t.div_ceil(q) {
        for h in 0..s.h {
            let g = s.group(h);
            let lb = (c * s.h + h) * q;
            let st = &enter[(c * s.h + h) * pn..][..pn];
            for i in 0..s.len_of(c, t) {
                let ti = c * q + i;
                let li = lam[lb + i] as f64;
                // The intra-chunk weights of row i, shared by the head's channels.
                let wts: Vec<f64> = (0..=i)
                    .map(|j| {
                        let cbv = cb[((c * s.g + g) * q + i) * q + j];
                        if f16 {
                            let lj = lam[lb + j];
                            let e = (lam[lb + i] - lj).min(0.0).exp();
                            round(cbv * e * s.delta(mix, c * q + j, h) as f32)
                        } else {
                            cbv as f64
                                * (li - lam[lb + j] as f64).min(0.0).exp()
                                * s.delta(mix, c * q + j, h)
                        }
                    })
                    .collect();
                // exp(Λ_i)·C_i: applied to the sum, or (f16) to each C value before rounding.
                let (outer, ci): (f64, Vec<f64>) = if f16 {
                    let e = lam[lb + i].exp();
                    let ci = (0..s.n).map(|n| round(s.c(u, ti, g, n) as f32 * e));
                    (1.0, ci.collect())
                } else {
                    (li.exp(), (0..s.n).map(|n| s.c(u, ti, g, n)).collect())
                };
                for p in 0..s.p {
                    let inter: f64 = (0..s.n).map(|n| ci[n] * round(st[p * s.n + n])).sum();
                    let intra: f64 = wts
                        .iter()
                        .enumerate()
                        .map(|(j, w)| w * round(s.x(u, c * q + j, h, p) as f32))
                        .sum();
                    let dx = if f16 {
                        (d[h] * s.x(u, ti, h, p) as f32) as f64
                    } else {
                        d[h] as f64 * s.x(u, ti, h, p)
                    };
                    y[ti * s.di + h * s.p + p] = (outer * inter + intra + dx) as f32;
                }
            }
        }
    }
    y
}

/// Fresh rows 0..t of `mix`: z in [−2, 2], xBC in [−1, 1], dt in `dt`.
fn mix_rows(s: &Sz, mix: &mut [f32], t: usize, seed: u64, dt: (f32, f32)) {
    for r in 0..t {
        for col in 0..s.dip {
            let v = uniform(seed, (r * s.dip + col) as u64);
            mix[r * s.dip + col] = if col < s.di {
                -2.0 + 4.0 * v
            } else if col < s.di + s.cd {
                -1.0 + 2.0 * v
            } else {
                dt.0 + (dt.1 - dt.0) * v
            };
        }
    }
}

/// Fresh rows 0..t of `u` (x, B, C) in [−1, 1].
fn u_rows(s: &Sz, u: &mut [f32], t: usize, seed: u64) {
    let v = rand(seed, t * s.cd, -1.0, 1.0);
    u[..t * s.cd].copy_from_slice(&v);
}

/// δ after softplus: decays exp(δ·A) between e^−0.2 and ~1 per token, so that neither
/// the chunk's own tokens nor the carried state vanish within a chunk.
const DELTA: (f32, f32) = (0.005, 0.15);

/// The layer's small parameters: conv weights and bias, dt bias, A < 0, D.
fn layer_params(s: &Sz, seed: u64) -> Vec<f32> {
    let pr = s.params();
    let mut v = rand(seed, pr.len, -0.5, 0.5);
    for h in 0..s.h {
        v[pr.dtb + h] = -2.0 + 2.0 * uniform(seed + 1, h as u64);
        v[pr.a + h] = -1.5 + 1.4 * uniform(seed + 2, h as u64);
        v[pr.d + h] = 0.5 + uniform(seed + 3, h as u64);
    }
    v
}

/// Region of an `[NC][rest]` buffer for a block of `t` tokens: chunks inside the block
/// are live, later ones kept.
fn by_chunk(s: &Sz, t: usize, rest: usize) -> impl Fn(usize) -> Region {
    let live = t.div_ceil(s.q) * rest;
    move |i| if i < live { Region::Live } else { Region::Kept }
}

/// Replaces the first `live.len()` entries of a copy of `old`.
fn over(old: &[f32], live: &[f32]) -> Vec<f32> {
    let mut v = old.to_vec();
    v[..live.len()].copy_from_slice(live);
    v
}

fn run_ssd(g: &Gpu, seed: u64, kernel: Kernel, shape: &SsdShape) -> Res<Vec<Stat>> {
    let s = Sz::new(shape.mixer, shape.q, shape.cap);
    let u16 = kernel.u_f16();
    let (cc, pr) = (
        ChunkConsts {
            u_f16: u16,
            ..s.cc()
        },
        s.params(),
    );
    let (q, nc, hpn) = (s.q, s.nc(), s.hpn());
    let params = layer_params(&s, seed);
    let a = &params[pr.a..pr.a + s.h];
    let dskip = &params[pr.d..pr.d + s.h];
    let nan = |n: usize| vec![f32::NAN; n];
    let ctrl = g.buf(&[0.0; 16])?;
    let pbuf = g.buf(&params)?;
    let (mut mix, mut u) = (nan(s.cap * s.dip), nan(s.cap * s.cd));
    let (mixb, ub) = (g.buf(&mix)?, g.buf(&u)?);
    let (mut lam, mut cb, mut cst, mut y) = (
        nan(nc * s.h * q),
        nan(nc * s.g * q * q),
        nan(nc * hpn),
        // Whole chunks of rows: the cooperative scan writes them.
        nan(nc * q * s.di),
    );
    let (lamb, cbb, cstb, yb) = (g.buf(&lam)?, g.buf(&cb)?, g.buf(&cst)?, g.buf(&y)?);
    // The entering states in f16 (two per f32 slot), NaN until written.
    let cst16b = g.buf(&nan(hpn * nc / 2 + 1))?;
    // Carried state: a previous turn's, not zero.
    let mut conv = rand(seed + 7, s.cd * (s.kc - 1), -1.0, 1.0);
    let mut state = rand(seed + 8, hpn, -1.0, 1.0);
    let (convb, stateb) = (g.buf(&conv)?, g.buf(&state)?);

    // The dispatches, with the token axes prefill.rs gives them.
    let ds: Vec<Dispatch> = match kernel {
        Kernel::Conv(_) => {
            let b = ConvBuffers {
                mix: &mixb,
                params: &pbuf,
                conv_state: &convb,
                u: &ub,
                ctrl: &ctrl,
            };
            vec![
                prefill_conv(&g.k, "conv", cc, s.mc(), b).map_err(err)?,
                prefill_conv_state(&g.k, "conv_state", cc, s.mc(), &mixb, &convb, &ctrl)
                    .map_err(err)?,
            ]
        }
        Kernel::Cumsum => vec![
            ssd_cumsum::ssd_cumsum(&g.k, "cumsum", cc, pr.a, &mixb, &pbuf, &lamb, &ctrl)
                .map_err(err)?
                .per_token(1, q, 1),
        ],
        Kernel::Cb => vec![
            ssd_cb::ssd_cb(&g.k, "cb", cc, &ub, &cbb, &ctrl)
                .map_err(err)?
                .per_token(2, q, s.g),
        ],
        Kernel::CbCoopEmulated(_) => vec![
            ssd_cb_coop::ssd_cb_coop(&g.k, "cb_coop", cc, &ub, &cbb, &ctrl, true)
                .map_err(err)?
                .per_token(2, q, s.g),
        ],
        Kernel::ChunkState => vec![
            ssd_chunk_state::ssd_chunk_state(
                &g.k,
                "chunk_state",
                cc,
                &mixb,
                &ub,
                &lamb,
                &cstb,
                &ctrl,
            )
            .map_err(err)?
            .per_token(2, q, s.h),
        ],
        Kernel::ChunkStateCoopEmulated(_) => vec![
            ssd_chunk_state_coop::ssd_chunk_state_coop(
                &g.k,
                "chunk_state_coop",
                cc,
                &mixb,
                &ub,
                &lamb,
                &cstb,
                &ctrl,
                true,
            )
            .map_err(err)?
            .per_token(2, q, s.h),
        ],
        Kernel::StatePass | Kernel::StatePassF16 => vec![
            ssd_state_pass::ssd_state_pass(
                &g.k,
                "state_pass",
                cc,
                &lamb,
                &cstb,
                &stateb,
                (kernel == Kernel::StatePassF16).then_some(&cst16b),
                &ctrl,
            )
            .map_err(err)?,
        ],
        Kernel::ChunkScan | Kernel::ChunkScanCoopEmulated(_) => {
            let b = ScanBuffers {
                mix: &mixb,
                u: &ub,
                params: &pbuf,
                lam: &lamb,
                cb: &cbb,
                cst: &cstb,
                cst16: Some(&cst16b),
                y: &yb,
                ctrl: &ctrl,
            };
            let d = if kernel == Kernel::ChunkScan {
                ssd_chunk_scan(&g.k, "chunk_scan", cc, pr.d, b)
            } else {
                ssd_chunk_scan_coop::ssd_chunk_scan_coop(&g.k, "chunk_scan_coop", cc, pr.d, b, true)
            };
            vec![d.map_err(err)?.per_token(2, q, 1)]
        }
        _ => return Err("not an SSD kernel".into()),
    };
    let refs: Vec<&Dispatch> = ds.iter().collect();

    let mut stats = Vec::new();
    for (bi, &t) in shape.blocks.iter().enumerate() {
        let seed = seed + 100 * (bi as u64 + 1);
        let nct = t.div_ceil(q);
        let tag = |what: &str| format!("{what}, block {bi} ({t} tokens)");
        // Fresh rows 0..t of the block's inputs; the rest keep the previous block's.
        let dt = if matches!(kernel, Kernel::Conv(_)) {
            (-4.0, 2.0)
        } else {
            DELTA
        };
        mix_rows(&s, &mut mix, t, seed, dt);
        u_rows(&s, &mut u, t, seed + 1);
        if u16 {
            u = round_f16(&u);
        }
        g.write(&mixb, &mix);
        write_values(g, &ub, &u, u16);
        // The inputs later steps read, as the earlier steps would leave them.
        let lam_in = ref_cumsum(&s, &mix, a, t);
        match kernel {
            Kernel::ChunkState
            | Kernel::ChunkStateCoopEmulated(_)
            | Kernel::StatePass
            | Kernel::StatePassF16
            | Kernel::ChunkScan
            | Kernel::ChunkScanCoopEmulated(_) => {
                lam = over(&lam, &lam_in);
                g.write(&lamb, &lam);
            }
            _ => {}
        }
        let scan = matches!(kernel, Kernel::ChunkScan | Kernel::ChunkScanCoopEmulated(_));
        if matches!(kernel, Kernel::StatePass | Kernel::StatePassF16) || scan {
            // Chunk states (state pass) or the states entering each chunk (scan).
            cst = over(&cst, &rand(seed + 2, nct * hpn, -1.0, 1.0));
            g.write(&cstb, &cst);
        }
        if scan {
            // The tensor-core scan reads them in f16, as ssd_state_pass hands them over.
            write_values(g, &cst16b, &cst, true);
        }
        if scan {
            cb = over(&cb, &ref_cb(&s, &u, t, false));
            g.write(&cbb, &cb);
        }
        g.set_tokens(&ctrl, t);
        g.run(&refs, t)?;
        match kernel {
            Kernel::Conv(_) => {
                let [uw, dtw, next] = ref_conv(&s, &mix, &params, &conv, t);
                let got = read_values(g, &ub, u.len(), u16)?;
                let live = t * s.cd;
                let region = |i: usize| if i < live { Region::Live } else { Region::Kept };
                stats.push(compare(&tag("u"), &got, &over(&u, &uw), region)?);
                u = got;
                let mut want = mix.clone();
                for tt in 0..t {
                    let row = tt * s.dip + s.di + s.cd;
                    want[row..row + s.h].copy_from_slice(&dtw[tt * s.h..(tt + 1) * s.h]);
                }
                let got = g.read(&mixb, mix.len())?;
                let region = |i: usize| {
                    if i / s.dip < t && i % s.dip >= s.di + s.cd {
                        Region::Live
                    } else {
                        Region::Kept
                    }
                };
                stats.push(compare(&tag("δ (mix dt columns)"), &got, &want, region)?);
                mix = got;
                let got = g.read(&convb, conv.len())?;
                stats.push(compare(&tag("conv state"), &got, &next, |_| Region::Live)?);
                conv = got;
            }
            Kernel::Cumsum => {
                let got = g.read(&lamb, lam.len())?;
                let region = by_chunk(&s, t, s.h * q);
                stats.push(compare(&tag("Λ"), &got, &over(&lam, &lam_in), region)?);
                lam = got;
            }
            Kernel::Cb | Kernel::CbCoopEmulated(_) => {
                // (On a device with cooperative matrices `ssd_cb` runs the cooperative
                // kernel: the reference rounds its operands the same way.)
                let f16 =
                    matches!(kernel, Kernel::CbCoopEmulated(_)) || ssd_cb_coop::applies(&g.k, &cc);
                let want = over(&cb, &ref_cb(&s, &u, t, f16));
                let got = g.read(&cbb, cb.len())?;
                let region = |i: usize| {
                    let (c, i_, j) = (i / (s.g * q * q), (i / q) % q, i % q);
                    if c >= nct {
                        Region::Kept
                    } else if j <= i_ && i_ < s.len_of(c, t) {
                        Region::Live
                    } else {
                        Region::Free
                    }
                };
                stats.push(compare(&tag("CB"), &got, &want, region)?);
                cb = got;
            }
            Kernel::ChunkState | Kernel::ChunkStateCoopEmulated(_) => {
                let f16 = matches!(kernel, Kernel::ChunkStateCoopEmulated(_));
                let want = over(&cst, &ref_chunk_state(&s, &mix, &u, &lam, t, f16));
                let got = g.read(&cstb, cst.len())?;
                stats.push(compare(
                    &tag("chunk states"),
                    &got,
                    &want,
                    by_chunk(&s, t, hpn),
                )?);
                cst = got;
            }
            Kernel::StatePass => {
                let [enter, next] = ref_state_pass(&s, &lam, &cst, &state, t);
                let got = g.read(&cstb, cst.len())?;
                let region = by_chunk(&s, t, hpn);
                stats.push(compare(
                    &tag("states entering chunks"),
                    &got,
                    &over(&cst, &enter),
                    region,
                )?);
                cst = got;
                let got = g.read(&stateb, hpn)?;
                stats.push(compare(&tag("state after the block"), &got, &next, |_| {
                    Region::Live
                })?);
                state = got;
            }
            Kernel::StatePassF16 => {
                let [enter, next] = ref_state_pass(&s, &lam, &cst, &state, t);
                let got = read_values(g, &cst16b, nc * hpn, true)?;
                let want = round_f16(&over(&cst, &enter));
                // (Entries past the block's chunks are never written.)
                let live = nct * hpn;
                let region = |i: usize| if i < live { Region::Live } else { Region::Free };
                stats.push(compare(
                    &tag("states entering chunks, f16"),
                    &got,
                    &want,
                    region,
                )?);
                let got = g.read(&cstb, cst.len())?;
                stats.push(compare(&tag("chunk states kept"), &got, &cst, |_| {
                    Region::Live
                })?);
                let got = g.read(&stateb, hpn)?;
                stats.push(compare(&tag("state after the block"), &got, &next, |_| {
                    Region::Live
                })?);
                state = got;
            }
            Kernel::ChunkScan | Kernel::ChunkScanCoopEmulated(_) => {
                // (On a device with cooperative matrices `ssd_chunk_scan` runs the
                // cooperative kernel: the reference rounds its operands the same way.)
                let f16 = matches!(kernel, Kernel::ChunkScanCoopEmulated(_))
                    || ssd_chunk_scan_coop::applies(&g.k, &cc, &yb);
                let yw = ref_chunk_scan(&s, &mix, &u, dskip, &lam, &cb, &cst, t, f16);
                let got = g.read(&yb, y.len())?;
                // The cooperative scan also writes the rest of the block's last chunk.
                let (live, scratch) = (t * s.di, if f16 { nct * q * s.di } else { 0 });
                let region = |i: usize| {
                    if i < live {
                        Region::Live
                    } else if i < scratch {
                        Region::Free
                    } else {
                        Region::Kept
                    }
                };
                stats.push(compare(&tag("y"), &got, &over(&y, &yw), region)?);
                y = got;
            }
            _ => unreachable!(),
        }
    }
    Ok(stats)
}

/// `v` through f16 and back.
fn round_f16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
}

/// Writes `v` in f32 or (`f16`) f16 (u, or the entering states of `cst16`).
fn write_values(g: &Gpu, b: &wgpu::Buffer, v: &[f32], f16: bool) {
    if f16 {
        let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
        g.ctx().queue.write_buffer(b, 0, bytemuck::cast_slice(&h));
    } else {
        g.write(b, v);
    }
}

/// Reads `n` values stored in f32 or (`f16`) f16.
fn read_values(g: &Gpu, b: &wgpu::Buffer, n: usize, f16: bool) -> Res<Vec<f32>> {
    if !f16 {
        return g.read(b, n);
    }
    let words = g.read(b, n.div_ceil(2))?;
    let h: &[half::f16] = bytemuck::cast_slice(&words);
    Ok(h[..n].iter().map(|x| x.to_f32()).collect())
}

// ---------------------------------------------------------------------------------------
// The references above against the library's chunked scan
// ---------------------------------------------------------------------------------------

/// cumsum → CB → chunk states → state passing → chunk scan, composed on the CPU, equal
/// `reference::scan_chunked` in f64 at every SSD shape of the table (first block, from a
/// non-zero state): the per-step references the kernels are held to are the chunked SSD.
#[test]
fn cpu_step_references_compose_to_scan_chunked() {
    for (i, shape) in SSDS.iter().enumerate() {
        let s = Sz::new(shape.mixer, shape.q, shape.cap);
        let t = shape.blocks[0];
        let seed = 77 + i as u64;
        let params = layer_params(&s, seed);
        let pr = s.params();
        let (a, dskip) = (&params[pr.a..pr.a + s.h], &params[pr.d..pr.d + s.h]);
        let (mut mix, mut u) = (vec![0f32; t * s.dip], vec![0f32; t * s.cd]);
        mix_rows(&s, &mut mix, t, seed, DELTA);
        u_rows(&s, &mut u, t, seed + 1);
        let state0 = rand(seed + 2, s.hpn(), -1.0, 1.0);
        let lam = ref_cumsum(&s, &mix, a, t);
        let cb = ref_cb(&s, &u, t, false);
        let cst = ref_chunk_state(&s, &mix, &u, &lam, t, false);
        let [enter, state] = ref_state_pass(&s, &lam, &cst, &state0, t);
        let y = ref_chunk_scan(&s, &mix, &u, dskip, &lam, &cb, &enter, t, false);

        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let cols = |lo: usize, w: usize, stride: usize, v: &[f32]| -> Vec<f64> {
            (0..t)
                .flat_map(|r| {
                    v[r * stride + lo..r * stride + lo + w]
                        .iter()
                        .map(|&x| x as f64)
                })
                .collect()
        };
        let x = cols(0, s.di, s.cd, &u);
        let b = cols(s.di, s.g * s.n, s.cd, &u);
        let c = cols(s.di + s.g * s.n, s.g * s.n, s.cd, &u);
        let dt = cols(s.di + s.cd, s.h, s.dip, &mix);
        let (af, df) = (f(a), f(dskip));
        let inputs = ScanInputs {
            dims: ScanDims {
                heads: s.h,
                head_dim: s.p,
                groups: s.g,
                d_state: s.n,
            },
            x: &x,
            dt: &dt,
            a: &af,
            b: &b,
            c: &c,
            d: &df,
        };
        let mut st = f(&state0);
        let yw = scan_chunked(&inputs, &mut st, s.q);
        let as32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let ey = common::nmse(&y, &as32(&yw));
        let es = common::nmse(&state, &as32(&st));
        assert!(
            ey <= 1e-12 && es <= 1e-12,
            "{} chunk {}: steps vs scan_chunked: y NMSE {ey:e}, state NMSE {es:e}",
            shape.name,
            shape.q
        );
    }
}
