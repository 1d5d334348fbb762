//! `embed.wgsl`: `resid [L][D]` = the embedding [V, D] rows of each lane's `ctrl[l].token`
//! (decode over L lanes), or for a prefill
//! block `resid [T][D]` = the rows of `prompt [T]`; any weight format; times a scale.

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/block_quant.wgsl"),
    include_str!("../../../shaders/embed.wgsl"),
];
const WG: u32 = 64;

fn dispatch(
    k: &Kernels,
    table: &DeviceMatrix,
    scale: f32,
    name: &str,
    tokens: usize,
    lanes: usize,
    entries: &[(u32, &wgpu::Buffer)],
) -> Result<Dispatch> {
    let consts = [
        ("WG", Const::U32(WG)),
        ("D", Const::U32(table.cols as u32)),
        ("V", Const::U32(table.rows as u32)),
        ("KP", Const::U32(table.kp as u32)),
        ("SCALE", Const::F32(scale)),
    ];
    let mut flags = table.flags();
    if tokens > 1 {
        flags.push("PROMPT");
    }
    let pipeline = k.pipeline("embed", SOURCES, &consts, &flags, false)?;
    let mut all = table.bindings();
    all.extend_from_slice(entries);
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &all),
        pipeline,
        workgroups: (
            (table.cols as u32).div_ceil(WG),
            tokens as u32,
            lanes as u32,
        ),
        name: name.into(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Other,
        label: Label::default(),
    })
}

/// The decode embed of `lanes` lanes: lane l's row of `ctrl[l].token`, times `scale`.
pub fn embed(
    k: &Kernels,
    table: &DeviceMatrix,
    scale: f32,
    lanes: super::Lanes,
    ctrl: &wgpu::Buffer,
    resid: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len("embed: resid", resid, lanes.cap * table.cols)?;
    check_len("embed: ctrl", ctrl, lanes.cap * super::CTRL_WORDS)?;
    dispatch(
        k,
        table,
        scale,
        "embed",
        1,
        lanes.n,
        &[(2, ctrl), (3, resid)],
    )
}

/// The prefill embed of a block of up to `max_tokens` tokens (`ctrl.prompt_len` of them).
pub fn embed_prompt(
    k: &Kernels,
    table: &DeviceMatrix,
    scale: f32,
    max_tokens: usize,
    prompt: &wgpu::Buffer,
    resid: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len("prefill embed: prompt", prompt, max_tokens)?;
    check_len("prefill embed: resid", resid, max_tokens * table.cols)?;
    // A block of one token still reads `prompt`.
    Ok(dispatch(
        k,
        table,
        scale,
        "prefill_embed",
        max_tokens.max(2),
        1,
        &[(2, ctrl), (3, resid), (4, prompt)],
    )?
    .per_token(1, 1, 1))
}
