//! `advance.wgsl`: in a prefill through the decode graph, the next embed reads the next
//! prompt token (`prompt [n]`, cursor in the control block).

use super::{Dispatch, Kernels, Label, Section};
use crate::error::Result;

const SOURCES: super::Sources = &[include_str!("../../../shaders/advance.wgsl")];

pub fn advance(k: &Kernels, prompt: &wgpu::Buffer, ctrl: &wgpu::Buffer) -> Result<Dispatch> {
    let pipeline = k.pipeline("advance", SOURCES, &[], &[], false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, "advance", &[(0, prompt), (1, ctrl)]),
        pipeline,
        workgroups: (1, 1, 1),
        name: "advance".into(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Other,
        label: Label::default(),
    })
}
