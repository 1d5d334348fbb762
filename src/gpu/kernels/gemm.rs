//! `gemm.wgsl`: the prefill projections, `Y [T][ys] (=|+=) X [T][xs] · Wᵀ` for the T tokens
//! of a block (`ctrl.prompt_len`), W a `DeviceMatrix` `[M, K]` in any format; X rows are
//! `xs = ceil32(K)` values, zero past K (what the batched norms write).

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/block_quant.wgsl"),
    include_str!("../../../shaders/gemm.wgsl"),
];

/// Output tile: rows of W × tokens. (A 128-token tile with 8×8 values per invocation
/// measured slower on the H200: BENCHMARKS.md.)
pub const TILE: (usize, usize) = (128, 64);

/// Whether the product is stored or added (the residual).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmOutput {
    Store,
    Add,
}

/// gemm.wgsl's shape constants for `w`, X rows of `xs` and Y rows of `ys` values, W's
/// rows from value `y0` of each, its products times `rs`.
fn shape_consts(
    w: &DeviceMatrix,
    xs: usize,
    ys: usize,
    y0: usize,
    rs: f32,
) -> Vec<(&'static str, Const)> {
    vec![
        ("M", Const::U32(w.rows as u32)),
        ("KP", Const::U32(w.kp as u32)),
        ("XS", Const::U32(xs as u32)),
        ("YS", Const::U32(ys as u32)),
        ("Y0", Const::U32(y0 as u32)),
        ("RS", Const::F32(rs)),
    ]
}

/// Checks that W's rows, from value `y0`, fit Y rows of `ys` values and that Y holds
/// `tokens` of them.
pub fn check_y(
    name: &str,
    w_rows: usize,
    tokens: usize,
    y: &wgpu::Buffer,
    ys: usize,
    y0: usize,
) -> Result<()> {
    if tokens == 0 || y0 + w_rows > ys {
        return Err(crate::error::Error::Gpu(format!(
            "{name}: {tokens} tokens of {w_rows} rows from value {y0} of Y rows of {ys}"
        )));
    }
    check_len(&format!("{name}: y"), y, (tokens - 1) * ys + y0 + w_rows)
}

/// The GEMM of a block of up to `max_tokens` tokens; `y` has rows of `ys` values, W's rows
/// from value `y0` of each (0 but for a part of a stacked projection whose parts differ in
/// format). On the tensor cores (`gemm_coop`) where they serve `w`, else on FMA register
/// tiles.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
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
) -> Result<Dispatch> {
    if super::gemm_coop::applies(k, w) {
        let direct = super::gemm_coop::direct_fits(w, max_tokens, y, ys, y0);
        let tile = super::gemm_coop::tile_for(k, w, max_tokens, direct)?;
        let emulate = !k.ctx.caps.coop_matrix;
        let build = |tile| {
            super::gemm_coop::gemm_coop(
                k, name, w, max_tokens, x, y, ys, y0, output, ctrl, tile, emulate,
            )
        };
        let mut d = build(tile)?;
        for (most, t) in super::gemm_coop::shorter_tiles(k, w, max_tokens, direct, tile) {
            d.shorter.push((most as u32, build(t)?));
        }
        return Ok(d);
    }
    let xs = w.cols.next_multiple_of(32);
    check_len(&format!("{name}: x"), x, max_tokens * xs)?;
    check_y(name, w.rows, max_tokens, y, ys, y0)?;
    let consts = shape_consts(w, xs, ys, y0, w.out_scale);
    let out = match output {
        GemmOutput::Store => "O_STORE",
        GemmOutput::Add => "O_ADD",
    };
    let mut flags = w.flags();
    flags.push(out);
    let pipeline = k.pipeline("gemm", SOURCES, &consts, &flags, false)?;
    let mut entries = w.bindings();
    entries.extend([(2, x), (3, y), (4, ctrl)]);
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (
            w.rows.div_ceil(TILE.0) as u32,
            max_tokens.div_ceil(TILE.1) as u32,
            1,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Matmul,
        label: Label::gemm(w),
    }
    .per_token(1, TILE.1, 1))
}

/// Workgroups a split-K GEMM aims for (a few per SM on the big GPUs).
const SPLIT_TARGET: usize = 512;
/// Most K slices of a split-K GEMM.
pub const MAX_SLICES: usize = 16;

/// How many K slices a GEMM of `w` over one token tile takes: enough for its row tiles to
/// make ~SPLIT_TARGET workgroups, each slice a whole number of 16-column steps (1: no
/// split).
pub fn split_slices(w: &DeviceMatrix) -> usize {
    split_slices_over(w, 1)
}

/// `split_slices` for a GEMM over `token_tiles` token tiles.
fn split_slices_over(w: &DeviceMatrix, token_tiles: usize) -> usize {
    let tiles = w.rows.div_ceil(TILE.0).max(1) * token_tiles.max(1);
    let want = (SPLIT_TARGET / tiles).clamp(1, MAX_SLICES);
    (1..=want)
        .rev()
        .find(|&s| w.kp.is_multiple_of(s * 16))
        .unwrap_or(1)
}

/// Fewest K slices for which a block of more than one token tile splits its K loop.
const BLOCK_SPLIT_MIN: usize = 4;

/// MAMBA2_NO_SPLITK=1: every prefill GEMM runs whole, short blocks too (for comparison).
fn splitk_off() -> bool {
    crate::gpu::switched_off("MAMBA2_NO_SPLITK")
}

/// The K slices of `w`'s GEMM over a block of `max_tokens` tokens (1: the plain GEMM).
/// Blocks of one token tile: `split_slices` (or the cooperative split's). Longer blocks split
/// only matrices of one row tile on FMA tiles: the MoE routers (64–128 rows of f32, which the
/// cooperative GEMM never takes: 8 workgroups over a 512-token block), and where that makes
/// at least `BLOCK_SPLIT_MIN` slices. Wider matrices keep the plain GEMM there (their grids
/// are measured only that way). MAMBA2_NO_SPLITK=1 turns it off too.
pub fn block_slices(k: &Kernels, w: &DeviceMatrix, max_tokens: usize) -> usize {
    if splitk_off() {
        return 1;
    }
    if max_tokens <= TILE.1 {
        return part_slices(k, w);
    }
    if w.rows > TILE.0 || super::gemm_coop::applies(k, w) {
        return 1;
    }
    let s = split_slices_over(w, max_tokens.div_ceil(TILE.1));
    if s >= BLOCK_SPLIT_MIN { s } else { 1 }
}

/// The split-K partials' token stride PT for a block of `max_tokens`: its tokens in whole
/// token tiles (a short block's one tile).
pub fn part_tokens(max_tokens: usize) -> usize {
    max_tokens.max(TILE.1).next_multiple_of(TILE.1)
}

/// Values of the split-K partials `w`'s GEMM over a block of `max_tokens` needs (0 when it
/// does not split): `[KS][PT][rows]`, PT = `part_tokens(max_tokens)`.
pub fn part_values(k: &Kernels, w: &DeviceMatrix, max_tokens: usize) -> usize {
    let s = block_slices(k, w, max_tokens);
    if s > 1 {
        s * part_tokens(max_tokens) * w.rows
    } else {
        0
    }
}

/// The K slices a split-K partial buffer for `w` must hold on this device for a block of
/// one token tile: the most either split takes.
pub fn part_slices(k: &Kernels, w: &DeviceMatrix) -> usize {
    use super::gemm_coop::{split_slices as coop_slices, split_tile};
    split_slices(w).max(coop_slices(w, split_tile(k)))
}

/// The GEMM of a block of at most `max_tokens` tokens with its K loop split over workgroup
/// slices into `part` (`[KS][PT][rows]`, PT = `max_tokens` in whole token tiles), then
/// summed in order into `y` by `gemm_reduce`. For short blocks (one token tile), where W's
/// row tiles alone leave most of the GPU idle (Codestral's out_proj: 32 workgroups),
/// `split_slices(w)` slices, or where the cooperative GEMM takes W its split
/// (`gemm_coop::gemm_coop_split`, its own slice count). For longer blocks, `block_slices`
/// (matrices of one row tile on FMA tiles: the MoE routers). One dispatch (the plain GEMM) when
/// no split applies. `part` holds `part_values(w, max_tokens)` values.
#[allow(clippy::too_many_arguments)]
pub fn gemm_split(
    k: &Kernels,
    name: &str,
    w: &DeviceMatrix,
    max_tokens: usize,
    x: &wgpu::Buffer,
    part: &wgpu::Buffer,
    y: &wgpu::Buffer,
    ys: usize,
    y0: usize,
    output: GemmOutput,
    ctrl: &wgpu::Buffer,
) -> Result<Vec<Dispatch>> {
    let short = max_tokens <= TILE.1;
    // The tokens the GEMM covers (a short block's whole tile), and the partials' token
    // stride.
    let tokens = if short { TILE.1 } else { max_tokens };
    let t = part_tokens(max_tokens);
    if splitk_off() {
        return Ok(vec![gemm(k, name, w, tokens, x, y, ys, y0, output, ctrl)?]);
    }
    let coop_slices = if short && super::gemm_coop::applies(k, w) {
        super::gemm_coop::split_slices(w, super::gemm_coop::split_tile(k))
    } else {
        1
    };
    let (split, slices) = if coop_slices > 1 {
        let emulate = !k.ctx.caps.coop_matrix;
        let split =
            super::gemm_coop::gemm_coop_split(k, name, w, x, part, ctrl, coop_slices, emulate)?;
        (split, coop_slices)
    } else {
        let slices = if short {
            split_slices(w)
        } else {
            block_slices(k, w, max_tokens)
        };
        if slices == 1 {
            return Ok(vec![gemm(k, name, w, tokens, x, y, ys, y0, output, ctrl)?]);
        }
        let xs = w.cols.next_multiple_of(32);
        check_len(&format!("{name}: x"), x, tokens * xs)?;
        check_len(&format!("{name}: part"), part, slices * t * w.rows)?;
        // (The partials' rows are W's, unscaled: the reduce puts them at `y0`, scaled.)
        let mut consts = shape_consts(w, xs, ys, 0, 1.0);
        consts.extend([
            ("KS", Const::U32(slices as u32)),
            ("PT", Const::U32(t as u32)),
        ]);
        let mut flags = w.flags();
        flags.extend(["SPLIT", "O_PART"]);
        let pipeline = k.pipeline("gemm", SOURCES, &consts, &flags, false)?;
        let mut entries = w.bindings();
        entries.extend([(2, x), (3, part), (4, ctrl)]);
        let split = Dispatch {
            bind_group: k.bind(&pipeline, name, &entries),
            pipeline,
            workgroups: (
                w.rows.div_ceil(TILE.0) as u32,
                (t / TILE.1) as u32,
                slices as u32,
            ),
            name: format!("{name} (split-K)"),
            per_token: None,
            shorter: Vec::new(),
            section: Section::Matmul,
            label: Label::gemm(w),
        };
        // (A block shorter than the graph's dispatches only its token tiles.)
        let split = if short {
            split
        } else {
            split.per_token(1, TILE.1, 1)
        };
        (split, slices)
    };
    let reduce = super::gemm_reduce::gemm_reduce(
        k,
        &format!("{name} (reduce)"),
        w.rows,
        slices,
        (t, tokens),
        part,
        y,
        ys,
        y0,
        w.out_scale,
        output,
        ctrl,
    )?;
    Ok(vec![split, reduce])
}

/// A block's dense projection: `gemm_split`, which splits the K loop in the short-block
/// graph (`max_tokens` ≤ one token tile) and for matrices of one row tile (`block_slices`)
/// and otherwise runs the plain GEMM over the block's token tiles.
#[allow(clippy::too_many_arguments)]
pub fn projection(
    k: &Kernels,
    name: &str,
    w: &DeviceMatrix,
    max_tokens: usize,
    x: &wgpu::Buffer,
    part: &wgpu::Buffer,
    y: &wgpu::Buffer,
    ys: usize,
    output: GemmOutput,
    ctrl: &wgpu::Buffer,
) -> Result<Vec<Dispatch>> {
    gemm_split(k, name, w, max_tokens, x, part, y, ys, 0, output, ctrl)
}

/// The rows of a prefill block's MoE, sorted by expert (`moe_sort`): `rows` of them in tiles
/// of `TILE.1`, each tile one expert's (`tile_expert`), and with `gather`, the (token,
/// choice) pair of each row and the choices per token (up projections read the token's
/// normed row; down projections read the sorted rows themselves).
pub struct SortedRows<'a> {
    pub rows: usize,
    pub tile_expert: &'a wgpu::Buffer,
    pub gather: Option<(&'a wgpu::Buffer, usize)>,
}

/// One bank's grouped GEMM over sorted rows: `y [rows][ys] = X · W_eᵀ` where each tile of
/// rows uses its own expert `e`'s `bank.rows_per_expert` rows of `w`; tiles of experts
/// outside the bank are left alone. The rows are not scaled by `w.out_scale` (the down
/// banks' Granite multiplier): `moe_combine` applies it to each token's sum, so that the
/// cooperative GEMM keeps its direct epilogue.
#[allow(clippy::too_many_arguments)]
pub fn expert_gemm(
    k: &Kernels,
    name: &str,
    w: &DeviceMatrix,
    bank: super::expert_gemv::Bank,
    sorted: SortedRows,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    ys: usize,
    y0: usize,
) -> Result<Dispatch> {
    if super::gemm_coop::applies(k, w) {
        let emulate = !k.ctx.caps.coop_matrix;
        return super::gemm_coop::expert_gemm_coop(k, name, w, bank, sorted, x, y, ys, y0, emulate);
    }
    let m = bank.rows_per_expert;
    let rows = sorted.rows;
    if bank.count * m != w.rows || !rows.is_multiple_of(TILE.1) || y0 + m > ys {
        return Err(crate::error::Error::Gpu(format!(
            "{name}: {} experts × {m} rows from {y0}, {rows} sorted rows and output rows of \
             {ys} do not fit {} ({} rows) in tiles of {}",
            bank.count, w.name, w.rows, TILE.1
        )));
    }
    let xs = w.cols.next_multiple_of(32);
    check_len(&format!("{name}: y"), y, (rows - 1) * ys + y0 + m)?;
    check_len(
        &format!("{name}: tile experts"),
        sorted.tile_expert,
        rows / TILE.1,
    )?;
    let u = |v: usize| Const::U32(v as u32);
    let mut consts = vec![
        ("M", u(m)),
        ("KP", u(w.kp)),
        ("XS", u(xs)),
        ("YS", u(ys)),
        ("Y0", u(y0)),
        // (Rows unscaled: `moe_combine` applies the bank's output scale.)
        ("RS", Const::F32(1.0)),
        ("TR", u(rows)),
        ("E0", u(bank.first)),
        ("NE", u(bank.count)),
        ("NONE", Const::U32(u32::MAX)),
    ];
    let mut flags = w.flags();
    flags.extend(["O_STORE", "GROUPED"]);
    let mut entries = w.bindings();
    entries.extend([(2, x), (3, y), (5, sorted.tile_expert)]);
    match sorted.gather {
        Some((pairs, top_k)) => {
            check_len(&format!("{name}: pairs"), pairs, rows)?;
            // Pairs index tokens·top_k rows of X.
            check_len(&format!("{name}: x"), x, xs)?;
            consts.push(("K", u(top_k)));
            flags.push("GATHER");
            entries.push((6, pairs));
        }
        None => check_len(&format!("{name}: x"), x, rows * xs)?,
    }
    let pipeline = k.pipeline("gemm", SOURCES, &consts, &flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (m.div_ceil(TILE.0) as u32, (rows / TILE.1) as u32, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Moe,
        label: Label::default(),
    })
}
