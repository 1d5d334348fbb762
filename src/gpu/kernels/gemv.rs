//! `gemv.wgsl`: `y = W·x` for one token over a `DeviceMatrix` `[M, K]`, with the fused
//! prologues (pre-norm, gated group norm) and epilogues (residual add, conv + dt) the
//! decode graph needs. Shapes: `src [K]`, `dst [M]` (`Store`, `Mixer`) or `[M]` added to
//! (`Add`); `params` holds the norm weight at `nw_off`; `part [G·NPART]` partial Σv².

use super::{Dispatch, Kernels, Section, check_len, finite, grid, pow2_clamp};
use crate::error::Result;
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;
use crate::model::quant::WeightFormat;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/mixer_row.wgsl"),
    include_str!("../../../shaders/gemv.wgsl"),
];

/// Rows per workgroup.
pub const ROWS: u32 = 8;

/// What the GEMV's input vector is.
#[derive(Clone, Copy, Debug)]
pub enum GemvInput {
    /// `x = src`
    Plain,
    /// `x = src ⊙ params[nw_off..] / rms(src)` (the block pre-norm or the final norm).
    Rms { nw_off: usize, eps: f64 },
    /// `x = src ⊙ params[nw_off..] · rstd[g]`, `rstd[g]` from `parts_per_group` partial
    /// sums of squares per group of `group_size` channels (the gated group norm).
    Group {
        nw_off: usize,
        groups: usize,
        group_size: usize,
        parts_per_group: usize,
        eps: f64,
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
    pub src: &'a wgpu::Buffer,
    pub params: Option<&'a wgpu::Buffer>,
    pub part: Option<&'a wgpu::Buffer>,
    pub dst: &'a wgpu::Buffer,
    pub conv_state: Option<&'a wgpu::Buffer>,
    pub ctrl: Option<&'a wgpu::Buffer>,
}

/// Threads per workgroup for rows of `kp` padded columns in `format`.
pub fn workgroup_size(format: WeightFormat, kp: usize) -> u32 {
    let per_thread = match format {
        WeightFormat::F32 => 4,
        WeightFormat::F16 => 8,
        WeightFormat::Q8_0 => 16,
    };
    pow2_clamp(kp / per_thread, 32, 256)
}

/// Workgroup memory the kernel uses for a matrix (to size the device's limits).
pub fn workgroup_bytes(format: WeightFormat, kp: usize, groups: usize) -> u32 {
    let wg = workgroup_size(format, kp) as usize;
    let reduce = 4 * (ROWS as usize + 1) * wg;
    let q8 = if format == WeightFormat::Q8_0 {
        kp + 4 * (kp / 32)
    } else {
        0
    };
    (reduce + q8 + 4 * groups) as u32
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
    let (m, kk) = (w.rows, w.cols);
    check_len(&format!("{name}: src"), b.src, kk)?;
    check_len(&format!("{name}: dst"), b.dst, m)?;
    let wg = workgroup_size(w.format, w.kp);
    let u = |v: usize| Const::U32(v as u32);
    let mut consts = vec![
        ("WG", Const::U32(wg)),
        ("R", Const::U32(ROWS)),
        ("RV", Const::U32(ROWS + 1)),
        ("M", u(m)),
        ("K", u(kk)),
        ("KP", u(w.kp)),
    ];
    let mut flags = vec![w.flag()];
    let mut section = Section::Matmul;
    match input {
        GemvInput::Plain => flags.push("X_PLAIN"),
        GemvInput::Rms { nw_off, eps } => {
            flags.extend(["X_RMS", "NEED_PARAMS"]);
            consts.extend([("NW_OFF", u(nw_off)), ("EPS", Const::F32(eps as f32))]);
        }
        GemvInput::Group {
            nw_off,
            groups,
            group_size,
            parts_per_group,
            eps,
        } => {
            flags.extend(["X_GROUP", "NEED_PARAMS"]);
            consts.extend([
                ("NW_OFF", u(nw_off)),
                ("EPS", Const::F32(eps as f32)),
                ("G", u(groups)),
                ("GS", u(group_size)),
                ("NPART", u(parts_per_group)),
            ]);
            check_len(
                &format!("{name}: part"),
                b.part.expect("part buffer"),
                groups * parts_per_group,
            )?;
        }
    }
    match output {
        GemvOutput::Store => flags.push("O_STORE"),
        GemvOutput::Add => flags.push("O_ADD"),
        GemvOutput::Mixer(mc) => {
            flags.extend(["O_MIXER", "MIXER_ROW", "NEED_PARAMS"]);
            consts.extend(mc.consts());
            section = Section::Matmul;
        }
    }
    flags.push("REDUCE");
    let pipeline = k.pipeline("gemv", SOURCES, &consts, &flags, true)?;
    let mut entries = w.bindings();
    entries.push((2, b.src));
    if let Some(p) = b.params.filter(|_| flags.contains(&"NEED_PARAMS")) {
        entries.push((3, p));
    }
    if let (Some(p), GemvInput::Group { .. }) = (b.part, input) {
        entries.push((4, p));
    }
    entries.push((5, b.dst));
    if let GemvOutput::Mixer(_) = output {
        entries.push((6, b.conv_state.expect("conv state buffer")));
        entries.push((7, b.ctrl.expect("ctrl buffer")));
    }
    let bind_group = k.bind(&pipeline, name, &entries);
    Ok(Dispatch {
        pipeline,
        bind_group,
        workgroups: grid((m as u32).div_ceil(ROWS)),
        name: name.to_string(),
        section,
    })
}
