//! `expert_gemv.wgsl`: the routed experts' projections for `T` tokens of `K` choices each,
//! reading the chosen ids (and weights) the router wrote — static dispatches that read only
//! the chosen experts' rows. A `DeviceMatrix` bank holds experts `first..first + count`,
//! `rows_per_expert` rows each.
//! - `Up`: `dst [T·K][M] = W_id · x_t`; inputs f32 `src [T][KP]` or q8 blocks
//!   `xq [T][KP/4]`, `xd [T][KP/32]` (f32 rows padded to a multiple of 32).
//! - `Down`: `dst [T][M] += Σ_k w_k · W_id(k) · x_(t,k)`; inputs one row per choice,
//!   `src [T·K][KP]` or q8 blocks.
//!
//! `Up` with an `ActFold` writes the activation instead of `u`: `relu(u)²` (non-gated
//! experts), or `silu(g)·u` of the rows' two halves (gated: `[gate; up]`, M/2 each), rows
//! `mid [T·K][XM]` (XM = M or M/2 rounded up to 32, zero past it) and their q8 blocks, what
//! the activation dispatch between the passes wrote (its formula; the rows' sums take the
//! folded pass's team). A workgroup then owns whole q8 blocks of activation rows (R a
//! multiple of 32; gated, its teams take R rows of each half).
//!
//! Over a batch's lanes (`lane_width`) both passes run every lane's (and choice's)
//! workgroups of one row block side by side in the grid, so the rows of an expert that
//! several lanes chose come from DRAM once and from cache for the others (the shared
//! expert's slices, which every lane names, above all). Each workgroup's work is the same
//! as in lane order, so the bits are too.
//!
//! `Up` with a `RouteFold` (decode) routes the token in its prologue from the router's
//! logits (`route_select.wgsl`, the routing kernel's code: the same ids and weights bit for
//! bit) instead of reading `ids`, and writes `ids`, `weights` and the expert load.

use super::gemv::{team_for_lanes, team_size};
use super::{Dispatch, Kernels, Label, Section, check_len, grid};
use crate::config::MoeConfig;
use crate::error::{Error, Result};
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;
use crate::model::quant::WeightFormat;

const EXPERT_GEMV: &str = include_str!("../../../shaders/expert_gemv.wgsl");
/// The block formats' bindings and products are the one-token GEMV's.
const BLOCK_QUANT: &str = include_str!("../../../shaders/block_quant.wgsl");
const Q8_DOT: &str = include_str!("../../../shaders/q8_dot.wgsl");
const GEMV_UNITS: &str = include_str!("../../../shaders/gemv_units.wgsl");
const SOURCES: super::Sources = &[BLOCK_QUANT, Q8_DOT, GEMV_UNITS, EXPERT_GEMV];
/// The up pass that routes its token itself.
const ROUTED: super::Sources = &[
    super::moe_route::ROUTE_SELECT,
    BLOCK_QUANT,
    Q8_DOT,
    GEMV_UNITS,
    EXPERT_GEMV,
];

/// Whether a bank of `format` can be multiplied here: f32, f16 and q8_0 against either
/// input; the 4-, 5- and 6-bit block formats only against q8 input blocks (`q8_input`).
pub fn takes(format: WeightFormat, q8_input: bool) -> bool {
    match format {
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Q8_0 => true,
        WeightFormat::Q4_0
        | WeightFormat::Q4_1
        | WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q4_K
        | WeightFormat::Q5_K
        | WeightFormat::Q6_K => q8_input,
        WeightFormat::BF16 => false,
    }
}

/// Which projection of the experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPass {
    Up,
    Down,
}

/// A bank of experts: `count` experts from `first`, `rows_per_expert` rows each.
#[derive(Clone, Copy, Debug)]
pub struct Bank {
    pub first: usize,
    pub count: usize,
    pub rows_per_expert: usize,
}

/// Where an up pass's rows go in `dst`: each choice's row of `stride` values, this bank's
/// from value `offset` on (an expert's `[gate; up]` stored as two banks of different block
/// types, each writing its half, `DeviceMoe::up`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsAt {
    pub stride: usize,
    pub offset: usize,
}

/// The buffers besides the bank's matrix.
pub struct ExpertBuffers<'a> {
    /// f32 inputs (f32/f16 matrices).
    pub src: &'a wgpu::Buffer,
    /// q8 input blocks (the quantized formats: q8_0 and the 4/5/6-bit block formats).
    pub q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
    pub dst: &'a wgpu::Buffer,
    /// Where the rows go in `dst` (None: rows of the bank's `rows_per_expert` values): an
    /// up pass's part of `[gate; up]`, or a down pass's rows a batch's lane stride apart.
    pub dst_at: Option<RowsAt>,
    pub ids: &'a wgpu::Buffer,
    /// The routing weights (`Down` only).
    pub weights: Option<&'a wgpu::Buffer>,
    /// `Down`: store instead of adding (the first bank writing a latent sum).
    pub store: bool,
    /// `Up`: the activation folded into the epilogue (`dst` is then not written).
    pub act: Option<ActFold<'a>>,
    /// `Up`: the routing folded into the prologue (`ids` and `weights` are then written).
    pub route: Option<RouteFold<'a>>,
    /// `Down`: the next block's pre-norm made in the epilogue.
    pub norm_tail: Option<NormTail<'a>>,
    /// A batch's lanes as the tokens (`Scratch::lane_width`): an up pass's input vectors and
    /// their q8 blocks, and a norm tail's q8 blocks, lie this many values apart (the GEMV
    /// inputs' lane stride), its sums and counts `⌈M/32⌉` apart. None: packed rows.
    pub lane_width: Option<usize>,
}

/// The next block's RMS pre-norm, made by the down pass that finishes the residual (one
/// token, or each of a batch's lanes; the last bank, adding into the residual): the q8
/// blocks of `x ⊙ w`
/// (`w = params[nw_off..nw_off + M]`) into `xq [M/32·8]`, `xd [M/32]` without the 1/rms, and
/// Σx² per block of 32 rows into `part [⌈M/32⌉]`, which the next GEMV turns into the 1/rms
/// (`GemvInput::Group` with one group of M). `counts [⌈M/32⌉]` (u32, zero between tokens):
/// how many of a block's workgroups finished; the last one makes the block. The norm's own
/// dispatch goes.
pub struct NormTail<'a> {
    pub params: &'a wgpu::Buffer,
    pub nw_off: usize,
    pub xq: &'a wgpu::Buffer,
    pub xd: &'a wgpu::Buffer,
    pub part: &'a wgpu::Buffer,
    pub counts: &'a wgpu::Buffer,
}

/// The most storage buffers a down pass with the norm tail binds: the bank's weights and
/// scales, its q8 inputs, the residual, ids, weights, and the tail's five.
const NORM_TAIL_BUFFERS: u32 = 12;

/// Whether a down pass of `w` (`rows_per_expert` rows, `top_k` slots, q8 inputs
/// with `q8_in`) can make the next pre-norm in its tail: its workgroups' rows tile the q8
/// blocks and the device binds the buffers it needs.
pub fn takes_norm_tail(
    k: &Kernels,
    w: &DeviceMatrix,
    rows_per_expert: usize,
    top_k: usize,
    q8_in: bool,
) -> Result<bool> {
    let buffers = k.ctx.device.limits().max_storage_buffers_per_shader_stage;
    let (team, wg) = down_team_and_wg(k, w, rows_per_expert, top_k, q8_in)?;
    Ok(buffers >= NORM_TAIL_BUFFERS && tiles_blocks((wg / team) as usize))
}

/// Whether workgroups of `rows` rows tile the q8 blocks: several to a block, or whole
/// blocks each.
fn tiles_blocks(rows: usize) -> bool {
    32 % rows == 0 || rows.is_multiple_of(32)
}

/// The team and workgroup of a down pass: a row spans every choice's vectors.
fn down_team_and_wg(
    k: &Kernels,
    w: &DeviceMatrix,
    m: usize,
    top_k: usize,
    q8_in: bool,
) -> Result<(u32, u32)> {
    let per_row = top_k * w.kp / super::gemv::vector_width(w.format);
    let q8 = q8_in && w.format.reads_q8();
    let unroll = q8.then(|| super::gemv::gemv_unroll(w.format)).transpose()?;
    team_and_wg(k, m, per_row, None, unroll)
}

/// What the up pass needs to route its token itself (`route_select.wgsl`, the routing
/// kernel's code): the router's shape, its logits `[T][E]`, the correction bias
/// (`params [off..off + E]`, grouped routers) and the expert-load counters (`[off..off + E]`).
/// The routing dispatch before the pass goes; every workgroup of a chosen slot routes, and
/// one per token writes `ids` and `weights` for the down pass.
pub struct RouteFold<'a> {
    pub moe: &'a MoeConfig,
    pub logits: &'a wgpu::Buffer,
    pub params: Option<(&'a wgpu::Buffer, usize)>,
    pub counts: Option<(&'a wgpu::Buffer, usize)>,
}

/// Where the up pass's folded activation goes: `mid [T·K][XM]` and optionally its q8 blocks
/// `xq [T·K][XM/4]`, `xd [T·K][XM/32]`. `gated`: the bank's rows are `[gate; up]` (M/2
/// each) and the fold writes `silu(g)·u`, M/2 values a row (each workgroup's teams take
/// the same rows of both halves).
pub struct ActFold<'a> {
    pub mid: &'a wgpu::Buffer,
    pub q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
    pub gated: bool,
}

/// The team and workgroup size of an expert pass: `team_size`'s team (the down pass over
/// q8 blocks, whose lanes issue `unroll` loads at once, aims at that many times fewer
/// lanes) and the expert GEMVs' workgroup; with the activation folded (`fold`: the teams
/// an activation row takes, 1, or 2 for its gate and up rows), a workgroup of at least 32
/// activation rows (whole q8 blocks), the team halved until 32 rows' teams fit in 512
/// invocations per team of a row.
fn team_and_wg(
    k: &Kernels,
    m: usize,
    per_row: usize,
    fold: Option<u32>,
    unroll: Option<u32>,
) -> Result<(u32, u32)> {
    // (Nano's q8_0 down pass on the H200, run 118: teams of 64 0.440 ms, 128 0.473, 32
    // 0.493; f16, one load at a time, keeps 128: 0.782 against 0.998 with 32.)
    let mut team = match unroll {
        Some(u) => team_for_lanes(m, per_row, (1usize << 18) / u.max(1) as usize),
        None => team_size(m, per_row),
    };
    let max = k.max_workgroup();
    let mut wg = super::gemv::one_token_wg(k, super::gemv::WgKind::Expert)?.max(team);
    if let Some(f) = fold {
        // (32 teams of 16 on the H200, run 116: Nano's up pass 0.471 ms against 0.484 with
        // teams of 32 and 0.493 with 8.) Workgroups of 1024 where the device allows: Nano's
        // up pass 0.531 → 0.516 ms against 512 (run 157, the routing in its prologue).
        while team > 1 && 32 * f * team > max.min(512 * f) {
            team /= 2;
        }
        wg = wg.max(32 * f * team).max(max.min(1024)).min(max);
    }
    Ok((team, wg))
}

/// The activation rows a folded up pass of `m` rows an expert writes per choice.
fn act_rows(m: usize, f: &ActFold) -> usize {
    if f.gated { m / 2 } else { m }
}

/// Builds one bank's dispatch for `tokens` tokens of `top_k` choices.
#[allow(clippy::too_many_arguments)]
pub fn expert_gemv(
    k: &Kernels,
    name: &str,
    w: &DeviceMatrix,
    bank: Bank,
    pass: ExpertPass,
    tokens: usize,
    top_k: usize,
    b: ExpertBuffers,
) -> Result<Dispatch> {
    let m = bank.rows_per_expert;
    if bank.count * m != w.rows {
        return Err(Error::Gpu(format!(
            "{name}: a bank of {} experts × {m} rows does not match the {} rows of {}",
            bank.count, w.rows, w.name
        )));
    }
    // Rows of one input vector: a token (up) or a choice (down).
    let inputs = match pass {
        ExpertPass::Up => tokens,
        ExpertPass::Down => tokens * top_k,
    };
    let z = match pass {
        ExpertPass::Up => tokens * top_k,
        ExpertPass::Down => tokens,
    };
    if z > 65535 {
        return Err(Error::Gpu(format!(
            "{name}: {tokens} tokens × {top_k} experts is over the 65535 workgroups a grid axis \
             holds"
        )));
    }
    check_len(&format!("{name}: ids"), b.ids, tokens * top_k)?;
    let at = b.dst_at.unwrap_or(RowsAt {
        stride: m,
        offset: 0,
    });
    // (Up: a part's half of the rows; down: a batch's latent sums, rows a lane width apart
    // as the next GEMV reads its lanes, from 0 and without the norm tail.)
    let placed = match pass {
        ExpertPass::Up => b.act.is_none(),
        ExpertPass::Down => at.offset == 0 && b.norm_tail.is_none(),
    };
    if at.offset + m > at.stride || (b.dst_at.is_some() && !placed) {
        return Err(Error::Gpu(format!(
            "{name}: {m} rows from {} do not fit output rows of {}, or a folded up pass or a \
             down pass from a row other than 0 or with the norm tail was given them",
            at.offset, at.stride
        )));
    }
    check_len(
        &format!("{name}: dst"),
        b.dst,
        (z.max(tokens) - 1) * at.stride + at.offset + m,
    )?;
    if !takes(w.format, b.q8.is_some()) {
        return Err(Error::Gpu(format!(
            "{name}: expert banks are f32, f16 or q8_0, or a 4/5/6-bit block format against \
             q8 inputs; not {}{}",
            w.format.name(),
            if b.q8.is_some() {
                ""
            } else {
                " against f32 inputs"
            }
        )));
    }
    let fold = b.act.as_ref().filter(|_| pass == ExpertPass::Up);
    if b.act.is_some() && fold.is_none() {
        return Err(Error::Gpu(format!(
            "{name}: only the up pass folds the activation"
        )));
    }
    let unroll = super::gemv::gemv_unroll(w.format)?;
    let (team, wg) = match pass {
        ExpertPass::Up => {
            let per_row = w.kp / super::gemv::vector_width(w.format);
            team_and_wg(k, m, per_row, fold.map(|f| 1 + f.gated as u32), None)?
        }
        ExpertPass::Down => down_team_and_wg(k, w, m, top_k, b.q8.is_some())?,
    };
    // The rows a workgroup makes: a row per team, or with a gated fold one activation row
    // per two teams (its gate and up rows).
    let (out_rows, rows_per_wg) = match fold {
        Some(f) if f.gated => (act_rows(m, f), wg / team / 2),
        _ => (m, wg / team),
    };
    // Input vectors are padded to 32 values (what norms and activations write), or lie a
    // batch's lane width apart (the up pass; a lane row holds whole k-quant superblocks).
    let xs = w.cols.next_multiple_of(32);
    // (What a lane holds: the up pass's inputs, the norm tail's rows.)
    let lane_holds = match pass {
        ExpertPass::Up => w.kp,
        ExpertPass::Down => m,
    };
    if let Some(lw) = b.lane_width
        && (!lw.is_multiple_of(256) || lw < lane_holds)
    {
        return Err(Error::Gpu(format!(
            "{name}: lanes {lw} values apart do not hold whole superblocks of {lane_holds} \
             values"
        )));
    }
    let lanes = b.lane_width.filter(|_| pass == ExpertPass::Up);
    let xr = lanes.unwrap_or(xs);
    // A batch's lanes (and choices) of a row block side by side (the same bits: each
    // workgroup's work is unchanged, only its place in the grid moves). A batch routes in
    // its own dispatch (moe.rs), so the routing prologue keeps grid z.
    let lanes_inner = b.lane_width.is_some()
        && tokens > 1
        && b.route.is_none()
        && super::env_switch(
            "MAMBA2_LANES_INNER",
            "a batch's expert passes run lane after lane",
            "their lanes of a row block side by side",
        )?
        .unwrap_or(true);
    let u = |v: usize| Const::U32(v as u32);
    let (team_consts, team_flags) = k.team(team);
    let mut consts = vec![
        ("WG", Const::U32(wg)),
        ("R", Const::U32(rows_per_wg)),
        ("M", u(m)),
        ("MS", u(at.stride)),
        ("M0", u(at.offset)),
        ("KP", u(w.kp)),
        ("XR", u(xr)),
        ("KS", u(top_k)),
        ("E0", u(bank.first)),
        ("NE", u(bank.count)),
        ("UNROLL", Const::U32(unroll)),
        ("RS", Const::F32(w.out_scale)),
    ];
    consts.extend(team_consts);
    let mut flags = w.flags();
    flags.extend(team_flags);
    let mut entries = w.bindings();
    match b.q8 {
        // Quantized weights take the q8 blocks of their input when there are some (the
        // block formats always do), else f32.
        Some((q, d)) if w.format.reads_q8() => {
            // (The last input needs its KP values only.)
            let row = lanes.unwrap_or(w.kp);
            let last = inputs.saturating_sub(1) * row + w.kp;
            check_len(&format!("{name}: xq"), q, last / 4)?;
            check_len(&format!("{name}: xd"), d, last / 32)?;
            flags.push("Q8_IN");
            if let Some(lw) = lanes {
                flags.push("IN_LANES");
                consts.push(("XL", u(lw)));
            }
            entries.extend([(3, q), (4, d)]);
        }
        _ => {
            check_len(&format!("{name}: src"), b.src, inputs * xr)?;
            entries.push((2, b.src));
        }
    }
    if lanes_inner {
        flags.push("LANES_INNER");
        consts.push(("ZN", u(z)));
    }
    if b.store {
        flags.push("STORE");
    }
    // (The folded up pass writes `mid`, not `dst`: an unused binding is not in the layout.)
    if fold.is_none() {
        entries.push((5, b.dst));
    }
    entries.push((6, b.ids));
    if let Some(f) = fold {
        if f.gated && !m.is_multiple_of(2) {
            return Err(Error::Gpu(format!(
                "{name}: {m} rows an expert are no [gate; up] pair of halves"
            )));
        }
        let xm = act_rows(m, f).next_multiple_of(32);
        check_len(&format!("{name}: mid"), f.mid, z * xm)?;
        flags.push("ACT");
        if f.gated {
            flags.push("ACT_GATED");
            consts.push(("MH", u(act_rows(m, f))));
        }
        consts.extend([("XM", u(xm)), ("NB", u(xm / 32))]);
        entries.push((8, f.mid));
        if let Some((q, d)) = f.q8 {
            check_len(&format!("{name}: mid xq"), q, z * xm / 4)?;
            check_len(&format!("{name}: mid xd"), d, z * xm / 32)?;
            flags.extend(["Q8_OUT", "Q8_ROWS"]);
            if let Some(piece) = k.q8_shuffle() {
                flags.push("Q8_SHUFFLE");
                consts.push(piece);
            }
            entries.extend([(9, q), (10, d)]);
        }
    }
    if let Some(r) = &b.route {
        if pass != ExpertPass::Up || r.moe.slots() != top_k {
            return Err(Error::Gpu(format!(
                "{name}: only an up pass over the router's {} slots routes",
                r.moe.slots()
            )));
        }
        check_len(&format!("{name}: logits"), r.logits, tokens * r.moe.experts)?;
        let wt = b
            .weights
            .ok_or_else(|| Error::Gpu(format!("{name}: no routing weights given")))?;
        check_len(&format!("{name}: weights"), wt, tokens * top_k)?;
        let spec = super::moe_route::route_spec(name, r.moe, wg, r.params, r.counts)?;
        // One candidate per TPC invocations that a subgroup holds: their counts summed by
        // shuffles (`route_rank`), two barriers fewer before the first weight load.
        // MAMBA2_ROUTE_SHUFFLE=0 keeps the workgroup atomics (for measuring).
        let tpc = spec.tpc;
        // (`KS` is already the pass's slots.)
        consts.extend(spec.consts.into_iter().filter(|(c, _)| *c != "KS"));
        flags.push("ROUTE");
        flags.extend(spec.flags);
        let on = super::env_switch(
            "MAMBA2_ROUTE_SHUFFLE",
            "the workgroup atomics",
            "subgroup shuffles where they fit",
        )?
        .unwrap_or(true);
        if on && k.shuffles() && tpc >= 2 && tpc <= k.ctx.caps.subgroup_min as usize {
            flags.push("RT_SHUFFLE");
        }
        entries.extend([(7, wt), (11, r.logits)]);
        entries.extend(spec.bias.map(|p| (12, p)));
        entries.extend(spec.counts.map(|c| (13, c)));
    }
    if pass == ExpertPass::Down {
        let wt = b
            .weights
            .ok_or_else(|| Error::Gpu(format!("{name}: no routing weights given")))?;
        check_len(&format!("{name}: weights"), wt, tokens * top_k)?;
        flags.push("DOWN");
        entries.push((7, wt));
    }
    if let Some(n) = &b.norm_tail {
        let rows = (wg / team) as usize;
        let lw = b.lane_width.filter(|_| tokens > 1);
        if pass != ExpertPass::Down
            || (tokens > 1 && lw.is_none())
            || b.store
            || !tiles_blocks(rows)
        {
            return Err(Error::Gpu(format!(
                "{name}: only a down pass adding into the residual of one token or a batch's \
                 lanes, with workgroups of a divisor or multiple of 32 rows (not {rows}), \
                 makes the next pre-norm"
            )));
        }
        let blocks = m.div_ceil(32);
        let tl = lw.unwrap_or(0);
        check_len(&format!("{name}: norm params"), n.params, n.nw_off + m)?;
        check_len(
            &format!("{name}: norm xq"),
            n.xq,
            tokens.saturating_sub(1) * tl / 4 + blocks * 8,
        )?;
        check_len(
            &format!("{name}: norm xd"),
            n.xd,
            tokens.saturating_sub(1) * tl / 32 + blocks,
        )?;
        check_len(&format!("{name}: norm part"), n.part, tokens * blocks)?;
        check_len(&format!("{name}: norm counts"), n.counts, tokens * blocks)?;
        flags.extend(["NORM_TAIL", "Q8_OUT", "Q8_BLOCK"]);
        if let Some(piece) = k.q8_shuffle() {
            flags.push("Q8_SHUFFLE");
            consts.push(piece);
        }
        consts.extend([
            ("NB", u(blocks)),
            ("NW_OFF", u(n.nw_off)),
            ("TR", u(rows.max(32))),
            ("TL", u(tl)),
        ]);
        entries.extend([
            (9, n.xq),
            (10, n.xd),
            (14, n.params),
            (15, n.part),
            (16, n.counts),
        ]);
    }
    let sources = if b.route.is_some() { ROUTED } else { SOURCES };
    let pipeline = k.pipeline("expert_gemv", sources, &consts, &flags, false)?;
    let bind_group = k.bind(&pipeline, name, &entries);
    let row_blocks = (out_rows as u32).div_ceil(rows_per_wg);
    let (gx, gy, gz) = match lanes_inner {
        true => {
            let n = (row_blocks as usize)
                .checked_mul(z)
                .filter(|&n| n <= u32::MAX as usize);
            let n = n.ok_or_else(|| {
                Error::Gpu(format!(
                    "{name}: {row_blocks} row blocks × {z} lanes overflow a grid"
                ))
            })?;
            let (gx, gy, _) = grid(n as u32);
            (gx, gy, 1)
        }
        false => {
            let (gx, gy, _) = grid(row_blocks);
            (gx, gy, z)
        }
    };
    let d = Dispatch {
        pipeline,
        bind_group,
        workgroups: (gx, gy, gz as u32),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Moe,
        label: Label::default(),
    };
    // (A batch's lanes are no prefill block: its decode graph's token count is KV rows.)
    Ok(if tokens > 1 && b.lane_width.is_none() {
        d.per_token(2, 1, z / tokens)
    } else {
        d
    })
}
