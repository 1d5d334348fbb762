//! `gemm_coop.wgsl`: the prefill projections on cooperative matrices (f16 × f16 → f32
//! 16×16×16 tiles: the tensor cores), for f16, q8_0 and 4/5/6-bit block weights whose
//! padded width is a multiple of 32, on by default where the device has them (`Caps::coop_matrix`). Same
//! contract as `gemm`: `Y [T][ys] (=|+=) X [T][xs] · Wᵀ`, X rows `xs = ceil32(K)` f32
//! values (converted to f16 on the way into workgroup memory).
//!
//! Without the feature the same kernel runs with portable stand-ins for the four
//! cooperative ops (`emulate`): how the tests check its staging, indexing and output on
//! lavapipe.

use super::gemm::GemmOutput;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;
use crate::model::quant::WeightFormat;

const SOURCE: &str = include_str!("../../../shaders/gemm_coop.wgsl");
const BLOCK_QUANT: &str = include_str!("../../../shaders/block_quant.wgsl");
/// The stand-ins' sources.
const EMULATED: super::Sources = &[SOURCE];
/// … for the 4/5/6-bit block formats (their bindings and `bq_weights8`).
const EMULATED_BLOCK: super::Sources = &[BLOCK_QUANT, SOURCE];
/// The real cooperative ops need their `enable` first (one under an `#if` would not do:
/// the assembler hoists every `enable` line).
const COOP: super::Sources = &["enable wgpu_cooperative_matrix;\n", SOURCE];
const COOP_BLOCK: super::Sources = &["enable wgpu_cooperative_matrix;\n", BLOCK_QUANT, SOURCE];

/// The widest K step (the kernel's BK; tiles take 16 or 32): padded widths must be
/// multiples of it.
const BK: usize = 32;

/// Spare rows a Y buffer needs past the grid's last token tile for the direct epilogue.
const SPARE_ROWS: usize = 16;
/// The tallest token tile of `TILES`.
const MAX_BT: usize = 128;

/// Rows a Y buffer for blocks of `max_tokens` needs so that every tile `tile_for` picks
/// can store its accumulators straight into it (the direct epilogue: the grid's last
/// token tile plus spare rows where the tiles past M land). Callers that allocate this
/// many get it; rows past the block's tokens are then scratch.
pub fn y_rows(max_tokens: usize) -> usize {
    max_tokens.next_multiple_of(MAX_BT) + SPARE_ROWS
}

/// The most workgroup memory a tile may take (what NVIDIA's Vulkan driver allows; the
/// device is created with it where it has cooperative matrices).
pub const MAX_WORKGROUP_BYTES: usize = 48 * 1024;

/// A workgroup's output tile: `bt` tokens × `bm` rows of W, over `wt` × `wr` subgroups of
/// 32 invocations (each `bt/wt` tokens × `bm/wr` rows, in 16 × 16 accumulator tiles),
/// through `stages` (1 or 2) stages of workgroup memory, `bk` (16 or 32) columns per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    pub bt: usize,
    pub bm: usize,
    pub wt: usize,
    pub wr: usize,
    pub stages: usize,
    pub bk: usize,
}

/// The tiles `tile_for` picks from, largest first (BENCHMARKS.md, "Prefill on tensor
/// cores", has the H200 runs that chose them): 16 subgroups over 128 tokens × 256 rows in one
/// stage (Codestral's f16 projections at 148–154 TFLOP/s with the direct epilogue, 132–143
/// without), 8 over 128 × 128 in two stages (102–107), 4 over 64 × 64. (128 × 256 in two
/// stages of BK 16, which the direct epilogue's freed memory allows: 120 TFLOP/s.)
pub const TILES: [Tile; 3] = [
    Tile {
        bt: 128,
        bm: 256,
        wt: 4,
        wr: 4,
        stages: 1,
        bk: 32,
    },
    Tile {
        bt: 128,
        bm: 128,
        wt: 4,
        wr: 2,
        stages: 2,
        bk: 32,
    },
    Tile {
        bt: 64,
        bm: 64,
        wt: 2,
        wr: 2,
        stages: 2,
        bk: 32,
    },
];

/// The tile of the MoE experts' grouped GEMM: 64 sorted rows (one expert's tile of
/// `moe_sort`) × 128 rows of the expert's matrix over 8 subgroups.
pub const GROUPED_TILE: Tile = Tile {
    bt: 64,
    bm: 128,
    wt: 2,
    wr: 4,
    stages: 2,
    bk: 32,
};

/// The MoE experts' grouped GEMM as `specialize` sees it: `rows` sorted rows in tiles of
/// 64, each of one expert (`tile_expert`); a bank of `count` experts from `first`; X rows
/// gathered through the sorted pairs of `top_k` choices per token, or read in order.
#[derive(Clone, Copy, Debug)]
pub struct Grouped {
    pub rows: usize,
    pub first: usize,
    pub count: usize,
    pub top_k: Option<usize>,
}

/// Workgroups a GEMM should have before a larger tile is worth it (about one per SM of an
/// H200, 132): Mamba2-130m's out_proj over 512 tokens took 2.3 ms on 128 × 128 tiles (24
/// workgroups), 1.6 ms on 64 × 64 (96); Codestral's took 21 ms on 128 × 128 (128
/// workgroups) and 46 ms on 64 × 64 (512), run 50.
const FILL_WORKGROUPS: usize = 128;

impl Tile {
    pub fn subgroups(&self) -> usize {
        self.wt * self.wr
    }

    pub fn threads(&self) -> usize {
        32 * self.subgroups()
    }

    /// Bytes of workgroup memory: the stages of both operands (f16 rows of bk + 8) and,
    /// unless the accumulators go straight to Y (`direct`), one f32 tile per subgroup.
    pub fn workgroup_bytes(&self, direct: bool) -> usize {
        let outs = if direct {
            0
        } else {
            self.subgroups() * 256 * 4
        };
        self.stages * (self.bt + self.bm) * (self.bk + 8) * 2 + outs
    }

    /// 16-byte W slices per row and step: 8 f16 or 16 q8_0 values each.
    fn w_slices(&self, format: WeightFormat) -> usize {
        if format == WeightFormat::Q8_0 {
            self.bk / 16
        } else {
            self.bk / 8
        }
    }

    /// Whether the kernel can take this tile for weights of `format`: whole 16 × 16 tiles
    /// per subgroup and whole 16-byte slices per invocation.
    pub fn check(&self, format: WeightFormat, direct: bool) -> Result<()> {
        let n = self.threads();
        let ok = self.wt > 0
            && self.wr > 0
            && (1..=2).contains(&self.stages)
            && (self.bk == 16 || self.bk == 32)
            && self.bt <= MAX_BT
            && self.bt.is_multiple_of(16 * self.wt)
            && self.bm.is_multiple_of(16 * self.wr)
            && (self.bt * self.bk / 4).is_multiple_of(n)
            && (self.bm * self.w_slices(format)).is_multiple_of(n)
            && n <= 1024
            && self.workgroup_bytes(direct) <= MAX_WORKGROUP_BYTES;
        if ok {
            Ok(())
        } else {
            Err(Error::InvalidInput(format!(
                "cooperative GEMM tile {self}: want bt ≤ {MAX_BT} a multiple of 16·wt, bm of \
                 16·wr, bk 16 or 32, whole 16-byte slices of both operands for each of its {n} \
                 invocations and at most {MAX_WORKGROUP_BYTES} bytes of workgroup memory ({} \
                 here)",
                self.workgroup_bytes(direct)
            )))
        }
    }

    /// Parses `BTxBM/WTxWR[/STAGES[/BK]]`, e.g. `128x128/4x2` (MAMBA2_COOP_TILE; 2 stages
    /// and BK 32 unless given).
    pub fn parse(s: &str) -> Option<Tile> {
        let mut parts = s.split('/');
        let pair = |p: &str| -> Option<(usize, usize)> {
            let (a, b) = p.split_once('x')?;
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        };
        let (bt, bm) = pair(parts.next()?)?;
        let (wt, wr) = pair(parts.next()?)?;
        let stages = match parts.next() {
            Some(n) => n.trim().parse().ok()?,
            None => 2,
        };
        let bk = match parts.next() {
            Some(n) => n.trim().parse().ok()?,
            None => 32,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(Tile {
            bt,
            bm,
            wt,
            wr,
            stages,
            bk,
        })
    }
}

impl std::fmt::Display for Tile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}/{}x{}", self.bt, self.bm, self.wt, self.wr)?;
        if self.stages != 2 || self.bk != 32 {
            write!(f, "/{}", self.stages)?;
        }
        if self.bk != 32 {
            write!(f, "/{}", self.bk)?;
        }
        Ok(())
    }
}

/// Whether the cooperative-matrix GEMM serves this matrix on this device (on the tensor
/// cores, or with the stand-ins where a test asks: `Caps::coop_kernels`).
pub fn applies(k: &Kernels, w: &DeviceMatrix) -> bool {
    k.ctx.caps.coop_kernels() && takes(w)
}

/// Whether the kernel reads this matrix at all (formats and row widths): f16, q8_0 and the
/// 4/5/6-bit block formats (dequantized to f16 on their way into workgroup memory;
/// MAMBA2_COOP_BLOCKS=0 leaves those to the FMA tiles, for comparison).
pub fn takes(w: &DeviceMatrix) -> bool {
    let format = match w.format {
        WeightFormat::F32 | WeightFormat::BF16 => false,
        WeightFormat::F16 | WeightFormat::Q8_0 => true,
        _ => blocks_on(),
    };
    format && w.kp.is_multiple_of(BK)
}

/// Whether the block formats take the tensor cores (MAMBA2_COOP_BLOCKS: 1, the default,
/// or 0; `check_overrides` refuses other values).
fn blocks_on() -> bool {
    std::env::var("MAMBA2_COOP_BLOCKS")
        .ok()
        .and_then(|s| parse_blocks(&s).ok())
        .unwrap_or(true)
}

/// Whether a GEMM of `rows` rows of W over blocks of `max_tokens` into `y` (rows of `ys`,
/// W's from value `y0`) can store its accumulators straight into Y: W's rows in whole
/// 16-row tiles, Y with `y_rows` rows, and a first row whose tiles start on 16 bytes, as a
/// cooperative load or store wants (MAMBA2_COOP_NO_DIRECT=1 turns it off, for comparison).
/// (`direct_fits` for a matrix: also no output scale, which that epilogue cannot apply.)
pub fn direct_fits_rows(
    rows: usize,
    max_tokens: usize,
    y: &wgpu::Buffer,
    ys: usize,
    y0: usize,
) -> bool {
    rows.is_multiple_of(16)
        && y0.is_multiple_of(4)
        && y.size() >= 4 * (y_rows(max_tokens) * ys) as u64
        && std::env::var_os("MAMBA2_COOP_NO_DIRECT").is_none_or(|v| v != "1")
}

/// Whether `w`'s GEMM takes the direct epilogue (`direct_fits_rows`): only without an output
/// scale (the accumulators go to Y as they are).
pub fn direct_fits(
    w: &DeviceMatrix,
    max_tokens: usize,
    y: &wgpu::Buffer,
    ys: usize,
    y0: usize,
) -> bool {
    w.out_scale == 1.0 && direct_fits_rows(w.rows, max_tokens, y, ys, y0)
}

/// K steps of loads in flight ahead of the multiplies (the kernel's PF register sets) for
/// weights of `format` padded to `kp` columns: MAMBA2_COOP_PF (1 to 4, for tuning;
/// `check_overrides` refuses anything else before a device is made) or what the H200
/// measured best (BENCHMARKS.md, "Prefill GEMMs with loads two steps ahead", runs 72–73,
/// Codestral at 4096 tokens): two for f16 (in_proj 208.5 → 196.5 ms, out_proj 87.6 → 87.4)
/// and for q8_0 up to 4096 columns (in_proj 204.6 → 198.3 ms; mamba2-2.7b's 2560: equal),
/// one for wider q8_0 rows (out_proj over 8192 columns: 85.6 ms against 95.7 with two;
/// 2.7b's 5120: 41.5 against 43.3).
fn prefetch(format: WeightFormat, kp: usize) -> Result<usize> {
    match std::env::var("MAMBA2_COOP_PF") {
        Ok(s) => parse_prefetch(&s),
        Err(_) if format == WeightFormat::Q8_0 && kp > 4096 => Ok(1),
        Err(_) => Ok(2),
    }
}

/// A MAMBA2_COOP_PF value.
fn parse_prefetch(s: &str) -> Result<usize> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=4).contains(&n) => Ok(n),
        _ => Err(Error::InvalidInput(format!(
            "MAMBA2_COOP_PF={s}: want 1, 2, 3 or 4 K steps of loads in flight"
        ))),
    }
}

/// A MAMBA2_COOP_TILE value: a tile the kernel takes for both f16 and q8_0 weights (it is
/// forced on every GEMM).
fn parse_forced_tile(s: &str) -> Result<Tile> {
    let tile = Tile::parse(s).ok_or_else(|| {
        Error::InvalidInput(format!(
            "MAMBA2_COOP_TILE={s}: want BTxBM/WTxWR[/STAGES[/BK]], e.g. 128x256/4x4/1"
        ))
    })?;
    for format in [WeightFormat::F16, WeightFormat::Q8_0] {
        tile.check(format, true).map_err(|e| {
            Error::InvalidInput(format!(
                "MAMBA2_COOP_TILE={s}, for {} weights: {e}",
                format.name()
            ))
        })?;
    }
    Ok(tile)
}

/// The tuning overrides of this kernel (MAMBA2_COOP_TILE, MAMBA2_COOP_PF,
/// MAMBA2_COOP_BLOCKS, and the short blocks' MAMBA2_SPLIT_TILE, MAMBA2_SPLIT_WG), checked
/// before a
/// device is made: a value the kernel cannot take is an error naming the variable, not a
/// failed load-time check that quietly turns the tensor cores off.
pub fn check_overrides() -> Result<()> {
    if let Ok(s) = std::env::var("MAMBA2_COOP_TILE") {
        parse_forced_tile(&s)?;
    }
    if let Ok(s) = std::env::var("MAMBA2_COOP_PF") {
        parse_prefetch(&s)?;
    }
    if let Ok(s) = std::env::var("MAMBA2_SPLIT_TILE") {
        parse_split_tile(&s)?;
    }
    if let Ok(s) = std::env::var("MAMBA2_SPLIT_WG") {
        parse_split_target(&s)?;
    }
    if let Ok(s) = std::env::var("MAMBA2_COOP_BLOCKS") {
        parse_blocks(&s)?;
    }
    Ok(())
}

/// A MAMBA2_COOP_BLOCKS value: 0 or 1.
fn parse_blocks(s: &str) -> Result<bool> {
    match s {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(Error::InvalidInput(format!(
            "MAMBA2_COOP_BLOCKS={s}: want 0 (the block formats on the FMA tiles) or 1"
        ))),
    }
}

/// Whether q8_0 scales are loaded eight at a time (one 16-byte load per row every 256
/// columns, kept in registers across the K steps) instead of one scattered 4-byte load per
/// row and step: rows padded to a multiple of 256 (MAMBA2_COOP_NO_SC8=1 turns it off, for
/// comparison).
fn scales_by_eight(format: WeightFormat, kp: usize) -> bool {
    format == WeightFormat::Q8_0
        && kp.is_multiple_of(256)
        && std::env::var_os("MAMBA2_COOP_NO_SC8").is_none_or(|v| v != "1")
}

/// `takes`, as an error naming the matrix's format and widths.
fn check_takes(name: &str, w: &DeviceMatrix) -> Result<()> {
    if takes(w) {
        Ok(())
    } else {
        Err(Error::Gpu(format!(
            "{name}: the cooperative GEMM takes f16, q8_0 or block-format rows padded to a \
             multiple of {BK}, \
             not {} ({} of {} columns)",
            w.format.name(),
            w.kp,
            w.cols
        )))
    }
}

/// The tile for `w` over blocks of `max_tokens` (`direct`: the accumulators may go straight
/// to Y): MAMBA2_COOP_TILE when set (for tuning; a tile the kernel cannot take is an
/// error), else the largest of `TILES` that still makes `FILL_WORKGROUPS` workgroups (the
/// smallest when none does).
pub fn tile_for(k: &Kernels, w: &DeviceMatrix, max_tokens: usize, direct: bool) -> Result<Tile> {
    let limit = k.ctx.device.limits().max_compute_workgroup_storage_size as usize;
    let tile = match std::env::var("MAMBA2_COOP_TILE") {
        Ok(s) => parse_forced_tile(&s)?,
        Err(_) => pick(w, max_tokens, direct, limit)
            .ok_or_else(|| Error::Gpu(format!("{}: no tile takes it", w.name)))?,
    };
    tile.check(w.format, direct)?;
    Ok(tile)
}

/// The largest of `TILES` that fits `limit` bytes of workgroup memory and still makes
/// `FILL_WORKGROUPS` workgroups over `tokens` tokens (the smallest that fits when none does).
fn pick(w: &DeviceMatrix, tokens: usize, direct: bool, limit: usize) -> Option<Tile> {
    let fits = |t: &&Tile| t.check(w.format, direct).is_ok() && t.workgroup_bytes(direct) <= limit;
    let fills = |t: &&Tile| w.rows.div_ceil(t.bm) * tokens.div_ceil(t.bt) >= FILL_WORKGROUPS;
    TILES
        .iter()
        .filter(fits)
        .find(fills)
        .or_else(|| TILES.iter().rev().find(fits))
        .copied()
}

/// The tiles `tile_for` would pick for blocks shorter than `max_tokens`, other than the
/// full block's `tile`: (most tokens, tile), fewest first — what `gemm` builds extra
/// pipelines for, so that a short prompt runs on tiles that keep the GPU busy (Codestral's
/// out_proj over 512 tokens: 30.1 ms over 64 workgroups of 128 × 256, 21.2 ms on 128 × 128,
/// run 45). None when MAMBA2_COOP_TILE forces one tile.
pub fn shorter_tiles(
    k: &Kernels,
    w: &DeviceMatrix,
    max_tokens: usize,
    direct: bool,
    tile: Tile,
) -> Vec<(usize, Tile)> {
    if std::env::var_os("MAMBA2_COOP_TILE").is_some() {
        return Vec::new();
    }
    let limit = k.ctx.device.limits().max_compute_workgroup_storage_size as usize;
    let mut out: Vec<(usize, Tile)> = Vec::new();
    for t in 1..max_tokens {
        match pick(w, t, direct, limit) {
            Some(p) if p != tile => match out.last_mut() {
                Some((most, last)) if *last == p => *most = t,
                _ => out.push((t, p)),
            },
            _ => {}
        }
    }
    out
}

/// The kernel's sources, constants and flags for `rows` × `cols` weights of `format`
/// padded to `kp`, Y rows of `ys` values, on `tile` (checked by the caller); `spare`: the
/// direct epilogue's first spare row of Y (None: through workgroup memory).
#[allow(clippy::too_many_arguments)]
pub fn specialize(
    format: WeightFormat,
    rows: usize,
    kp: usize,
    cols: usize,
    ys: usize,
    y0: usize,
    rs: f32,
    output: GemmOutput,
    tile: Tile,
    spare: Option<usize>,
    grouped: Option<Grouped>,
    emulate: bool,
) -> (
    super::Sources,
    Vec<(&'static str, Const)>,
    Vec<&'static str>,
) {
    // (q8_0: 16 values a slice; f16 and the block formats, dequantized: 8.)
    let vp = if format == WeightFormat::Q8_0 { 16 } else { 8 };
    let block = !matches!(format, WeightFormat::F16 | WeightFormat::Q8_0);
    let pw = tile.w_slices(format);
    let n = tile.threads();
    let u = |v: usize| Const::U32(v as u32);
    let mut consts = vec![
        ("M", u(rows)),
        ("KP", u(kp)),
        ("KLEN", u(kp)),
        ("XS", u(cols.next_multiple_of(32))),
        ("YS", u(ys)),
        ("Y0", u(y0)),
        ("RS", Const::F32(rs)),
        ("BT", u(tile.bt)),
        ("BM", u(tile.bm)),
        ("WT", u(tile.wt)),
        ("WR", u(tile.wr)),
        ("FT", u(tile.bt / 16 / tile.wt)),
        ("FM", u(tile.bm / 16 / tile.wr)),
        ("NT", u(n)),
        ("BK", u(tile.bk)),
        ("KQ", u(tile.bk / 16)),
        ("XPR", u(tile.bk / 4)),
        ("XV", u(tile.bt * tile.bk / 4 / n)),
        ("WV", u(tile.bm * pw / n)),
        ("PW", u(pw)),
        ("VP", u(vp)),
        ("NS", u(tile.stages)),
        // (`check_overrides` refused an unparsable MAMBA2_COOP_PF before any device was
        // made: `GpuContext::new`.)
        ("PF", u(prefetch(format, kp).unwrap_or(1))),
    ];
    let mut flags = crate::gpu::weights::format_flags(format);
    flags.push(match output {
        GemmOutput::Store => "O_STORE",
        GemmOutput::Add => "O_ADD",
    });
    if vp == 8 {
        // Slices of eight f16 as stored (f16) or as dequantized (the block formats).
        flags.push("F16_PAIRS");
    }
    if scales_by_eight(format, kp) {
        flags.push("SC8");
    }
    if let Some(row) = spare {
        consts.push(("SPARE", u(row)));
        flags.push("DIRECT");
    }
    if let Some(g) = grouped {
        consts.extend([
            ("TR", u(g.rows)),
            ("E0", u(g.first)),
            ("NE", u(g.count)),
            ("NONE", Const::U32(u32::MAX)),
        ]);
        flags.push("GROUPED");
        if let Some(k) = g.top_k {
            consts.push(("K", u(k)));
            flags.push("GATHER");
        }
    }
    let sources = if block {
        super::coop_sources(COOP_BLOCK, EMULATED_BLOCK, emulate, &mut flags)
    } else {
        super::coop_sources(COOP, EMULATED, emulate, &mut flags)
    };
    (sources, consts, flags)
}

/// The GEMM of a block of up to `max_tokens` tokens on `tile`, with the real cooperative ops
/// or (`emulate`) their portable stand-ins; the accumulators go straight to Y where
/// `direct_fits` (then Y's rows past the block's tokens are scratch).
#[allow(clippy::too_many_arguments)]
pub fn gemm_coop(
    k: &Kernels,
    name: &str,
    w: &DeviceMatrix,
    max_tokens: usize,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    ys: usize,
    y0: usize,
    output: GemmOutput,
    ctrl: &wgpu::Buffer,
    tile: Tile,
    emulate: bool,
) -> Result<Dispatch> {
    check_takes(name, w)?;
    super::require_coop(k, name, emulate)?;
    let direct = direct_fits(w, max_tokens, y, ys, y0);
    tile.check(w.format, direct)?;
    let xs = w.cols.next_multiple_of(32);
    check_len(&format!("{name}: x"), x, max_tokens * xs)?;
    super::gemm::check_y(name, w.rows, max_tokens, y, ys, y0)?;
    let spare = direct.then(|| max_tokens.next_multiple_of(tile.bt));
    let (sources, consts, flags) = specialize(
        w.format,
        w.rows,
        w.kp,
        w.cols,
        ys,
        y0,
        w.out_scale,
        output,
        tile,
        spare,
        None,
        emulate,
    );
    let pipeline = k.pipeline("gemm_coop", sources, &consts, &flags, false)?;
    let mut entries = w.bindings();
    entries.extend([(2, x), (3, y), (4, ctrl)]);
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (
            w.rows.div_ceil(tile.bm) as u32,
            max_tokens.div_ceil(tile.bt) as u32,
            1,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Matmul,
        label: Label::gemm(w),
    }
    .per_token(1, tile.bt, 1))
}

/// The tile of a short block's split-K GEMM (`gemm_coop_split`): the block's 64 tokens ×
/// 128 rows of W over 8 subgroups in one stage of workgroup memory (23.5 KB). On the H200
/// (run 98, Codestral q8_0, a 32-token block) one stage beat two (38.9 KB): 16.6 against
/// 19.9 ms, in_proj 7.2 against 8.5 ms GPU: more workgroups fit an SM.
pub const SPLIT_TILE: Tile = Tile {
    bt: 64,
    bm: 128,
    wt: 2,
    wr: 4,
    stages: 1,
    bk: 32,
};

/// The split tile where the device's workgroup memory is too small for `SPLIT_TILE`:
/// 64 tokens × 64 rows over 4 subgroups in one stage (14.3 KB).
pub const SMALL_SPLIT_TILE: Tile = Tile {
    bt: 64,
    bm: 64,
    wt: 2,
    wr: 2,
    stages: 1,
    bk: 32,
};

const _: () = assert!(SPLIT_TILE.bt == super::gemm::TILE.1 && SMALL_SPLIT_TILE.bt == SPLIT_TILE.bt);

/// The tile of `gemm_coop_split` on this device: MAMBA2_SPLIT_TILE (for tuning;
/// `check_overrides` refused a tile the kernel cannot take), else `SPLIT_TILE` where it fits
/// the workgroup memory, else `SMALL_SPLIT_TILE`.
pub fn split_tile(k: &Kernels) -> Tile {
    let limit = k.ctx.device.limits().max_compute_workgroup_storage_size as usize;
    if let Some(t) = std::env::var("MAMBA2_SPLIT_TILE")
        .ok()
        .and_then(|s| parse_split_tile(&s).ok())
        .filter(|t| t.workgroup_bytes(false) <= limit)
    {
        return t;
    }
    if SPLIT_TILE.workgroup_bytes(false) <= limit {
        SPLIT_TILE
    } else {
        SMALL_SPLIT_TILE
    }
}

/// A MAMBA2_SPLIT_TILE value: a tile of at most 64 tokens (a divisor of 64) that the
/// kernel takes for f16 and q8_0 weights through workgroup memory.
fn parse_split_tile(s: &str) -> Result<Tile> {
    let bad = |why: String| Error::InvalidInput(format!("MAMBA2_SPLIT_TILE={s}: {why}"));
    let tile = Tile::parse(s)
        .ok_or_else(|| bad("want BTxBM/WTxWR[/STAGES[/BK]], e.g. 32x128/1x4".into()))?;
    if !SPLIT_TILE.bt.is_multiple_of(tile.bt) {
        return Err(bad(format!("want a token tile dividing {}", SPLIT_TILE.bt)));
    }
    for format in [WeightFormat::F16, WeightFormat::Q8_0] {
        tile.check(format, false)
            .map_err(|e| bad(format!("for {} weights: {e}", format.name())))?;
    }
    Ok(tile)
}

/// Workgroups the split aims for: MAMBA2_SPLIT_WG (for tuning), else SPLIT_TARGET.
fn split_target() -> usize {
    std::env::var("MAMBA2_SPLIT_WG")
        .ok()
        .and_then(|s| parse_split_target(&s).ok())
        .unwrap_or(SPLIT_TARGET)
}

/// A MAMBA2_SPLIT_WG value: a number of workgroups, at least 1.
fn parse_split_target(s: &str) -> Result<usize> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(Error::InvalidInput(format!(
            "MAMBA2_SPLIT_WG={s}: want a number of workgroups, at least 1"
        ))),
    }
}

/// Workgroups a split-K GEMM on the tensor cores aims for: enough 256-invocation
/// workgroups on each of an H200's 132 SMs to keep its weight loads in flight.
const SPLIT_TARGET: usize = 1024;

/// How many K slices `gemm_coop_split` takes for `w` on `tile` (1: none): enough for W's
/// row tiles to make ~SPLIT_TARGET workgroups (at most `gemm::MAX_SLICES`), each slice a
/// whole number of the kernel's K rounds (BK · PF columns; and of the 256 columns one load
/// of eight q8_0 scales covers). `SPLIT_TILE`, the tallest, takes the most.
pub fn split_slices(w: &DeviceMatrix, tile: Tile) -> usize {
    let tiles = w.rows.div_ceil(tile.bm).max(1) * (SPLIT_TILE.bt / tile.bt).max(1);
    let want = (split_target() / tiles).clamp(1, super::gemm::MAX_SLICES);
    let mut unit = tile.bk * prefetch(w.format, w.kp).unwrap_or(1);
    if scales_by_eight(w.format, w.kp) {
        unit = lcm(unit, 256);
    }
    (1..=want)
        .rev()
        .find(|&s| w.kp.is_multiple_of(s * unit))
        .unwrap_or(1)
}

fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

/// `specialize` for `gemm_coop_split`: partial sums of `rows` × `cols` weights of `format`
/// (padded to `kp`) over `slices` K slices on `tile`.
pub fn specialize_split(
    format: WeightFormat,
    rows: usize,
    kp: usize,
    cols: usize,
    tile: Tile,
    slices: usize,
    emulate: bool,
) -> (
    super::Sources,
    Vec<(&'static str, Const)>,
    Vec<&'static str>,
) {
    let (sources, mut consts, mut flags) = specialize(
        format,
        rows,
        kp,
        cols,
        rows,
        0,
        1.0,
        GemmOutput::Store,
        tile,
        None,
        None,
        emulate,
    );
    let u = |v: usize| Const::U32(v as u32);
    for (key, value) in consts.iter_mut() {
        if *key == "KLEN" {
            *value = u(kp / slices.max(1));
        }
    }
    // Each slice holds a whole short block of token rows, whatever the tile.
    consts.push(("PSL", u(SPLIT_TILE.bt * rows)));
    flags.push("SPLIT");
    (sources, consts, flags)
}

/// A short block's GEMM on the tensor cores (on `split_tile`) with its K loop split over
/// `slices` workgroup slices (`split_slices`): `part [slices][64][rows]` of partial sums, which
/// `gemm_reduce` then adds in slice order. For blocks of at most 64 tokens, where W's row
/// tiles alone would leave most of the GPU idle and the FMA split (`gemm::gemm_split`)
/// is bound by its multiplies (Codestral q8_0, 32 tokens: in_proj 37.8 ms, out_proj 13.7
/// over 64 layers, run 92).
#[allow(clippy::too_many_arguments)]
pub fn gemm_coop_split(
    k: &Kernels,
    name: &str,
    w: &DeviceMatrix,
    x: &wgpu::Buffer,
    part: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
    slices: usize,
    emulate: bool,
) -> Result<Dispatch> {
    check_takes(name, w)?;
    super::require_coop(k, name, emulate)?;
    let tile = split_tile(k);
    tile.check(w.format, false)?;
    // A short block: X rows and each slice's partials for its 64 tokens, whatever the tile.
    let t = SPLIT_TILE.bt;
    // Whole K rounds per slice: the kernel multiplies STEPS = KLEN / BK rounded up to PF
    // steps, and a step past the slice would add the next slice's columns.
    let round = tile.bk * prefetch(w.format, w.kp)?;
    let whole = |s: usize| w.kp.is_multiple_of(s) && (w.kp / s).is_multiple_of(round);
    if slices == 0 || (slices > 1 && !whole(slices)) {
        return Err(Error::Gpu(format!(
            "{name}: {slices} K slices of {} padded columns are not whole rounds of {round}",
            w.kp
        )));
    }
    let xs = w.cols.next_multiple_of(32);
    check_len(&format!("{name}: x"), x, t * xs)?;
    check_len(&format!("{name}: part"), part, slices * t * w.rows)?;
    let (sources, consts, flags) =
        specialize_split(w.format, w.rows, w.kp, w.cols, tile, slices, emulate);
    let pipeline = k.pipeline("gemm_coop", sources, &consts, &flags, false)?;
    let mut entries = w.bindings();
    entries.extend([(2, x), (3, part), (4, ctrl)]);
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (
            w.rows.div_ceil(tile.bm) as u32,
            SPLIT_TILE.bt.div_ceil(tile.bt) as u32,
            slices as u32,
        ),
        name: format!("{name} (split-K)"),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Matmul,
        label: Label::gemm(w),
    }
    .per_token(1, tile.bt, 1))
}

/// One bank's grouped GEMM over sorted rows on the tensor cores (or their stand-ins with
/// `emulate`): `gemm::expert_gemm`'s contract on `GROUPED_TILE` (rows unscaled), the
/// accumulators straight into Y where `direct_fits_rows` (Y's rows past the sorted ones are
/// then scratch).
#[allow(clippy::too_many_arguments)]
pub fn expert_gemm_coop(
    k: &Kernels,
    name: &str,
    w: &DeviceMatrix,
    bank: super::expert_gemv::Bank,
    sorted: super::gemm::SortedRows,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    ys: usize,
    y0: usize,
    emulate: bool,
) -> Result<Dispatch> {
    let tile = GROUPED_TILE;
    let m = bank.rows_per_expert;
    let rows = sorted.rows;
    check_takes(name, w)?;
    super::require_coop(k, name, emulate)?;
    if bank.count * m != w.rows || !rows.is_multiple_of(tile.bt) || y0 + m > ys {
        return Err(Error::Gpu(format!(
            "{name}: {} experts × {m} rows from {y0}, {rows} sorted rows and output rows of \
             {ys} do not fit {} ({} rows) in tiles of {}",
            bank.count, w.name, w.rows, tile.bt
        )));
    }
    // (Rows unscaled: `moe_combine` applies the bank's output scale.)
    let direct = direct_fits_rows(m, rows, y, ys, y0);
    tile.check(w.format, direct)?;
    let xs = w.cols.next_multiple_of(32);
    check_len(&format!("{name}: y"), y, (rows - 1) * ys + y0 + m)?;
    check_len(
        &format!("{name}: tile experts"),
        sorted.tile_expert,
        rows / tile.bt,
    )?;
    let mut entries = w.bindings();
    entries.extend([(2, x), (3, y), (5, sorted.tile_expert)]);
    let top_k = match sorted.gather {
        Some((pairs, top_k)) => {
            check_len(&format!("{name}: pairs"), pairs, rows)?;
            check_len(&format!("{name}: x"), x, xs)?;
            entries.push((6, pairs));
            Some(top_k)
        }
        None => {
            check_len(&format!("{name}: x"), x, rows * xs)?;
            None
        }
    };
    let grouped = Grouped {
        rows,
        first: bank.first,
        count: bank.count,
        top_k,
    };
    let (sources, consts, flags) = specialize(
        w.format,
        m,
        w.kp,
        w.cols,
        ys,
        y0,
        1.0,
        GemmOutput::Store,
        tile,
        direct.then_some(rows),
        Some(grouped),
        emulate,
    );
    let pipeline = k.pipeline("gemm_coop", sources, &consts, &flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (m.div_ceil(tile.bm) as u32, (rows / tile.bt) as u32, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Moe,
        label: Label::default(),
    })
}

/// The load-time check of the real cooperative ops on this device: one small random GEMM
/// (f16 weights, row and token counts no tile divides, added onto a residual) on every tile
/// the engine may pick, through workgroup memory and straight into Y, against the CPU's sum
/// of the same f16-rounded products, then `q8_check` (`emulate`: on the stand-ins,
/// for the tests). An error says what differed.
pub fn self_check(k: &Kernels, emulate: bool) -> Result<()> {
    use half::f16;
    let (m, kc, t) = (208, 96, 150);
    let rnd = |seed: u64, n: usize| super::check_values(seed, n, -1.0, 1.0);
    let round =
        |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|a| f16::from_f32(a).to_f32()).collect() };
    let (wv, xv, rv) = (round(rnd(1, m * kc)), round(rnd(2, t * kc)), rnd(3, t * m));
    let packed = crate::model::quant::pack(WeightFormat::F16, &wv, m, kc);
    let ctx = &k.ctx;
    let w = DeviceMatrix::upload(ctx, "coop check: w", &packed)?;
    let x = ctx.storage_with("coop check: x", bytemuck::cast_slice(&xv))?;
    // Y exactly as long as the block (the epilogue through workgroup memory), and with the
    // rows the direct epilogue needs.
    let y = ctx.storage_with("coop check: y", bytemuck::cast_slice(&rv))?;
    let y_direct = ctx.storage_zeroed("coop check: y", 4 * (y_rows(t) * m) as u64)?;
    let ctrl = super::check_ctrl(ctx, "coop check: ctrl", t)?;
    // Every tile the engine may pick (and the one MAMBA2_COOP_TILE names), in turn.
    let mut tiles = TILES.to_vec();
    for direct in [false, true] {
        let chosen = tile_for(k, &w, t, direct)?;
        if !tiles.contains(&chosen) {
            tiles.push(chosen);
        }
    }
    let mut runs: Vec<(Tile, &wgpu::Buffer)> = Vec::new();
    for &tile in &tiles {
        for yb in [&y, &y_direct] {
            if tile
                .check(WeightFormat::F16, direct_fits(&w, t, yb, m, 0))
                .is_ok()
            {
                runs.push((tile, yb));
            }
        }
    }
    // The CPU's result, once for all tiles.
    let want: Vec<f64> = (0..t * m)
        .map(|e| {
            let (r, row) = (e / m, e % m);
            let dot: f64 = (0..kc)
                .map(|i| wv[row * kc + i] as f64 * xv[r * kc + i] as f64)
                .sum();
            rv[e] as f64 + dot
        })
        .collect();
    let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
    let mut worst = (0f64, 0usize);
    let mut bad_tile = tiles[0];
    for (tile, y) in runs {
        ctx.queue.write_buffer(y, 0, bytemuck::cast_slice(&rv));
        let d = gemm_coop(
            k,
            "coop check",
            &w,
            t,
            &x,
            y,
            m,
            0,
            GemmOutput::Add,
            &ctrl,
            tile,
            emulate,
        )?;
        d.run_now(ctx, Some(t as u32))?;
        let got = ctx.read_f32(y, t * m)?;
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let e = (g as f64 - w).abs();
            // (A NaN counts as the worst.)
            if e.is_nan() || e > worst.0 {
                worst = (e, i);
                bad_tile = tile;
            }
        }
    }
    // f16 products are exact in f32: only the order of the f32 sums differs.
    if !worst.0.is_nan() && worst.0 <= 1e-4 * scale {
        q8_check(k, emulate)
    } else {
        Err(Error::Gpu(format!(
            "a {t}×{kc}·{kc}×{m} GEMM on tile {bad_tile} is off by {:.3e} at token {}, row {} \
             (largest value {scale:.3})",
            worst.0,
            worst.1 / m,
            worst.1 % m
        )))
    }
}

/// The rest of the load-time check: q8_0 weights whose scales load eight at a time
/// (K = 256), on the tile the engine picks, straight into Y; then a short block's split-K
/// GEMM (K = 1024 in slices, `gemm_coop_split` and `gemm_reduce`); then q4_k weights (the
/// block formats' dequantizing loads, K = 512, unless MAMBA2_COOP_BLOCKS=0 leaves those to
/// the FMA tiles): each against the CPU's sum of the same f16 products.
fn q8_check(k: &Kernels, emulate: bool) -> Result<()> {
    q8_case(k, emulate, WeightFormat::Q8_0, 256, 150, false)?;
    q8_case(k, emulate, WeightFormat::Q8_0, 1024, 40, true)?;
    if blocks_on() {
        q8_case(k, emulate, WeightFormat::Q4_K, 512, 150, false)?;
    }
    Ok(())
}

/// One check of `t` tokens × `kc` columns of quantized weights in `format` (`split`: the
/// short-block split-K path).
fn q8_case(
    k: &Kernels,
    emulate: bool,
    format: WeightFormat,
    kc: usize,
    t: usize,
    split: bool,
) -> Result<()> {
    use half::f16;
    let m = 208;
    let rnd = |seed: u64, n: usize| super::check_values(seed, n, -1.0, 1.0);
    let packed = crate::model::quant::pack(format, &rnd(4, m * kc), m, kc);
    // The values the kernel multiplies: the dequantized weights rounded to f16 (q8_0: q·d
    // in f16 arithmetic, the same value), and X as f16.
    let wv: Vec<f32> = crate::model::quant::unpack(&packed)
        .into_iter()
        .map(|v| f16::from_f32(v).to_f32())
        .collect();
    let xh: Vec<f16> = rnd(5, t * kc).into_iter().map(f16::from_f32).collect();
    let ctx = &k.ctx;
    let w = DeviceMatrix::upload(ctx, "coop check: q8 w", &packed)?;
    let xf: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
    // At least a short block's 64 token rows (what the split reads; zeros past t).
    let x = ctx.storage_zeroed("coop check: q8 x", 4 * (t.max(SPLIT_TILE.bt) * kc) as u64)?;
    ctx.queue.write_buffer(&x, 0, bytemuck::cast_slice(&xf));
    let y = ctx.storage_zeroed("coop check: q8 y", 4 * (y_rows(t) * m) as u64)?;
    let ctrl = super::check_ctrl(ctx, "coop check: ctrl", t)?;
    let what;
    if split {
        let tile = split_tile(k);
        let slices = split_slices(&w, tile);
        what = format!("split into {slices} K slices on tile {tile}");
        // The partials as a short block's buffer holds them: 64 token rows per slice.
        let part =
            ctx.storage_zeroed("coop check: part", 4 * (slices * SPLIT_TILE.bt * m) as u64)?;
        let d = gemm_coop_split(k, "coop check split", &w, &x, &part, &ctrl, slices, emulate)?;
        d.run_now(ctx, Some(t as u32))?;
        let r = super::gemm_reduce::gemm_reduce(
            k,
            "coop check reduce",
            m,
            slices,
            (SPLIT_TILE.bt, SPLIT_TILE.bt),
            &part,
            &y,
            m,
            0,
            1.0,
            GemmOutput::Store,
            &ctrl,
        )?;
        r.run_now(ctx, Some(t as u32))?;
    } else {
        let tile = tile_for(k, &w, t, direct_fits(&w, t, &y, m, 0))?;
        what = format!("on tile {tile}");
        let d = gemm_coop(
            k,
            "coop check q8",
            &w,
            t,
            &x,
            &y,
            m,
            0,
            GemmOutput::Store,
            &ctrl,
            tile,
            emulate,
        )?;
        d.run_now(ctx, Some(t as u32))?;
    }
    let got = ctx.read_f32(&y, t * m)?;
    let mut worst = (0f64, 0usize, 0f64);
    for (e, &g) in got.iter().enumerate() {
        let (r, row) = (e / m, e % m);
        let want: f64 = (0..kc)
            .map(|i| wv[row * kc + i] as f64 * xh[r * kc + i].to_f64())
            .sum();
        worst.2 = worst.2.max(want.abs());
        let err = (g as f64 - want).abs();
        if err.is_nan() || err > worst.0 {
            worst = (err, e, worst.2);
        }
    }
    if !worst.0.is_nan() && worst.0 <= 1e-4 * worst.2 {
        Ok(())
    } else {
        Err(Error::Gpu(format!(
            "a {} {t}×{kc}·{kc}×{m} GEMM {what} is off by {:.3e} at token {}, row {}",
            format.name(),
            worst.0,
            worst.1 / m,
            worst.1 % m
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_overrides_name_the_variable() {
        assert_eq!(parse_split_tile("64x128/2x4/1").unwrap(), SPLIT_TILE);
        assert_eq!(parse_split_target(" 2048 ").unwrap(), 2048);
        // Token tiles that do not divide a short block, and tiles the kernel cannot take.
        for bad in ["48x128/1x4", "128x128/4x2", "64x128", "64x128/2x4/2/16"] {
            let e = parse_split_tile(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("MAMBA2_SPLIT_TILE={bad}")), "{e}");
        }
        for bad in ["0", "-1", "many", ""] {
            let e = parse_split_target(bad).unwrap_err().to_string();
            assert!(e.contains("MAMBA2_SPLIT_WG"), "{e}");
        }
        assert!(!parse_blocks("0").unwrap() && parse_blocks("1").unwrap());
        for bad in ["off", "", " 0"] {
            let e = parse_blocks(bad).unwrap_err().to_string();
            assert!(e.contains("MAMBA2_COOP_BLOCKS"), "{e}");
        }
        assert_eq!(parse_prefetch(" 3 ").unwrap(), 3);
        for bad in ["0", "5", "two", ""] {
            let e = parse_prefetch(bad).unwrap_err().to_string();
            assert!(e.contains("MAMBA2_COOP_PF"), "{e}");
        }
        assert_eq!(parse_forced_tile("128x256/4x4/1").unwrap(), TILES[0]);
        let e = parse_forced_tile("128x256").unwrap_err().to_string();
        assert!(e.contains("MAMBA2_COOP_TILE=128x256"), "{e}");
        // A K step of 16 leaves q8_0's 256 rows half a slice per invocation.
        let e = parse_forced_tile("128x256/4x4/2/16")
            .unwrap_err()
            .to_string();
        assert!(e.contains("MAMBA2_COOP_TILE") && e.contains("q8_0"), "{e}");
    }
}
