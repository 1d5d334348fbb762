//! `ssd_chunk_scan.wgsl`: `y [T][d_inner]` of a block from the chunk states, CB, the
//! cumsums and D·x (on the tensor cores, `ssd_chunk_scan_coop`, where they serve the shape
//! and `y` has rows for whole chunks).

use super::chunk::ChunkConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/tile64.wgsl"),
    include_str!("../../../shaders/ssd_chunk_scan.wgsl"),
];

/// The buffers of the chunk scan.
pub struct ScanBuffers<'a> {
    pub mix: &'a wgpu::Buffer,
    pub u: &'a wgpu::Buffer,
    pub params: &'a wgpu::Buffer,
    pub lam: &'a wgpu::Buffer,
    pub cb: &'a wgpu::Buffer,
    /// The states entering the chunks, f32 (what the FMA tiles read).
    pub cst: &'a wgpu::Buffer,
    /// The same in f16 (`ssd_state_pass`'s `cst16`), what the tensor-core kernel reads;
    /// it needs them.
    pub cst16: Option<&'a wgpu::Buffer>,
    pub y: &'a wgpu::Buffer,
    pub ctrl: &'a wgpu::Buffer,
}

pub fn ssd_chunk_scan(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    d_off: usize,
    b: ScanBuffers,
) -> Result<Dispatch> {
    if super::ssd_chunk_scan_coop::applies(k, &cc, b.y) {
        let emulate = !k.ctx.caps.coop_matrix;
        return super::ssd_chunk_scan_coop::ssd_chunk_scan_coop(k, name, cc, d_off, b, emulate);
    }
    cc.require_u_f32(name)?;
    check_len(&format!("{name}: y"), b.y, cc.max_tokens * cc.d_inner)?;
    let mut consts = cc.consts();
    consts.push(("D_OFF", Const::U32(d_off as u32)));
    let pipeline = k.pipeline("ssd_chunk_scan", SOURCES, &consts, &[], false)?;
    let tiles = cc.q.div_ceil(64) * cc.head_dim.div_ceil(64);
    Ok(Dispatch {
        bind_group: k.bind(
            &pipeline,
            name,
            &[
                (0, b.mix),
                (7, b.u),
                (1, b.params),
                (2, b.lam),
                (3, b.cb),
                (4, b.cst),
                (5, b.y),
                (6, b.ctrl),
            ],
        ),
        pipeline,
        workgroups: (tiles as u32, cc.heads as u32, cc.chunks() as u32),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}
