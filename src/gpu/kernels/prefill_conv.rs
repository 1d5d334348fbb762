//! `prefill_conv.wgsl`: the causal conv (and dt softplus) over a block's `mix [T][d_in_proj]`
//! rows in place, continuing from and updating the conv state `[conv_dim][K−1]`.

use super::chunk::ChunkConsts;
use super::gemv::MixerConsts;
use super::{Dispatch, Kernels, Section, check_len};
use crate::error::Result;

const SOURCES: super::Sources = &[include_str!("../../../shaders/prefill_conv.wgsl")];

#[allow(clippy::too_many_arguments)]
pub fn prefill_conv(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    mc: MixerConsts,
    mix: &wgpu::Buffer,
    params: &wgpu::Buffer,
    conv_state: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len(&format!("{name}: mix"), mix, cc.max_tokens * cc.d_in_proj)?;
    check_len(
        &format!("{name}: conv state"),
        conv_state,
        mc.conv_dim * (mc.kernel - 1),
    )?;
    let mut consts = vec![("DIP", crate::gpu::shader::Const::U32(cc.d_in_proj as u32))];
    consts.extend(mc.consts());
    let pipeline = k.pipeline("prefill_conv", SOURCES, &consts, &[], false)?;
    Ok(Dispatch {
        bind_group: k.bind(
            &pipeline,
            name,
            &[(0, mix), (1, params), (2, conv_state), (3, ctrl)],
        ),
        pipeline,
        workgroups: ((mc.conv_dim + mc.heads).div_ceil(64) as u32, 1, 1),
        name: name.to_string(),
        per_token: None,
        section: Section::Conv,
    })
}
