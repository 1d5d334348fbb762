//! `ssd_step.wgsl`: one token's selective state update and output for every head.
//! Shapes: `mix [d_in_proj]` = [z | x B C | δ], `state [H][P][N]`, `y [H·P]`, and with
//! `gated` the partial sums `part [H][NPB]`.

use super::{Dispatch, Kernels, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/ssd_step.wgsl")];

/// Channels per workgroup.
pub const P_BLOCK: usize = 8;

/// Sizes of the scan and where A and D live in the layer's parameter buffer.
#[derive(Clone, Copy, Debug)]
pub struct SsdConsts {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub d_state: usize,
    pub d_inner: usize,
    pub conv_dim: usize,
    pub a_off: usize,
    pub d_off: usize,
}

impl SsdConsts {
    /// p-blocks per head (`NPB`).
    pub fn blocks(&self) -> usize {
        self.head_dim.div_ceil(self.pb())
    }
    fn pb(&self) -> usize {
        P_BLOCK.min(self.head_dim)
    }
}

pub struct SsdBuffers<'a> {
    pub mix: &'a wgpu::Buffer,
    pub params: &'a wgpu::Buffer,
    pub state: &'a wgpu::Buffer,
    pub y: &'a wgpu::Buffer,
    pub part: Option<&'a wgpu::Buffer>,
    pub ctrl: &'a wgpu::Buffer,
}

pub fn ssd_step(k: &Kernels, name: &str, c: SsdConsts, b: SsdBuffers) -> Result<Dispatch> {
    check_len(
        &format!("{name}: mix"),
        b.mix,
        c.d_inner + c.conv_dim + c.heads,
    )?;
    check_len(
        &format!("{name}: state"),
        b.state,
        c.heads * c.head_dim * c.d_state,
    )?;
    check_len(&format!("{name}: y"), b.y, c.d_inner)?;
    let u = |v: usize| Const::U32(v as u32);
    let consts = [
        ("WG", u(c.d_state)),
        ("RV", u(c.pb())),
        ("PB", u(c.pb())),
        ("NPB", u(c.blocks())),
        ("H", u(c.heads)),
        ("P", u(c.head_dim)),
        ("G", u(c.groups)),
        ("N", u(c.d_state)),
        ("DI", u(c.d_inner)),
        ("CD", u(c.conv_dim)),
        ("A_OFF", u(c.a_off)),
        ("D_OFF", u(c.d_off)),
    ];
    let mut flags = vec!["REDUCE"];
    let mut entries = vec![
        (0, b.mix),
        (1, b.params),
        (2, b.state),
        (3, b.y),
        (5, b.ctrl),
    ];
    if let Some(part) = b.part {
        check_len(&format!("{name}: part"), part, c.heads * c.blocks())?;
        flags.push("GATED");
        entries.push((4, part));
    }
    let pipeline = k.pipeline("ssd_step", SOURCES, &consts, &flags, true)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (c.blocks() as u32, c.heads as u32, 1),
        name: name.to_string(),
        section: Section::Ssd,
    })
}
