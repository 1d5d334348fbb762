//! `gemv.wgsl`: `y = W·x` for one token over a `DeviceMatrix` `[M, K]`, with the gated
//! group norm folded into its input (`Group`) and the epilogues the decode graph needs
//! (residual add, conv + dt). Shapes: f32 input `src [KP]` (zero past K) for f32/f16/bf16
//! weights, q8 blocks `xq [KP/4]`, `xd [KP/32]` for the quantized formats (q8_0, q4_0,
//! q4_k, q5_k, q6_k: integer dot products of their quants with the q8 values); `dst [M]`;
//! `part [G·blocks_per_group]` per-block Σv². Over `lanes` lanes (batched decode) each
//! buffer holds the lanes' rows side by side (strides from the buffer sizes; the inputs'
//! a multiple of 256 values) and one dispatch reads each weight once for up to
//! `MAX_LANES` of them.

use super::{Dispatch, Kernels, Label, Section, check_len, finite, grid};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;
use crate::model::quant::WeightFormat;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/mixer_row.wgsl"),
    include_str!("../../../shaders/block_quant.wgsl"),
    include_str!("../../../shaders/gemv_bindings.wgsl"),
    include_str!("../../../shaders/q8_dot.wgsl"),
    include_str!("../../../shaders/gemv_units.wgsl"),
    include_str!("../../../shaders/gemv.wgsl"),
];

/// The one-token kernel with the block's pre-norm in its prologue (`GemvInput::Norm`).
const NORM_SOURCES: super::Sources = &[
    include_str!("../../../shaders/mixer_row.wgsl"),
    include_str!("../../../shaders/block_quant.wgsl"),
    include_str!("../../../shaders/norm_sum.wgsl"),
    include_str!("../../../shaders/gemv_bindings.wgsl"),
    include_str!("../../../shaders/q8_dot.wgsl"),
    include_str!("../../../shaders/gemv_units.wgsl"),
    include_str!("../../../shaders/gemv.wgsl"),
];

/// The batch's kernel: the same team, stride and per-lane expressions as `gemv.wgsl` (so a
/// lane's sum is bitwise the one-token kernel's), the weights read once for NL lanes. The
/// one-token kernel stays separate: the lane arrays cost it 7% on the H200 (Codestral q8_0
/// 4.32 → 4.66 ms/token).
const LANE_SOURCES: super::Sources = &[
    include_str!("../../../shaders/mixer_row.wgsl"),
    include_str!("../../../shaders/block_quant.wgsl"),
    include_str!("../../../shaders/gemv_bindings.wgsl"),
    include_str!("../../../shaders/q8_dot.wgsl"),
    include_str!("../../../shaders/gemv_lanes.wgsl"),
];

/// Threads per workgroup.
pub const WG: u32 = 256;

/// The most lanes one workgroup of the batch kernel sums at once (more lanes take more
/// workgroup rows of z, each reading the weights again).
pub const MAX_LANES: usize = 16;

/// The lanes one workgroup of the batch kernel sums, and the rows each of its teams owns,
/// for `lanes` lanes of a matrix of `rows` rows in `format` (the same with and without the
/// group-norm prologue, which runs once per lane in every workgroup).
/// Measured on the H200 (Codestral q8_0, 16 lanes, run 61, GPU ms per step for in_proj /
/// out_proj): 16 lanes × 2 rows per team 7.95 / 3.84 (kept), 16 × 1 8.52 / 6.50, 16 × 4
/// 11.02 / 6.43 (registers), 8 × 2 8.01 / 4.49, 8 × 4 8.33 / 4.92, 4 × 4 8.93 / 3.86,
/// 4 × 8 8.93 / 4.06; the old out_proj choice, 8 × 8, 5.76. The block formats decode their
/// weights per row and keep one.
/// Since the totals go out from all of a team's lanes at once (run 123), q8_0 matrices of
/// `WIDE` columns or more at 16 lanes or more take other tiles (`BatchRole`): in_proj (the
/// mixer epilogue) 8 lanes × 4 rows, so each activation load serves four rows and the
/// weights are read once per 8 lanes (run 125, ms per step at 4 / 16 / 64 lanes with 8 × 4
/// for every plain-input GEMV: Codestral 4.745 → 4.863 / 11.060 → 10.626 / 41.58 → 37.74,
/// in_proj 5.70 → 5.36 and 20.56 → 17.15 GPU ms; mamba2-2.7b 2.634 → 2.673 / 6.624 →
/// 5.826 / 22.40 → 18.78; mamba2-130m (768 columns) 0.585 → 0.602 / 0.822 → 0.869 / 1.828
/// → 2.011, and the lm_heads no better); out_proj (the group-norm input) 4 × 4 (run 127,
/// GPU ms at 16 / 64 lanes against 16 × 2: Codestral 3.42 → 3.25 / 10.91 → 9.90, 2.7b
/// 2.26 → 2.09 / 6.61 → 5.37; 4 × 8, 8 × 2, 2 × 8 and 8 × 8 measured too).
/// Once a team's totals are summed by one reduce-scatter (run 136, every GEMV forced to one
/// tile, Codestral GPU ms per step of in_proj / out_proj at 16 and 64 lanes): 8 × 4 4.94 /
/// 3.26 and 12.89 / 9.86; 4 × 8 4.41 / 2.67 and 13.88 / 7.29; 4 × 4 4.84 / 2.70 and 14.91 /
/// 7.83; 16 × 2 5.46 / 2.94 and 17.94 / 9.55; 8 × 8 5.54 / 3.68; 16 × 4 7.09 / 3.68. So
/// an activation-bound GEMV of `SPREAD` columns or more takes 4 × 8 at 16 lanes (four lane
/// groups side by side), 8 × 4 past them and below `SPREAD`; out_proj 4 × 8.
/// q8_0 teams of 16 lanes or fewer (the in_proj's, `gemv_team`) at `FEW_LANES` lanes or
/// fewer own one row each (run 162, every GEMV forced to one row against two, ms per step
/// at 2 / 4 / 8 lanes: mamba2-2.7b 2.305 / 2.874 / 3.726 → 2.113 / 2.636 / 4.346, its
/// in_proj 1.289 → 1.201 and 1.596 → 1.454 GPU ms at 2 and 4; mamba2-130m's in_proj 0.256
/// → 0.246 and 0.301 → 0.285; but the teams of 32 of Codestral's and Nemotron-H-8B's in_proj
/// lost: 2.726 → 3.219 and 0.973 → 1.190 at 4 lanes).
/// `MAMBA2_BATCH_LANES` and `MAMBA2_BATCH_ROWS` override both (for tuning: the results
/// are bitwise the same whatever they are).
pub fn lane_tiling(
    lanes: usize,
    groups: usize,
    rows: usize,
    format: WeightFormat,
    role: BatchRole,
    team: u32,
) -> (usize, usize) {
    let simple = matches!(
        format,
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 | WeightFormat::Q8_0
    );
    let (nl, rt) = match role {
        _ if format == WeightFormat::Q8_0 && lanes <= FEW_LANES && team <= 16 => (MAX_LANES, 1),
        _ if format != WeightFormat::Q8_0 || lanes < MAX_LANES => (MAX_LANES, 2),
        BatchRole::ActivationBound { spread: true } if lanes <= MAX_LANES => (4, 8),
        BatchRole::ActivationBound { .. } => (8, 4),
        BatchRole::WideGroupNorm => (4, 8),
        BatchRole::Other => (MAX_LANES, 2),
    };
    let nl = tile_override(BATCH_LANES).unwrap_or(nl).clamp(1, 64);
    let rt = if simple {
        tile_override(BATCH_ROWS).unwrap_or(rt).clamp(1, 16)
    } else {
        1
    };
    // Every lane's group rstd sits in workgroup memory: at most 2048 values.
    let nl = lanes.clamp(1, nl).min((2048 / groups.max(1)).max(1));
    (nl, rt.min(rows.max(1)))
}

/// The variables that force a batched GEMV's lanes and rows per tile (for tuning).
const BATCH_LANES: &str = "MAMBA2_BATCH_LANES";
const BATCH_ROWS: &str = "MAMBA2_BATCH_ROWS";

/// A batched GEMV's tile size forced by `name` (`BATCH_LANES`, `BATCH_ROWS`): what
/// `lane_tiling` takes.
fn tile_override(name: &str) -> Option<usize> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
}

/// Whether either tile size is forced, which keeps `spread_small` off.
fn tiles_forced() -> bool {
    [BATCH_LANES, BATCH_ROWS]
        .iter()
        .any(|v| tile_override(v).is_some())
}

/// Workgroups below which a batched GEMV of a small f32 matrix (`SMALL_F32`: the MoE
/// routers) shrinks its tiles (`spread_small`), unless `MAMBA2_BATCH_LANES` or
/// `MAMBA2_BATCH_ROWS` force them; the quantized formats' small matrices keep the tiles
/// runs 105–110 measured for them, and big f32 matrices `lane_tiling`'s. An MoE router
/// (64–128 rows of f32, teams of 128–256 lanes: `small_f32_team`) in 16-lane tiles of two
/// rows per team made grids of 16–64 workgroups. Measured on an H100 (run 227, 16 lanes,
/// GPU ms per step of the routers, every GEMV's tiles forced; workgroups in brackets):
/// Nemotron 3 Nano's 0.487 (64) → 0.277 with 4 lanes × 1 row (512), 0.296 with 2 × 1
/// (1024), 0.303 with 1 × 1 (2048); Granite-4.0-H-Tiny's 0.703 (16) → 0.449 with 4 × 1
/// (128), 0.438 with 2 × 1 (256), 0.420 with 1 × 1 (512). A limit of 64 (run 228) left
/// Nano's as they were and gave Granite's 8 × 1 (64): 0.50.
pub const FEW_WORKGROUPS: usize = 512;

/// `(nl, rt)` shrunk for a matrix of `rows` rows whose grid of `lanes` lanes would be under
/// `FEW_WORKGROUPS` workgroups: one row per team, then half the lanes per workgroup, until
/// it is not (or one lane each).
fn spread_small(lanes: usize, rows: usize, team: u32, nl: usize, rt: usize) -> (usize, usize) {
    let teams = (WG / team.max(1)).max(1) as usize;
    let grid = |nl: usize, rt: usize| rows.div_ceil(teams * rt) * lanes.div_ceil(nl.max(1));
    if grid(nl, rt) >= FEW_WORKGROUPS {
        return (nl, rt);
    }
    let mut nl = nl;
    while nl > 1 && grid(nl, 1) < FEW_WORKGROUPS {
        nl /= 2;
    }
    (nl, 1)
}

/// Lanes up to which a q8_0 GEMV of narrow teams takes one row per team (`lane_tiling`).
pub const FEW_LANES: usize = 4;

/// Columns from which a batch's q8_0 in_proj and out_proj take their own tiles
/// (`lane_tiling`).
pub const WIDE: usize = 2048;

/// Columns from which any batched q8_0 GEMV with a plain input takes in_proj's tiles: 16
/// lanes' q8 inputs then fill 256 KiB, an H200 multiprocessor's L1, and 8 lanes halve that.
/// Measured on the H200 (run 130, 8 × 4 for every plain-input GEMV of 2048 columns or
/// more, GPU ms per step at 16 / 64 lanes): Nemotron-H 8B's MLP down_proj (21504 columns)
/// 3.23 → 2.74 / 10.36 → 8.30, while its up_proj (4096 columns) 1.85 → 2.04 / 6.11 →
/// 6.25, qkv 0.174 → 0.201 and o_proj 0.149 → 0.163 lost, and the lm_heads did not move.
pub const VERY_WIDE: usize = 16384;

/// Columns from which an `ActivationBound` GEMV at 16 lanes takes 4 lanes × 8 rows (four
/// lane groups side by side) rather than 8 × 4. Measured on the H200 (runs 136–137, GPU ms
/// per 16-lane step): Codestral's in_proj (4096 columns) 4.94 → 4.46, Nemotron-H 8B's
/// in_proj (4096) 1.83 → 1.64 and MLP down_proj (21504) 2.25 → 1.71, but mamba2-2.7b's
/// in_proj (2560) 2.38 → 2.51.
pub const SPREAD: usize = 4096;
const _: () = assert!(VERY_WIDE >= SPREAD);

/// What a batched GEMV's matrix is, for its tiles (`lane_tiling`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchRole {
    /// Bound by its activation loads, so fewer lanes and more rows per team pay: a Mamba2
    /// in_proj (the mixer epilogue) of `WIDE` columns or more, or any plain-input GEMV of
    /// `VERY_WIDE` columns or more (an MLP's down_proj).
    /// `spread`: `SPREAD` columns or more, whose 16 lanes go in four groups of 4.
    ActivationBound {
        spread: bool,
    },
    /// An out_proj (the gated group norm in its prologue) of `WIDE` columns or more.
    WideGroupNorm,
    Other,
}

impl BatchRole {
    pub fn of(cols: usize, input: GemvInput, output: GemvOutput) -> Self {
        match (input, output) {
            _ if cols < WIDE => BatchRole::Other,
            (GemvInput::Group { .. }, _) => BatchRole::WideGroupNorm,
            (_, GemvOutput::Mixer(_)) => BatchRole::ActivationBound {
                spread: cols >= SPREAD,
            },
            _ if cols >= VERY_WIDE => BatchRole::ActivationBound { spread: true },
            _ => BatchRole::Other,
        }
    }
}

/// Whether a batched GEMV's `lane_groups` workgroups of one row group run side by side
/// (lane group fastest, `LANES_SIDE`) rather than each lane group sweeping the whole matrix
/// in turn: with three lane groups or more, or a matrix of `SIDE_BYTES` or more, which no
/// GPU's L2 holds between two sweeps. Measured on the H200 (run 132, every batched GEMV
/// side by side against none, GPU ms per step): at 64 lanes Codestral in_proj 17.07 →
/// 13.92 (the step 35.88 → 32.83 ms), Nemotron-H 8B down_proj 8.31 → 5.75 (30.44 → 26.69),
/// mamba2-2.7b out_proj 5.41 → 4.93; at 16 lanes Codestral out_proj (4 lane groups) 3.29 →
/// 3.05, Nemotron-H 8B down_proj (93 MB, 2 lane groups) 2.73 → 2.43, but mamba2-2.7b's
/// 29 MB in_proj (2 lane groups, which L2 serves the second sweep of anyway) 2.52 → 2.81.
pub fn side_by_side(lane_groups: usize, bytes: u64) -> bool {
    lane_groups >= 3 || (lane_groups >= 2 && bytes >= SIDE_BYTES)
}

/// Matrix bytes from which two lane groups run side by side (`side_by_side`).
pub const SIDE_BYTES: u64 = 64 << 20;

/// Lanes each invocation of the staged batch kernel sums.
const STAGE_LANES_PER_THREAD: usize = 4;

/// The most bytes of q8_0 quants (and their f32 scales) the staged batch kernel keeps in
/// workgroup memory for its rows (less where the device's limit leaves less).
const STAGE_BYTES: usize = 9 * 1024;

/// Where the staged kernel takes over: plain inputs whose register kernel launches fewer
/// than this many workgroups per group of NL lanes (its x extent).
const STAGE_PLAIN_BELOW: usize = 1024;

/// … and group-norm inputs whose register kernel launches fewer than this many in all:
/// every staged workgroup repeats the norm prologue for its NL lanes.
const STAGE_GROUP_BELOW: usize = 128;

/// How a batch GEMV's register kernel would be laid out: its workgroups along the rows
/// (per group of NL lanes) and along the lanes, and whether it runs the group norm first.
#[derive(Clone, Copy, Debug)]
pub struct RegisterGrid {
    pub rows: usize,
    pub lanes: usize,
    pub grouped: bool,
}

/// The staged batch kernel's rows per workgroup and lanes per invocation, or none (the
/// register kernel). Measured on the H200 (runs 108–109, q8_0, GPU ms per step of the
/// register → the staged kernel at 16 and 64 lanes):
///
/// | matrix | register workgroups, 16 lanes | 16 lanes | 64 lanes |
/// |---|---|---|---|
/// | 130m in_proj | 105 | 0.774 → 0.398 | 1.003 → 0.779 |
/// | 130m out_proj (group norm) | 48 | 0.705 → 0.491 | 0.843 → 1.021 |
/// | 2.7b in_proj | 661 | 4.396 → 3.716 | 12.17 → 11.36 |
/// | 2.7b out_proj (group norm) | 320 | 3.088 → 5.481 | 8.31 → 18.54 |
/// | Codestral in_proj | 2320 | 8.01 → 8.24 | 26.54 → 30.67 |
/// | Codestral out_proj (group norm) | 512 | 3.97 → 8.69 | |
///
/// So q8_0 rows that fit `budget` bytes (at most `STAGE_BYTES`) are staged where the
/// register kernel leaves the GPU short of workgroups: plain inputs below
/// `STAGE_PLAIN_BELOW` per lane group, group-norm ones below `STAGE_GROUP_BELOW` in all.
/// MAMBA2_BATCH_STAGE=0 never stages, =1 stages wherever the rows fit (for measuring).
pub fn staging(
    format: WeightFormat,
    team: u32,
    nl: usize,
    kp: usize,
    grid: RegisterGrid,
    budget: usize,
) -> Result<Option<(usize, usize)>> {
    let always = match stage_override()? {
        None => false,
        Some(true) => true,
        Some(false) => return Ok(None),
    };
    let short = if grid.grouped {
        grid.rows * grid.lanes < STAGE_GROUP_BELOW
    } else {
        grid.rows < STAGE_PLAIN_BELOW
    };
    if format != WeightFormat::Q8_0 || !(always || short) {
        return Ok(None);
    }
    let lpt = STAGE_LANES_PER_THREAD.min(nl);
    let groups = nl.div_ceil(lpt);
    let rr = WG as usize / (team as usize * groups).max(1);
    let row_bytes = kp + kp / 32 * 4;
    Ok((rr >= 1 && rr * row_bytes <= budget.min(STAGE_BYTES)).then_some((rr, lpt)))
}

/// MAMBA2_BATCH_STAGE: 0 (never stage rows), 1 (wherever they fit), or unset (`staging`
/// chooses).
fn stage_override() -> Result<Option<bool>> {
    match std::env::var("MAMBA2_BATCH_STAGE").as_deref() {
        Err(_) => Ok(None),
        Ok("1") => Ok(Some(true)),
        Ok("0") => Ok(Some(false)),
        Ok(s) => Err(Error::InvalidInput(format!(
            "MAMBA2_BATCH_STAGE={s}: want 0 (never stage rows) or 1 (wherever they fit)"
        ))),
    }
}

/// What the GEMV's input vector is.
#[derive(Clone, Copy, Debug)]
pub enum GemvInput {
    /// `x` as the producer wrote it.
    Plain,
    /// `x_k · rstd[g(k)]` with `rstd[g] = 1/sqrt(Σ part[g·bpg ..] / group_size + eps)`: the
    /// gated group norm, whose `⊙ w` and Σv² the SSD step already applied and computed.
    Group {
        groups: usize,
        group_size: usize,
        blocks_per_group: usize,
        eps: f64,
    },
    /// `x = src / rms(src) ⊙ params[nw_off..nw_off + d]`: the block's RMS pre-norm in the
    /// prologue (one token), so the norm's own dispatch goes. Every workgroup, of `wg`
    /// invocations as the norm kernel's (`rmsnorm::rmsnorm`), sums all of src² that
    /// kernel's way (`norm_rstd`: the same rstd bit for bit). f32 matrices (the MoE
    /// router): the first workgroups also write what that kernel would
    /// (`GemvBuffers::norm_out`) for the GEMVs after this one. Quantized ones (a narrow
    /// Mamba2 in_proj or attention qkv projection, `folds_norm`): every workgroup makes the
    /// q8 blocks of the whole normed vector in its own memory, the norm kernel's bits, and
    /// writes no vector.
    Norm {
        d: usize,
        eps: f64,
        nw_off: usize,
        wg: usize,
    },
}

/// What happens to each output row.
#[derive(Clone, Copy, Debug)]
pub enum GemvOutput {
    Store,
    Add,
    /// The mixer epilogue (`mixer_row.wgsl`): z stored, conv + silu on xBC rows, softplus
    /// on dt rows.
    Mixer(MixerConsts),
}

/// Sizes and parameter offsets the mixer epilogue and the conv step need.
#[derive(Clone, Copy, Debug)]
pub struct MixerConsts {
    pub d_inner: usize,
    pub conv_dim: usize,
    pub heads: usize,
    pub kernel: usize,
    pub cw_off: usize,
    pub cb_off: usize,
    pub dtb_off: usize,
    pub dt_limit: (f64, f64),
}

impl MixerConsts {
    pub fn consts(&self) -> Vec<(&'static str, Const)> {
        let u = |v: usize| Const::U32(v as u32);
        vec![
            ("DI", u(self.d_inner)),
            ("CD", u(self.conv_dim)),
            ("H", u(self.heads)),
            ("KC", u(self.kernel)),
            ("CW_OFF", u(self.cw_off)),
            ("CB_OFF", u(self.cb_off)),
            ("DTB_OFF", u(self.dtb_off)),
            ("DT_MIN", finite(self.dt_limit.0)),
            ("DT_MAX", finite(self.dt_limit.1)),
        ]
    }
}

/// The buffers a GEMV reads and writes besides the matrix.
pub struct GemvBuffers<'a> {
    /// f32 input, KP values (f32 and f16 matrices).
    pub src: &'a wgpu::Buffer,
    /// q8 input blocks `(xq, xd)` (q8_0 matrices).
    pub q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
    pub dst: &'a wgpu::Buffer,
    /// Where `W`'s row 0 goes in each lane's `dst` (`Store` and `Add`; 0 but for a part of
    /// a stacked projection whose parts are stored in different formats: attention's q/k/v,
    /// `DeviceMixer::Attention`).
    pub dst_row0: usize,
    pub part: Option<&'a wgpu::Buffer>,
    /// Mixer epilogue: the layer's parameters, conv state and the control block.
    pub params: Option<&'a wgpu::Buffer>,
    pub conv_state: Option<&'a wgpu::Buffer>,
    pub ctrl: Option<&'a wgpu::Buffer>,
    /// Lanes side by side in every buffer (`Lanes::ONE`: one token).
    pub lanes: super::Lanes,
    /// `GemvInput::Norm`: where the normed vector (and its q8 blocks) go.
    pub norm_out: Option<NormOut<'a>>,
    /// One-token `Store` (the greedy lm_head): each workgroup's best row for the argmax,
    /// 4 u32 per workgroup of the dispatch's grid (its `workgroups`, spare ones included).
    pub argmax_part: Option<&'a wgpu::Buffer>,
    /// One-token `Store` of a NoPE attention layer's `[q | k | v]`: the k and v rows also go
    /// to the KV caches (the K/V store dispatch then goes).
    pub kv: Option<KvOut<'a>>,
}

/// Where a one-token qkv GEMV stores its k and v rows besides `dst`: cache row
/// `ctrl.kv_len` of `k_cache` and `v_cache` (`[ctx][kv_rows]`, f32 or f16 two per u32, as
/// `kv_store` writes them; nothing for a stopped step or a full cache). `[q | k | v]`: the
/// k rows start at `q_rows`, the v rows `kv_rows` later.
#[derive(Clone, Copy)]
pub struct KvOut<'a> {
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    pub ctrl: &'a wgpu::Buffer,
    pub q_rows: usize,
    pub kv_rows: usize,
    pub ctx: usize,
    pub f32: bool,
}

/// Whether a one-token GEMV of `w` (a qkv projection, its input plain or, `norm_wg`, the
/// pre-norm folded into its prologue with workgroups of that size) can store the k and v
/// rows itself (`GemvBuffers::kv`; `kv_fits` with its workgroups' rows).
pub fn stores_kv(
    k: &Kernels,
    w: &DeviceMatrix,
    q_rows: usize,
    kv_rows: usize,
    f32: bool,
    norm_wg: Option<usize>,
) -> Result<bool> {
    let team = gemv_team(w, false)?;
    let wg = match norm_wg {
        Some(wg) => wg as u32,
        None => one_token_wg(k, WgKind::Plain)?.max(team),
    };
    Ok(kv_fits(w.rows, (wg / team) as usize, q_rows, kv_rows, f32))
}

/// Whether a GEMV of `rows` rows, `rows_per_wg` a workgroup, holds the k and v rows of
/// `[q | k | v]` and, for an f16 cache (a word holds two rows), puts every row pair in one
/// workgroup.
fn kv_fits(rows: usize, rows_per_wg: usize, q_rows: usize, kv_rows: usize, f32: bool) -> bool {
    let pairs =
        rows_per_wg.is_multiple_of(2) && q_rows.is_multiple_of(2) && kv_rows.is_multiple_of(2);
    q_rows + 2 * kv_rows <= rows && (f32 || pairs)
}

/// The pre-norm's output a `GemvInput::Norm` GEMV writes besides its rows: `h [KP]` (zero
/// past d, as it was) and optionally its q8 blocks.
#[derive(Clone, Copy)]
pub struct NormOut<'a> {
    pub h: &'a wgpu::Buffer,
    pub q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
}

impl<'a> GemvBuffers<'a> {
    /// A plain product `dst = W·src` (or the q8 blocks of src): no epilogue buffers.
    pub fn plain(
        src: &'a wgpu::Buffer,
        q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
        dst: &'a wgpu::Buffer,
    ) -> Self {
        GemvBuffers {
            src,
            q8,
            dst,
            dst_row0: 0,
            part: None,
            params: None,
            conv_state: None,
            ctrl: None,
            lanes: super::Lanes::ONE,
            norm_out: None,
            argmax_part: None,
            kv: None,
        }
    }
}

/// Weights per step of a lane: one 16-byte load of f32/f16/bf16/q8_0 values, one 16-byte
/// load of q4_0/q4_1/q5_0/q5_1/q4_k quants (32 nibbles; q5_k adds one of `qh`), three of
/// q6_k (`ql` ×2 and `qh`: 64 values).
pub fn vector_width(format: WeightFormat) -> usize {
    match format {
        WeightFormat::F32 => 4,
        WeightFormat::F16 | WeightFormat::BF16 => 8,
        WeightFormat::Q8_0 => 16,
        WeightFormat::Q4_0
        | WeightFormat::Q4_1
        | WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q4_K
        | WeightFormat::Q5_K => 32,
        WeightFormat::Q6_K => 64,
    }
}

/// Input columns the group-norm input scales as one (a 4-wide f32 vector, or a 32-value q8
/// block for the quantized formats): a group must split into them.
pub fn group_unit(format: WeightFormat) -> usize {
    if format.reads_q8() { 32 } else { 4 }
}

/// Invocations summing each group's partials in the group-norm prologue: a power of two,
/// at most `WG`/G and about BPG. Both kernels take this one (the one-token kernel's
/// workgroup grows to hold it), so a lane's rstd, and with it its sum, is bitwise its run
/// alone whatever the one-token workgroup size (it once followed that size: 512 against
/// the batch's 256 would have split groups of more than 256 blocks differently).
pub fn group_lanes(groups: usize, blocks_per_group: usize) -> usize {
    let g = (WG as usize / groups.max(1))
        .min(blocks_per_group.max(1))
        .next_power_of_two();
    if g * groups > WG as usize { g / 2 } else { g }
}

/// Lanes per row: 32, more for matrices with few rows (so enough loads are in flight to
/// fill the memory system: about 2^18 lanes), fewer for short rows; each lane keeps at
/// least a few vector loads.
pub fn team_size(rows: usize, vectors_per_row: usize) -> u32 {
    team_for_lanes(rows, vectors_per_row, 1 << 18)
}

/// `team_size` aiming at `lanes` lanes in flight (fewer where each lane issues several
/// loads at once).
pub fn team_for_lanes(rows: usize, vectors_per_row: usize, lanes: usize) -> u32 {
    let mut team = 32;
    while team < WG as usize && rows * team < lanes && vectors_per_row / (2 * team) >= 4 {
        team *= 2;
    }
    while team > 4 && vectors_per_row < 2 * team {
        team /= 2;
    }
    team as u32
}

/// Lanes per row of a GEMV of `w` (one-token and batched alike, so a lane still equals its
/// run alone; `mixer`: the in_proj with the conv step in its epilogue): MAMBA2_GEMV_TEAM,
/// else `small_f32_team` for small f32 matrices (the MoE routers), else `team_size`, at most
/// 16 for an in_proj with 2^17 lanes or more at 16 a row, unless it is q8_0 of 4096 columns
/// or more. (On the H200, run 158, teams of 16 against 32, in_proj GPU ms per token:
/// mamba2-2.7b q8_0 1.159 → 1.031, q4_k 1.046 → 0.905, f16 1.809 → 1.638; Codestral f16
/// 3.330 → 3.186, q4_k 1.646 → 1.616, q8_0 2.124 → 2.138; Nemotron-H-8B q8_0 0.768 →
/// 0.778, f16 1.258 → 1.206; Nemotron 3 Nano q8_0 0.415 → 0.374 (run 157). The other GEMVs
/// lost with 16: Codestral's out_proj 1.179 → 1.422. Run 159: mamba2-370m, whose 4384 rows
/// make 70k lanes at 16, 0.822 → 0.834 ms/token; 1.3b's 8512 rows 1.113 → 1.101.)
pub fn gemv_team(w: &DeviceMatrix, mixer: bool) -> Result<u32> {
    let vpr = w.kp / vector_width(w.format);
    let wide_q8 = w.format == WeightFormat::Q8_0 && w.cols >= 4096;
    Ok(match team_override()? {
        Some(t) => t,
        None if small_f32(w) => small_f32_team(vpr),
        None if mixer && !wide_q8 && 16 * w.rows >= 1 << 17 => team_size(w.rows, vpr).min(16),
        None => team_size(w.rows, vpr),
    })
}

/// The most 4-value vectors an f32 matrix may hold to take `small_f32_team`: the MoE
/// routers (Nemotron 3 Nano's 128 × 2688 is 86016), read by few workgroups, whose latency
/// (not their bytes) is their time.
pub const SMALL_F32: usize = 1 << 17;

/// Whether `w` is a small f32 matrix (`SMALL_F32`): its teams are `small_f32_team`'s, its
/// batched tiles spread (`spread_small`).
fn small_f32(w: &DeviceMatrix) -> bool {
    w.format == WeightFormat::F32 && w.rows * (w.kp / vector_width(w.format)) <= SMALL_F32
}

/// Lanes per row of a small f32 matrix: up to a workgroup's `WG` while every lane keeps two
/// vectors, so rows spread over as many workgroups as they can and each lane's loads are
/// few (Nemotron 3 Nano's router on the H200, every GEMV's team forced to 256 against
/// `team_size`'s 64 for it: norm+router 0.267 → 0.239 GPU ms per token over 23 layers,
/// run 155).
pub fn small_f32_team(vectors_per_row: usize) -> u32 {
    let mut team = WG as usize;
    while team > 4 && vectors_per_row < 2 * team {
        team /= 2;
    }
    team as u32
}

/// Vector loads a lane of the one-token q8_0 and f16/bf16 kernels (and the q8_0 expert
/// GEMVs) issues together before summing them: MAMBA2_GEMV_UNROLL (1, 2, 4 or 8, for
/// tuning) or what the H200 measured best (BENCHMARKS.md, "Decode GEMVs with their loads
/// issued together", run 77, against one per round): two for q8_0 (Codestral 3.82 → 3.50
/// ms/token, Nemotron 3 Nano 2.28 → 2.18; four: 3.64 / 2.23), four for f16 and bf16
/// (Codestral 5.62 → 5.44; two: 5.61). One vector at a time for the block formats and
/// f32: run 79 measured two and four slower on Codestral's q4_k (2.83 → 3.00 / 3.06) and
/// q6_k (3.40 → 3.47 / 3.50), and q4_0 the same (2.68 / 2.69 / 2.68).
pub fn gemv_unroll(format: WeightFormat) -> Result<u32> {
    match std::env::var("MAMBA2_GEMV_UNROLL") {
        Ok(s) => parse_unroll(&s),
        Err(_) => Ok(match format {
            WeightFormat::Q8_0 => 2,
            WeightFormat::F16 | WeightFormat::BF16 => 4,
            _ => 1,
        }),
    }
}

/// Which one-token GEMV a workgroup size is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgKind {
    /// The GEMVs reading a plain input (in_proj, the attention and MLP projections).
    Plain,
    /// The GEMVs with the gated group norm folded in (out_proj: a per-workgroup prologue).
    Group,
    /// The MoE expert GEMVs.
    Expert,
}

/// Invocations per workgroup of a one-token GEMV (the batched lanes kernel keeps `WG`):
/// MAMBA2_GEMV_WG=P[,G[,E]] (64…1024, for tuning: plain, group-norm and expert GEMVs) or
/// what the H200 measured best (BENCHMARKS.md "Decode: shorter kernel latencies", runs
/// 90–91): 128 for the plain GEMVs (smaller workgroups end more evenly: Codestral's
/// in_proj 2.163 → 2.101 ms per token in q8_0, 3.376 → 3.342 in f16, 1.712 → 1.650 in
/// q4_k) and 512 for the group-norm ones (their prologue paid by fewer workgroups:
/// out_proj 1.206 → 1.193, 1.908 → 1.848, 1.028 → 1.015); `WG` for the experts. Never
/// more than the device allows.
pub fn one_token_wg(k: &Kernels, kind: WgKind) -> Result<u32> {
    let wg = match std::env::var("MAMBA2_GEMV_WG") {
        Ok(s) => {
            let v = parse_wg(&s)?;
            match kind {
                WgKind::Plain => v[0],
                WgKind::Group => v.get(1).copied().unwrap_or(v[0]),
                WgKind::Expert => v.get(2).copied().unwrap_or(v[0]),
            }
        }
        Err(_) => match kind {
            WgKind::Plain => 128,
            WgKind::Group => 512,
            WgKind::Expert => WG,
        },
    };
    Ok(wg.min(k.max_workgroup()))
}

/// A MAMBA2_GEMV_WG value: one to three powers of two of 64…1024.
fn parse_wg(s: &str) -> Result<Vec<u32>> {
    let bad = || {
        Error::InvalidInput(format!(
            "MAMBA2_GEMV_WG={s}: want one to three workgroup sizes (64, 128, 256, 512 or \
             1024) for the plain, group-norm and expert GEMVs, e.g. 128,512"
        ))
    };
    let v: Vec<u32> = s
        .split(',')
        .map(|p| p.trim().parse::<u32>().map_err(|_| bad()))
        .collect::<Result<_>>()?;
    if v.is_empty() || v.len() > 3 || v.iter().any(|&n| !matches!(n, 64 | 128 | 256 | 512 | 1024)) {
        return Err(bad());
    }
    Ok(v)
}

/// A MAMBA2_GEMV_UNROLL value.
fn parse_unroll(s: &str) -> Result<u32> {
    match s.trim().parse::<u32>() {
        Ok(n) if matches!(n, 1 | 2 | 4 | 8) => Ok(n),
        _ => Err(Error::InvalidInput(format!(
            "MAMBA2_GEMV_UNROLL={s}: want 1, 2, 4 or 8 vector loads per round"
        ))),
    }
}

/// Lanes per row of every GEMV, one-token and batched alike (so a lane still equals its run
/// alone): MAMBA2_GEMV_TEAM=T (a power of two of 4…256, for tuning), else `team_size`.
pub fn team_override() -> Result<Option<u32>> {
    match std::env::var("MAMBA2_GEMV_TEAM") {
        Err(_) => Ok(None),
        Ok(s) => match s.trim().parse::<u32>() {
            Ok(n) if (4..=WG).contains(&n) && n.is_power_of_two() => Ok(Some(n)),
            _ => Err(Error::InvalidInput(format!(
                "MAMBA2_GEMV_TEAM={s}: want a power of two of 4…{WG} lanes per row"
            ))),
        },
    }
}

/// MAMBA2_NORM_FOLD=0|1 (for measuring): whether a Mamba2 block's one-token in_proj takes
/// the pre-norm in its prologue (`folds_norm`), against the default.
fn norm_fold_override() -> Result<Option<bool>> {
    super::env_switch(
        "MAMBA2_NORM_FOLD",
        "the pre-norm as its own dispatch",
        "folded into in_proj where it can be",
    )
}

/// The most bytes of residual and norm weights a folded pre-norm's workgroups may read
/// between them (`folds_norm`). Each of them reads all of both (8 bytes a column) from
/// cache, and on the H200 those reads cost about what the matrix's own bytes would (run
/// 144, Mamba2 in_proj, q8_0 ms/token without → with the fold): mamba2-130m, 210
/// workgroups × 6 KB, 0.427 → 0.392 (in_proj 1.1 µs slower, the norm's dispatch gone);
/// mamba2-2.7b, 1322 × 20 KB, 1.911 → 2.354 (10.4 µs slower); Codestral, 2320 × 32 KB,
/// 3.321 → 4.488 (q4_k 2.632 → 4.124); Nemotron 3 Nano, 1320 × 21 KB, 1.904 → 2.085.
/// About 0.6 µs + 0.36 µs per MB against the 2.4 µs a 130m norm dispatch cost (run 115):
/// even at ~5 MB. Run 148: mamba2-370m (548 × 8 KB) 0.844 → 0.836, 780m (806 × 12 KB)
/// 0.987 → 1.145, 1.3b 1.128 → 1.348.
pub const FOLD_READS: usize = 5 << 20;

/// Whether the block's pre-norm folds into this one-token GEMV (`GemvInput::Norm`) of a
/// quantized matrix: every workgroup then makes the q8 blocks of the whole normed input in
/// its own memory (KP bytes and KP/32 scales, which must fit the device's workgroup
/// memory beside the q8 kernel's maxima) and the norm's own dispatch goes. Only for
/// narrow matrices, whose workgroups' reads of the input stay under `FOLD_READS`, unless
/// MAMBA2_NORM_FOLD says otherwise. `mixer`: the GEMV is a Mamba2 in_proj (its epilogue the
/// mixer's, its team `gemv_team`'s for it), else an attention block's qkv projection.
pub fn folds_norm(k: &Kernels, w: &DeviceMatrix, mixer: bool) -> Result<bool> {
    let norm_wg = norm_wg_for(k, w, mixer)?;
    let fits = w.format.reads_q8() && {
        let limit = k.ctx.device.limits().max_compute_workgroup_storage_size as usize;
        w.kp + w.kp / 8 + 4 * norm_wg <= limit
    };
    let narrow = || fold_reads(w, mixer, norm_wg) <= FOLD_READS;
    Ok(fits && norm_fold_override()?.unwrap_or_else(narrow))
}

/// The workgroups of a one-token GEMV of `w` folding the pre-norm with workgroups of
/// `norm_wg` invocations (its rows in teams of `gemv_team`).
fn fold_workgroups(w: &DeviceMatrix, mixer: bool, norm_wg: usize) -> usize {
    let team = gemv_team(w, mixer).unwrap_or(WG) as usize;
    w.rows.div_ceil((norm_wg / team).max(1))
}

/// The bytes of residual and norm weights the workgroups of a GEMV of `w` folding the
/// pre-norm with workgroups of `norm_wg` read between them (`FOLD_READS`).
fn fold_reads(w: &DeviceMatrix, mixer: bool, norm_wg: usize) -> usize {
    fold_workgroups(w, mixer, norm_wg) * 8 * w.kp
}

/// The pre-norm's workgroup of a block whose one-token GEMV of `w` (Mamba2 in_proj with
/// `mixer`, else attention qkv) may fold it in: MAMBA2_NORM_WG; else, for quantized
/// matrices (the only ones that fold), `FOLDED_NORM_WG` where the fold's reads with
/// `rmsnorm::CHUNK` stay under `FOLD_READS` (the norm folds either way) and the larger
/// workgroups still number `FOLDED_NORM_MIN_WGS`; else `rmsnorm::CHUNK`. Never more than
/// the device allows. The norm kernel of a batch and the fold of a run alone take the same
/// size (their sums must be the same bits).
pub fn norm_wg_for(k: &Kernels, w: &DeviceMatrix, mixer: bool) -> Result<usize> {
    let chunk = super::rmsnorm::CHUNK;
    let wg = match super::rmsnorm::norm_wg_override()? {
        Some(wg) => wg,
        None if w.format.reads_q8()
            && fold_reads(w, mixer, chunk) <= FOLD_READS
            && fold_workgroups(w, mixer, FOLDED_NORM_WG) >= FOLDED_NORM_MIN_WGS =>
        {
            FOLDED_NORM_WG
        }
        None => chunk,
    };
    Ok(wg.min(k.max_workgroup() as usize))
}

/// The pre-norm workgroup of the blocks whose GEMV folds it in (`norm_wg_for`): fewer,
/// larger workgroups each reading the residual. Measured on the H200 (BENCHMARKS.md runs
/// 165–168, q8_0 ms/token, 256 → 512 → 1024 invocations): mamba2-370m (in_proj 4384 rows, 274
/// workgroups of 512) 0.832 → 0.788 → 0.802; mamba2-130m (3352 rows, 210 workgroups of 512)
/// 0.387 → 0.397 → 0.390 (`FOLDED_NORM_MIN_WGS` keeps it at 256).
pub const FOLDED_NORM_WG: usize = 512;

/// The fewest workgroups a folding GEMV keeps with `FOLDED_NORM_WG` (a fit to the two
/// measured models above, which fold either way: 274 gained, 210 lost).
pub const FOLDED_NORM_MIN_WGS: usize = 256;

/// The GEMVs' tuning overrides (MAMBA2_GEMV_UNROLL, MAMBA2_GEMV_WG, MAMBA2_GEMV_TEAM,
/// MAMBA2_BATCH_STAGE, MAMBA2_NORM_FOLD), checked before a device is made.
pub fn check_overrides() -> Result<()> {
    team_override()?;
    norm_fold_override()?;
    super::rmsnorm::norm_wg_override()?;
    stage_override()?;
    if let Ok(s) = std::env::var("MAMBA2_GEMV_UNROLL") {
        parse_unroll(&s)?;
    }
    if let Ok(s) = std::env::var("MAMBA2_GEMV_WG") {
        parse_wg(&s)?;
    }
    Ok(())
}

/// Builds the dispatch; fails if a buffer is too small for the shapes.
pub fn gemv(
    k: &Kernels,
    name: &str,
    w: &DeviceMatrix,
    input: GemvInput,
    output: GemvOutput,
    b: GemvBuffers,
) -> Result<Dispatch> {
    let missing = |what: &str| Error::Gpu(format!("{name}: no {what} buffer given"));
    let m = w.rows;
    let lanes = b.lanes;
    let (n, cap) = (lanes.n, lanes.cap);
    check_len(&format!("{name}: dst"), b.dst, cap * m)?;
    // A part of a stacked projection (`dst_row0`) and an output scale (Granite's residual
    // multiplier) apply to plain stored or added rows only (no K/V or argmax epilogue);
    // a part's rows stay inside each lane's row (one lane: inside the buffer).
    let plain_rows = matches!(output, GemvOutput::Store | GemvOutput::Add)
        && b.kv.is_none()
        && b.argmax_part.is_none();
    let dst_row = match cap {
        1 => b.dst.size() as usize / 4,
        _ => super::lane_stride(b.dst, lanes) as usize,
    };
    if ((w.out_scale != 1.0 || b.dst_row0 > 0) && !plain_rows) || b.dst_row0 + m > dst_row {
        return Err(Error::Gpu(format!(
            "{name}: {} scaled by {} into rows {}..{} of {dst_row} a lane needs a stored or \
             added output without a K/V or argmax epilogue, inside the lane",
            w.name,
            w.out_scale,
            b.dst_row0,
            b.dst_row0 + m
        )));
    }
    let groups = match input {
        GemvInput::Group { groups, .. } => groups,
        GemvInput::Plain | GemvInput::Norm { .. } => 1,
    };
    let role = BatchRole::of(w.cols, input, output);
    let team = gemv_team(w, matches!(output, GemvOutput::Mixer(_)))?;
    let (nl, rt) = lane_tiling(n, groups, m, w.format, role, team);
    let (nl, rt) = match small_f32(w) && !tiles_forced() {
        true => spread_small(n, m, team, nl, rt),
        false => (nl, rt),
    };
    // The batch kernel's teams own `rt` rows each (the one-token kernel's one).
    let rt = if cap > 1 { rt } else { 1 };
    // A lane's input row: the whole of a one-lane buffer, a multiple of 256 values else.
    let x_ls = match (w.format.reads_q8(), b.q8) {
        (true, Some((_, xd))) => 32 * super::lane_stride(xd, lanes),
        _ => super::lane_stride(b.src, lanes),
    };
    if cap > 1 && ((x_ls as usize) < w.kp || !x_ls.is_multiple_of(256)) {
        return Err(Error::Gpu(format!(
            "{name}: lane input stride {x_ls} is not a multiple of 256 values of at least {}",
            w.kp
        )));
    }
    let vpr = w.kp / vector_width(w.format);
    // The group-norm prologue's invocations per group, the same for both kernels (see
    // `group_lanes`).
    let gsub = match input {
        GemvInput::Group {
            groups,
            blocks_per_group,
            ..
        } => {
            if groups == 0 || groups > WG as usize {
                return Err(Error::Gpu(format!(
                    "{name}: {groups} groups (1…{WG} fit a workgroup's norm prologue)"
                )));
            }
            group_lanes(groups, blocks_per_group)
        }
        GemvInput::Plain | GemvInput::Norm { .. } => 0,
    };
    let norm = matches!(input, GemvInput::Norm { .. });
    // Quantized weights take the folded pre-norm's q8 blocks from workgroup memory.
    let local = norm && w.format.reads_q8();
    if norm && (cap > 1 || !(local || w.format == WeightFormat::F32)) {
        return Err(Error::Gpu(format!(
            "{name}: the pre-norm folds into one-token f32 and quantized GEMVs only, not {} \
             over {cap} lanes",
            w.format.name()
        )));
    }
    let wg = if cap > 1 {
        WG
    } else if let GemvInput::Norm { wg, .. } = input {
        // The norm kernel's workgroup: its sum's order.
        super::rmsnorm::check_wg(k, name, wg)?;
        if wg < team as usize {
            return Err(Error::Gpu(format!(
                "{name}: a pre-norm workgroup of {wg} holds no team of {team}"
            )));
        }
        wg as u32
    } else {
        // (An in_proj whose pre-norm an experts' down pass made reads one group's partials:
        // it keeps the plain GEMVs' size.)
        let kind = match (input, output) {
            (GemvInput::Group { .. }, GemvOutput::Mixer(_)) => WgKind::Plain,
            (GemvInput::Group { .. }, _) => WgKind::Group,
            (GemvInput::Plain | GemvInput::Norm { .. }, _) => WgKind::Plain,
        };
        one_token_wg(k, kind)?.max(team).max((gsub * groups) as u32)
    };
    let rows_per_wg = wg / team;
    // A batch workgroup's memory besides its staged rows or gathered totals: the team sums,
    // the group norm's rstd and tree.
    let wg_budget = {
        let limit = k.ctx.device.limits().max_compute_workgroup_storage_size as usize;
        let others = 4 * WG as usize
            + match input {
                GemvInput::Group { groups, .. } => 4 * (groups * nl + WG as usize),
                GemvInput::Plain | GemvInput::Norm { .. } => 0,
            };
        limit.saturating_sub(others)
    };
    let stage = if cap > 1 {
        let grid = RegisterGrid {
            rows: m.div_ceil(rows_per_wg as usize * rt),
            lanes: n.div_ceil(nl),
            grouped: matches!(input, GemvInput::Group { .. }),
        };
        staging(w.format, team, nl, w.kp, grid, wg_budget)?
    } else {
        None
    };
    let u = |v: usize| Const::U32(v as u32);
    let (team_consts, team_flags) = k.team(team);
    let mut consts = vec![
        ("WG", Const::U32(wg)),
        ("R", Const::U32(rows_per_wg)),
        ("M", u(m)),
        ("KP", u(w.kp)),
        ("NL", u(nl)),
        ("RT", u(rt)),
        ("LANES", u(n)),
        ("X_LS", Const::U32(x_ls)),
        ("DST_LS", Const::U32(super::lane_stride(b.dst, lanes))),
        ("Y0", u(b.dst_row0)),
        ("RS", Const::F32(w.out_scale)),
        ("UNROLL", Const::U32(gemv_unroll(w.format)?)),
    ];
    if cap > 1 {
        // Rounds in which a batch team's lanes write its RT·NL totals.
        consts.push(("ER", u((rt * nl).div_ceil(team as usize))));
    }
    consts.extend(team_consts);
    let mut flags = w.flags();
    flags.extend(team_flags);
    // (The preprocessor unrolls the staged kernel's `#for` even where STAGE is off.)
    let (rr, lpt) = stage.unwrap_or((1, 1));
    consts.extend([("RR", u(rr)), ("LPT", u(lpt))]);
    if stage.is_some() {
        flags.push("STAGE");
    }
    // q8_0 with the folded pre-norm issues its first weight loads before that prologue.
    // The group-norm prologue does not take it (run 146, out_proj's first round issued
    // early: mamba2-130m 0.401 → 0.394 ms/token, but 2.7b 1.917 → 1.939 and Codestral
    // 3.324 → 3.425, its out_proj 1.17 → 1.29 GPU ms: registers held across the prologue).
    if local && w.format == WeightFormat::Q8_0 {
        flags.push("EARLY");
    }
    // f32 with the folded pre-norm (the MoE router) issues all its weight loads before that
    // prologue where a lane has a few.
    let nvt = vpr.div_ceil(team as usize);
    if norm && w.format == WeightFormat::F32 && nvt <= 4 {
        flags.push("EARLY_F32");
    }
    consts.push(("NVT", u(nvt.min(4))));
    let mut entries = w.bindings();
    if w.format.reads_q8() && !local {
        let (q, d) = b.q8.ok_or_else(|| missing("q8 activation"))?;
        check_len(
            &format!("{name}: xq"),
            q,
            (cap - 1) * x_ls as usize / 4 + w.kp / 4,
        )?;
        check_len(
            &format!("{name}: xd"),
            d,
            (cap - 1) * x_ls as usize / 32 + w.kp / 32,
        )?;
        entries.extend([(3, q), (4, d)]);
        flags.push("X_Q8");
    } else {
        if local {
            flags.extend(["X_Q8", "X_LOCAL"]);
        }
        // (The pre-norm's src is the residual: d values; columns past d read as zero.)
        let need = match input {
            GemvInput::Norm { d, .. } => d,
            _ => (cap - 1) * x_ls as usize + w.kp,
        };
        check_len(&format!("{name}: src"), b.src, need)?;
        entries.push((2, b.src));
    }
    if let GemvInput::Group {
        groups,
        group_size,
        blocks_per_group,
        eps,
    } = input
    {
        let vec = group_unit(w.format);
        if !group_size.is_multiple_of(vec) {
            return Err(Error::Gpu(format!(
                "{name}: group size {group_size} is not a multiple of {vec}"
            )));
        }
        let part = b.part.ok_or_else(|| missing("part"))?;
        check_len(
            &format!("{name}: part"),
            part,
            cap * groups * blocks_per_group,
        )?;
        flags.push("X_GROUP");
        consts.extend([
            ("GSUB", u(gsub)),
            ("GPIECE", Const::U32(k.team_piece(gsub as u32))),
            ("G", u(groups)),
            ("GS", u(group_size)),
            ("BPG", u(blocks_per_group)),
            ("EPS", Const::F32(eps as f32)),
            ("PART_LS", Const::U32(super::lane_stride(part, lanes))),
        ]);
        entries.push((9, part));
    }
    if let GemvInput::Norm { d, eps, nw_off, .. } = input {
        let params = b.params.ok_or_else(|| missing("params"))?;
        let mixer = matches!(output, GemvOutput::Mixer(_));
        if d > w.kp || (mixer && !local) {
            return Err(Error::Gpu(format!(
                "{name}: a pre-norm of {d} values before {} columns, or with the mixer epilogue \
                 on {} weights",
                w.kp,
                w.format.name()
            )));
        }
        check_len(&format!("{name}: params"), params, nw_off + d)?;
        flags.extend(["X_NORM", "NORM_SUM", "REDUCE"]);
        consts.extend([
            ("D", u(d)),
            ("SSL", u(d.div_ceil(wg as usize))),
            ("RV", u(1)),
            ("NW_OFF", u(nw_off)),
            ("EPS", Const::F32(eps as f32)),
        ]);
        // (The mixer epilogue binds the same parameters.)
        if !mixer {
            entries.push((8, params));
        }
        if local {
            if b.norm_out.is_some() {
                return Err(Error::Gpu(format!(
                    "{name}: a {} GEMV keeps its folded pre-norm in workgroup memory and \
                     writes no normed vector",
                    w.format.name()
                )));
            }
            // Every block of the KP columns, zeros past d.
            consts.push(("NB", u(w.kp / 32)));
            flags.push("Q8_OUT");
            if let Some(piece) = k.q8_shuffle() {
                flags.push("Q8_SHUFFLE");
                consts.push(piece);
            }
        }
    }
    if let (GemvInput::Norm { d, .. }, false) = (input, local) {
        let out = b.norm_out.ok_or_else(|| missing("pre-norm output"))?;
        check_len(&format!("{name}: h"), out.h, d)?;
        consts.push(("NB", u(d.div_ceil(32))));
        entries.push((10, out.h));
        if let Some((q, s)) = out.q8 {
            check_len(&format!("{name}: xq"), q, d.next_multiple_of(32) / 4)?;
            check_len(&format!("{name}: xd"), s, d.div_ceil(32))?;
            flags.push("Q8_OUT");
            if let Some(piece) = k.q8_shuffle() {
                flags.push("Q8_SHUFFLE");
                consts.push(piece);
            }
            entries.extend([(11, q), (12, s)]);
        }
    }
    entries.push((5, b.dst));
    match output {
        GemvOutput::Store => flags.push("O_STORE"),
        GemvOutput::Add => flags.push("O_ADD"),
        GemvOutput::Mixer(mc) => {
            flags.extend(["O_MIXER", "MIXER_ROW"]);
            consts.extend(mc.consts());
            let conv = b.conv_state.ok_or_else(|| missing("conv state"))?;
            let ctrl = b.ctrl.ok_or_else(|| missing("ctrl"))?;
            check_len(&format!("{name}: ctrl"), ctrl, cap * super::CTRL_WORDS)?;
            consts.extend([
                ("MIX_LS", Const::U32(super::lane_stride(b.dst, lanes))),
                ("CONV_LS", Const::U32(super::lane_stride(conv, lanes))),
            ]);
            entries.push((6, conv));
            entries.push((7, ctrl));
            entries.push((8, b.params.ok_or_else(|| missing("params"))?));
        }
    }
    // Row groups; a batch's workgroups take (row group, lane group) pairs from one linear
    // index, in the order `side_by_side` picks (`gemv_lanes.wgsl`).
    let row_groups = match stage {
        Some((rr, _)) => m.div_ceil(rr),
        None => m.div_ceil(rows_per_wg as usize * rt),
    };
    let lane_groups = n.div_ceil(nl);
    let workgroups = if cap > 1 {
        consts.extend([("LG", u(lane_groups)), ("RGN", u(row_groups))]);
        if side_by_side(lane_groups, w.bytes()) {
            flags.push("LANES_SIDE");
        }
        let total = row_groups
            .checked_mul(lane_groups)
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| {
                Error::Gpu(format!("{name}: {row_groups} × {lane_groups} workgroups"))
            })?;
        grid(total)
    } else {
        grid(row_groups as u32)
    };
    if let Some(part) = b.argmax_part {
        if cap > 1 || !matches!(output, GemvOutput::Store) {
            return Err(Error::Gpu(format!(
                "{name}: argmax partials come from a one-token stored GEMV, not {cap} lanes"
            )));
        }
        let (x, y, z) = workgroups;
        check_len(
            &format!("{name}: argmax partials"),
            part,
            4 * (x * y * z) as usize,
        )?;
        flags.push("O_ARGMAX");
        entries.push((13, part));
    }
    if let Some(kv) = b.kv {
        if cap > 1
            || !matches!(output, GemvOutput::Store)
            || !kv_fits(m, rows_per_wg as usize, kv.q_rows, kv.kv_rows, kv.f32)
        {
            return Err(Error::Gpu(format!(
                "{name}: the k and v rows {}..{} go to the caches from a one-token stored GEMV \
                 of {m} rows whose workgroups hold row pairs (f16 caches), not {cap} lanes of \
                 {rows_per_wg} rows",
                kv.q_rows,
                kv.q_rows + 2 * kv.kv_rows
            )));
        }
        let words = kv.ctx * kv.kv_rows / if kv.f32 { 1 } else { 2 };
        check_len(&format!("{name}: k cache"), kv.k_cache, words)?;
        check_len(&format!("{name}: v cache"), kv.v_cache, words)?;
        check_len(&format!("{name}: ctrl"), kv.ctrl, super::CTRL_WORDS)?;
        flags.push("O_KV");
        if kv.f32 {
            flags.push("KV_F32");
        }
        consts.extend([
            ("KV_Q", u(kv.q_rows)),
            ("KV_N", u(kv.kv_rows)),
            ("CTX", u(kv.ctx)),
        ]);
        entries.extend([(14, kv.k_cache), (15, kv.v_cache), (16, kv.ctrl)]);
    }
    let pipeline = if cap > 1 {
        // Every lane of a team gets its totals (they go out side by side).
        flags.push("TEAM_ALL");
        // The reduce-scatter's totals, padded to a power of two (zeros past RT·NL).
        let (nt, piece) = ((rt * nl).next_power_of_two() as u32, k.team_piece(team));
        // The team sums by one reduce-scatter (`TEAM_SCATTER`, gemv_lanes.wgsl) for q8_0's
        // register kernel: Codestral at 16 lanes 10.22 → 9.71 ms/step, 64 lanes 32.44 →
        // 30.69 (run 136). Its f16 batch lost (16 lanes 26.19 → 29.45, in_proj 13.36 →
        // 16.98: the f16 loop already holds more registers), so the other formats keep a
        // butterfly per total. Teams wider than a piece gather the pieces' totals in
        // workgroup memory, within the device's limit.
        let scatter = stage.is_none()
            && w.format == WeightFormat::Q8_0
            && k.shuffles()
            && piece <= 128
            && (team == piece || 4 * (WG / piece) as usize * nt as usize <= wg_budget);
        // (The preprocessor unrolls the `#for` blocks of every path, so all get the counts.)
        consts.extend([
            ("NT", Const::U32(nt)),
            ("NTH", Const::U32((nt / 2).max(1))),
            ("PER", Const::U32((nt / piece).max(1))),
            ("REP", Const::U32((piece / nt).max(1))),
        ]);
        if scatter {
            flags.push("TEAM_SCATTER");
            if team > piece {
                flags.push("TEAM_WIDE");
            }
        }
        if !scatter || team > piece {
            flags.push("EMIT_ROUNDS");
        }
        k.pipeline("gemv_lanes", LANE_SOURCES, &consts, &flags, false)?
    } else {
        // (The pre-norm's sum takes subgroup sums where there are subgroups.)
        let sources = if norm { NORM_SOURCES } else { SOURCES };
        k.pipeline("gemv", sources, &consts, &flags, norm)?
    };
    let bind_group = k.bind(&pipeline, name, &entries);
    Ok(Dispatch {
        pipeline,
        bind_group,
        workgroups,
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Matmul,
        label: Label::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_batch_matrices_take_their_tiles_and_order() {
        use WeightFormat::{F16, F32, Q8_0};
        let group = GemvInput::Group {
            groups: 8,
            group_size: 1024,
            blocks_per_group: 32,
            eps: 1e-5,
        };
        let mixer = GemvOutput::Mixer(MixerConsts {
            d_inner: 8192,
            conv_dim: 10240,
            heads: 128,
            kernel: 4,
            cw_off: 0,
            cb_off: 0,
            dtb_off: 0,
            dt_limit: (0.0, f64::INFINITY),
        });
        let plain = GemvInput::Plain;
        // Codestral's in_proj and out_proj, an MLP's down_proj, its up_proj, 130m's in_proj.
        let in_proj = BatchRole::of(4096, plain, mixer);
        let out_proj = BatchRole::of(8192, group, GemvOutput::Add);
        let down = BatchRole::of(21504, plain, GemvOutput::Add);
        assert_eq!(in_proj, BatchRole::ActivationBound { spread: true });
        assert_eq!(out_proj, BatchRole::WideGroupNorm);
        assert_eq!(down, BatchRole::ActivationBound { spread: true });
        // mamba2-2.7b's in_proj (2560 columns) keeps 8 × 4 at 16 lanes.
        let narrow = BatchRole::of(2560, plain, mixer);
        assert_eq!(narrow, BatchRole::ActivationBound { spread: false });
        assert_eq!(
            BatchRole::of(4096, plain, GemvOutput::Store),
            BatchRole::Other
        );
        assert_eq!(BatchRole::of(768, plain, mixer), BatchRole::Other);
        if std::env::var("MAMBA2_BATCH_LANES").is_err()
            && std::env::var("MAMBA2_BATCH_ROWS").is_err()
        {
            assert_eq!(lane_tiling(16, 1, 18560, Q8_0, in_proj, 32), (4, 8));
            assert_eq!(lane_tiling(17, 1, 18560, Q8_0, in_proj, 32), (8, 4));
            assert_eq!(lane_tiling(16, 1, 10576, Q8_0, narrow, 16), (8, 4));
            assert_eq!(lane_tiling(64, 8, 4096, Q8_0, out_proj, 64), (4, 8));
            // Fewer than 16 lanes, other formats and other matrices: 16 × 2.
            assert_eq!(lane_tiling(4, 1, 18560, Q8_0, in_proj, 32), (4, 2));
            assert_eq!(lane_tiling(16, 1, 18560, F16, in_proj, 16), (16, 2));
            assert_eq!(
                lane_tiling(64, 1, 4096, Q8_0, BatchRole::Other, 32),
                (16, 2)
            );
            // Teams of 16 at 4 lanes or fewer: one row each.
            assert_eq!(lane_tiling(4, 1, 10576, Q8_0, narrow, 16), (4, 1));
            assert_eq!(lane_tiling(8, 1, 10576, Q8_0, narrow, 16), (8, 2));
            assert_eq!(lane_tiling(4, 1, 10576, F16, narrow, 16), (4, 2));
            // f32 matrices: lane_tiling's tiles; small ones then spread (below).
            let other = BatchRole::Other;
            assert_eq!(lane_tiling(16, 1, 128, F32, other, 256), (16, 2));
        }
        // Small f32 matrices spread to FEW_WORKGROUPS: Nemotron 3 Nano's and
        // Granite-4.0-H-Tiny's routers (128 rows in teams of 256, 64 in teams of 128).
        assert_eq!(spread_small(16, 128, 256, 16, 2), (4, 1));
        assert_eq!(spread_small(16, 64, 128, 16, 2), (1, 1));
        assert_eq!(spread_small(64, 128, 256, 16, 2), (16, 1));
        assert_eq!(spread_small(64, 4096, 32, 16, 2), (16, 2));
        // Two lane groups go side by side only over matrices no L2 holds; three always.
        assert!(!side_by_side(1, 1 << 30));
        assert!(!side_by_side(2, 29 << 20));
        assert!(side_by_side(2, SIDE_BYTES));
        assert!(side_by_side(3, 1 << 20));
    }

    #[test]
    fn small_q8_matrices_take_the_staged_batch_kernel() {
        let q8 = WeightFormat::Q8_0;
        let plain = |rows, lanes| RegisterGrid {
            rows,
            lanes,
            grouped: false,
        };
        let grouped = |rows, lanes| RegisterGrid {
            rows,
            lanes,
            grouped: true,
        };
        let kib16 = 1 << 14;
        // gpu_kernels' cases: 37 rows of 256 (teams of 8, one register workgroup) stage 32
        // rows per workgroup with 3 lanes per invocation and, with 9 lanes, 10 rows in
        // three lane groups; 16448 rows (257 register workgroups) stage plain but not
        // grouped; f16 never.
        let team = team_size(37, 16);
        assert_eq!(team, 8);
        assert_eq!(
            staging(q8, team, 3, 256, grouped(1, 1), kib16).unwrap(),
            Some((32, 3))
        );
        assert_eq!(
            staging(q8, team, 9, 256, plain(1, 1), kib16).unwrap(),
            Some((10, 4))
        );
        assert_eq!(team_size(16448, 16), 8);
        assert_eq!(
            staging(q8, 8, 3, 256, plain(257, 1), kib16).unwrap(),
            Some((32, 3))
        );
        assert_eq!(
            staging(q8, 8, 3, 256, grouped(257, 1), kib16).unwrap(),
            None
        );
        assert_eq!(staging(q8, 8, 3, 256, plain(1028, 1), kib16).unwrap(), None);
        let f16 = WeightFormat::F16;
        assert_eq!(
            staging(f16, team, 3, 256, plain(1, 1), kib16).unwrap(),
            None
        );
        // The H200's shapes at 16 (and 64) lanes, as in `staging`'s table.
        assert_eq!(
            staging(q8, 16, 16, 768, plain(105, 1), kib16).unwrap(),
            Some((4, 4))
        );
        assert_eq!(
            staging(q8, 16, 16, 768, plain(105, 4), kib16).unwrap(),
            Some((4, 4))
        );
        assert_eq!(
            staging(q8, 32, 16, 1536, grouped(48, 1), kib16).unwrap(),
            Some((2, 4))
        );
        assert_eq!(
            staging(q8, 32, 16, 1536, grouped(48, 4), kib16).unwrap(),
            None
        );
        assert_eq!(
            staging(q8, 32, 16, 2560, plain(661, 1), kib16).unwrap(),
            Some((2, 4))
        );
        assert_eq!(
            staging(q8, 64, 16, 5120, grouped(320, 1), kib16).unwrap(),
            None
        );
        assert_eq!(
            staging(q8, 32, 16, 4096, plain(2320, 1), kib16).unwrap(),
            None
        );
        assert_eq!(
            staging(q8, 64, 16, 8192, grouped(512, 1), kib16).unwrap(),
            None
        );
        // Rows that do not fit: 8192 columns stage one row, 16384 none; a device leaving
        // 8 KiB for rows takes one row of 2048 but not 32 of 256.
        assert_eq!(
            staging(q8, 64, 16, 8192, grouped(64, 1), kib16).unwrap(),
            Some((1, 4))
        );
        assert_eq!(
            staging(q8, 32, 16, 16384, plain(1, 1), kib16).unwrap(),
            None
        );
        assert_eq!(
            staging(q8, 64, 16, 2048, plain(1, 1), 8192).unwrap(),
            Some((1, 4))
        );
        assert_eq!(staging(q8, team, 3, 256, plain(1, 1), 8192).unwrap(), None);
    }

    #[test]
    fn workgroup_override_names_the_variable() {
        assert_eq!(parse_wg("128").unwrap(), vec![128]);
        assert_eq!(parse_wg("128, 512,256").unwrap(), vec![128, 512, 256]);
        for bad in ["", "96", "2048", "128,512,256,64", "a,b", "128,,512"] {
            let e = parse_wg(bad).unwrap_err().to_string();
            assert!(e.contains("MAMBA2_GEMV_WG"), "{e}");
        }
    }

    #[test]
    fn unroll_override_names_the_variable() {
        assert_eq!(parse_unroll("4").unwrap(), 4);
        for bad in ["3", "16", "0", "four"] {
            let e = parse_unroll(bad).unwrap_err().to_string();
            assert!(e.contains("MAMBA2_GEMV_UNROLL"), "{e}");
        }
    }
}
