//! `moe_combine.wgsl`: a prefill block's routed experts back into the residual —
//! `resid [T][d] += s · Σ_k w [T, K] · y [pos [T, K]][d]`, the down projections of the rows
//! `moe_sort` laid out, summed in choice order, times the down banks' output scale `s`
//! (Granite's residual multiplier: the expert GEMMs leave their rows unscaled, so that the
//! cooperative GEMM may store its accumulators straight into them).

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/moe_combine.wgsl")];
const WG: u32 = 64;

/// The combine's buffers.
pub struct CombineBuffers<'a> {
    /// `[rows][d]` down projections of the sorted rows.
    pub y: &'a wgpu::Buffer,
    pub pos: &'a wgpu::Buffer,
    pub weights: &'a wgpu::Buffer,
    /// `[T][out_stride]`: the residual, or a latent MoE's sums.
    pub resid: &'a wgpu::Buffer,
    pub ctrl: &'a wgpu::Buffer,
    pub out_stride: usize,
    /// Store the sums instead of adding them.
    pub store: bool,
    /// The down banks' output scale (`DeviceMatrix::out_scale`), applied to each sum.
    pub scale: f32,
}

pub fn moe_combine(
    k: &Kernels,
    name: &str,
    d: usize,
    top_k: usize,
    max_tokens: usize,
    rows: usize,
    b: CombineBuffers,
) -> Result<Dispatch> {
    check_len(&format!("{name}: y"), b.y, rows * d)?;
    check_len(&format!("{name}: pos"), b.pos, max_tokens * top_k)?;
    check_len(&format!("{name}: weights"), b.weights, max_tokens * top_k)?;
    check_len(
        &format!("{name}: resid"),
        b.resid,
        max_tokens * b.out_stride,
    )?;
    let u = |v: usize| Const::U32(v as u32);
    let consts = [
        ("WG", Const::U32(WG)),
        ("D", u(d)),
        ("K", u(top_k)),
        ("OS", u(b.out_stride)),
        ("RS", Const::F32(b.scale)),
    ];
    let flags: &[&str] = if b.store { &["STORE"] } else { &[] };
    let pipeline = k.pipeline("moe_combine", SOURCES, &consts, flags, false)?;
    let entries = [
        (0, b.y),
        (1, b.pos),
        (2, b.weights),
        (3, b.resid),
        (4, b.ctrl),
    ];
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: ((d as u32).div_ceil(WG), max_tokens as u32, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Moe,
        label: Label::default(),
    }
    .per_token(1, 1, 1))
}
