//! `argmax.wgsl`: greedy choice over `logits [V]` into the control block; a NaN or ±Inf
//! logit sets `ctrl.nonfinite` (the token stays inside the vocabulary).

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/emit.wgsl"),
    include_str!("../../../shaders/argmax.wgsl"),
];

pub fn argmax(
    k: &Kernels,
    vocab: usize,
    logits: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len("argmax: logits", logits, vocab)?;
    let wg = k.max_workgroup();
    let consts = [("WG", Const::U32(wg)), ("V", Const::U32(vocab as u32))];
    let pipeline = k.pipeline("argmax", SOURCES, &consts, &[], false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, "argmax", &[(0, logits), (1, ctrl)]),
        pipeline,
        workgroups: (1, 1, 1),
        name: "argmax".into(),
        per_token: None,
        section: Section::Other,
        label: Label::default(),
    })
}
