//! `argmax.wgsl`: greedy choice over `logits [V]` into the control block; a NaN or ±Inf
//! logit sets `ctrl.nonfinite` (the token stays inside the vocabulary).

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/emit.wgsl"),
    include_str!("../../../shaders/argmax.wgsl"),
];

/// The most loads an invocation issues per round.
const LOADS_PER_ROUND: usize = 16;

/// Greedy choice for `lanes` lanes (`logits [lanes][V]`, one control block each); with
/// `mixed`, only the lanes whose temperature is ≤ 0 (`sample` serves the others).
pub fn argmax(
    k: &Kernels,
    vocab: usize,
    lanes: super::Lanes,
    mixed: bool,
    logits: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len("argmax: logits", logits, lanes.cap * vocab)?;
    check_len("argmax: ctrl", ctrl, lanes.cap * super::CTRL_WORDS)?;
    let wg = k.max_workgroup();
    // Loads in flight per invocation and round: the whole vocabulary in a few rounds (one
    // round per memory latency; 4 per round cost Nemotron 3 Nano's 131k logits 57 µs).
    let lpt = vocab.div_ceil(wg as usize).clamp(1, LOADS_PER_ROUND);
    let consts = [
        ("WG", Const::U32(wg)),
        ("V", Const::U32(vocab as u32)),
        ("LPT", Const::U32(lpt as u32)),
    ];
    let flags: &[&str] = if mixed { &["ONLY_GREEDY"] } else { &[] };
    let pipeline = k.pipeline("argmax", SOURCES, &consts, flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, "argmax", &[(0, logits), (1, ctrl)]),
        pipeline,
        workgroups: (lanes.n as u32, 1, 1),
        name: "argmax".into(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Other,
        label: Label::default(),
    })
}
