//! `conv_step.wgsl` (unfused graph): the `[xBC | dt]` rows of `mix [d_in_proj]` become
//! `[u | δ]` in place; the conv state `[conv_dim][K−1]` moves one step.

use super::gemv::MixerConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/mixer_row.wgsl"),
    include_str!("../../../shaders/conv_step.wgsl"),
];

pub fn conv_step(
    k: &Kernels,
    name: &str,
    mc: MixerConsts,
    mix: &wgpu::Buffer,
    params: &wgpu::Buffer,
    conv_state: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    let rows = mc.conv_dim + mc.heads;
    check_len(&format!("{name}: mix"), mix, mc.d_inner + rows)?;
    check_len(
        &format!("{name}: conv state"),
        conv_state,
        mc.conv_dim * (mc.kernel - 1),
    )?;
    let wg = 64u32;
    let mut consts = vec![("WG", Const::U32(wg))];
    consts.extend(mc.consts());
    consts.extend([("MIX_LS", Const::U32(0)), ("CONV_LS", Const::U32(0))]);
    let pipeline = k.pipeline("conv_step", SOURCES, &consts, &["MIXER_ROW"], false)?;
    Ok(Dispatch {
        bind_group: k.bind(
            &pipeline,
            name,
            &[(3, params), (5, mix), (6, conv_state), (7, ctrl)],
        ),
        pipeline,
        workgroups: ((rows as u32).div_ceil(wg), 1, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Conv,
        label: Label::default(),
    })
}
