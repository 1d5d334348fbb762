//! `prefill_embed.wgsl`: `resid [T][D]` = embedding rows of `prompt [T]`.

use super::{Dispatch, Kernels, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;

const SOURCES: super::Sources = &[include_str!("../../../shaders/prefill_embed.wgsl")];

pub fn prefill_embed(
    k: &Kernels,
    table: &DeviceMatrix,
    max_tokens: usize,
    prompt: &wgpu::Buffer,
    resid: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len("prefill_embed: prompt", prompt, max_tokens)?;
    check_len("prefill_embed: resid", resid, max_tokens * table.cols)?;
    let wg = 64u32;
    let consts = [
        ("WG", Const::U32(wg)),
        ("D", Const::U32(table.cols as u32)),
        ("V", Const::U32(table.rows as u32)),
        ("KP", Const::U32(table.kp as u32)),
    ];
    let pipeline = k.pipeline("prefill_embed", SOURCES, &consts, &[table.flag()], false)?;
    let mut entries = table.bindings();
    entries.extend([(2, prompt), (3, resid), (4, ctrl)]);
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, "prefill_embed", &entries),
        pipeline,
        workgroups: ((table.cols as u32).div_ceil(wg), max_tokens as u32, 1),
        name: "prefill_embed".into(),
        per_token: None,
        section: Section::Other,
    })
}
