//! `prefill_conv.wgsl`: the causal conv over a block, `u [T][conv_dim]` from the raw
//! `mix [T][d_in_proj]` rows and the cached conv state `[conv_dim][K−1]`, and the dt
//! softplus in place; `prefill_conv_state.wgsl` then moves the conv state on.

use super::chunk::ChunkConsts;
use super::gemv::MixerConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/prefill_conv.wgsl")];
const STATE_SOURCES: super::Sources = &[include_str!("../../../shaders/prefill_conv_state.wgsl")];

/// The buffers of the prefill conv.
pub struct ConvBuffers<'a> {
    pub mix: &'a wgpu::Buffer,
    pub params: &'a wgpu::Buffer,
    pub conv_state: &'a wgpu::Buffer,
    pub u: &'a wgpu::Buffer,
    pub ctrl: &'a wgpu::Buffer,
}

/// Tokens one invocation of `prefill_conv` takes, in order (its inputs read once each).
const TOKENS_PER_INVOCATION: usize = 8;

/// The conv for every (column, token) of a block; grid rows are runs of
/// `TOKENS_PER_INVOCATION` tokens.
pub fn prefill_conv(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    mc: MixerConsts,
    b: ConvBuffers,
) -> Result<Dispatch> {
    check_len(&format!("{name}: mix"), b.mix, cc.max_tokens * cc.d_in_proj)?;
    check_len(
        &format!("{name}: conv state"),
        b.conv_state,
        mc.conv_dim * (mc.kernel - 1),
    )?;
    check_len(&format!("{name}: u"), b.u, cc.u_words())?;
    let mut consts = vec![
        ("DIP", Const::U32(cc.d_in_proj as u32)),
        ("TPI", Const::U32(TOKENS_PER_INVOCATION as u32)),
    ];
    consts.extend(mc.consts());
    // Kernels of up to 4 taps (every Mamba2 model's) slide their inputs through a vec4,
    // four columns per invocation where the rows split into vec4s.
    let win4 = mc.kernel <= 4;
    let col4 = four_columns(&cc, &mc);
    let mut flags: Vec<&str> = match (win4, col4) {
        (true, true) => vec!["WIN4", "COL4"],
        (true, false) => vec!["WIN4"],
        _ => vec![],
    };
    if cc.u_f16 && !col4 {
        return Err(crate::error::Error::Gpu(format!(
            "{name}: u in f16 needs four columns per invocation (a kernel of at most 4 taps, \
             row widths multiples of 4)"
        )));
    }
    cc.u_flag(&mut flags);
    let columns_per_invocation = if col4 { 4 } else { 1 };
    let pipeline = k.pipeline("prefill_conv", SOURCES, &consts, &flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(
            &pipeline,
            name,
            &[
                (0, b.mix),
                (1, b.params),
                (2, b.conv_state),
                (3, b.ctrl),
                (4, b.u),
            ],
        ),
        pipeline,
        workgroups: (
            (mc.conv_dim + mc.heads)
                .div_ceil(columns_per_invocation)
                .div_ceil(64) as u32,
            cc.max_tokens.div_ceil(TOKENS_PER_INVOCATION) as u32,
            1,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Conv,
        label: Label::default(),
    }
    .per_token(1, TOKENS_PER_INVOCATION, 1))
}

/// Whether an invocation takes four adjacent columns (COL4): kernels of up to 4 taps and
/// rows that split into vec4s.
fn four_columns(cc: &ChunkConsts, mc: &MixerConsts) -> bool {
    mc.kernel <= 4
        && [cc.d_in_proj, mc.d_inner, mc.conv_dim, mc.heads]
            .iter()
            .all(|n| n.is_multiple_of(4))
}

/// Whether the conv should write `u` in f16 for a block whose y buffer is `y`: where the
/// three SSD kernels that read it (C·Bᵀ, chunk states, chunk scan) all run on cooperative
/// matrices, which round u to f16 on its way into the tensor cores anyway (the chunk scan's
/// D·x term then reads the rounded x too), and the conv takes four columns at a time.
/// MAMBA2_U_F32=1 keeps it f32, for comparison.
pub fn u_in_f16(k: &Kernels, cc: &ChunkConsts, mc: &MixerConsts, y: &wgpu::Buffer) -> bool {
    four_columns(cc, mc)
        && super::ssd_cb_coop::applies(k, cc)
        && super::ssd_chunk_state_coop::applies(k, cc)
        && super::ssd_chunk_scan_coop::applies(k, cc, y)
        && std::env::var_os("MAMBA2_U_F32").is_none_or(|v| v != "1")
}

/// The conv state after the block: its last K−1 raw inputs.
pub fn prefill_conv_state(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    mc: MixerConsts,
    mix: &wgpu::Buffer,
    conv_state: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len(
        &format!("{name}: conv state"),
        conv_state,
        mc.conv_dim * (mc.kernel - 1),
    )?;
    let mut consts = vec![("DIP", Const::U32(cc.d_in_proj as u32))];
    consts.extend(mc.consts());
    let pipeline = k.pipeline("prefill_conv_state", STATE_SOURCES, &consts, &[], false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &[(0, mix), (1, conv_state), (2, ctrl)]),
        pipeline,
        workgroups: (mc.conv_dim.div_ceil(64) as u32, 1, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Conv,
        label: Label::default(),
    })
}
