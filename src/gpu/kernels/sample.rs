//! `sample.wgsl`: seeded temperature / top-k / top-p sampling over `logits [V]` into the
//! control block (which carries the options); `probs [V]` is scratch. A NaN or ±Inf logit
//! sets `ctrl.nonfinite` (the token stays inside the vocabulary).

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/emit.wgsl"),
    include_str!("../../../shaders/sample.wgsl"),
];

/// Sampling for `lanes` lanes (`logits`, `probs [lanes][V]`, one control block each); with
/// `mixed`, only the lanes whose temperature is above 0 (`argmax` serves the others).
pub fn sample(
    k: &Kernels,
    vocab: usize,
    lanes: super::Lanes,
    mixed: bool,
    logits: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
    probs: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len("sample: logits", logits, lanes.cap * vocab)?;
    check_len("sample: probs", probs, lanes.cap * vocab)?;
    check_len("sample: ctrl", ctrl, lanes.cap * super::CTRL_WORDS)?;
    let consts = [("WG", Const::U32(256)), ("V", Const::U32(vocab as u32))];
    let flags: &[&str] = if mixed { &["ONLY_SAMPLED"] } else { &[] };
    let pipeline = k.pipeline("sample", SOURCES, &consts, flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, "sample", &[(0, logits), (1, ctrl), (2, probs)]),
        pipeline,
        workgroups: (lanes.n as u32, 1, 1),
        name: "sample".into(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Other,
        label: Label::default(),
    })
}
