//! `ssd_cb_coop.wgsl`: `ssd_cb` on cooperative matrices (f16 operands, f32 sums), where
//! the device has them and the mixer's shape fits its tiles (chunk a multiple of 64, state
//! of 32, rows of `u` in whole vec4s). Without the feature the same kernel runs with
//! stand-ins for the cooperative ops (`emulate`: the tests on lavapipe).

use super::chunk::ChunkConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};

const SOURCE: &str = include_str!("../../../shaders/ssd_cb_coop.wgsl");
/// How it reads `u` (f16 or f32: `ChunkConsts::u_f16`).
const CONV_OUT: &str = include_str!("../../../shaders/conv_out.wgsl");
const EMULATED: super::Sources = &[CONV_OUT, SOURCE];
const COOP: super::Sources = &["enable wgpu_cooperative_matrix;\n", CONV_OUT, SOURCE];

/// Whether the kernel takes this mixer's shape.
pub fn takes(cc: &ChunkConsts) -> bool {
    cc.q.is_multiple_of(64)
        && cc.d_state.is_multiple_of(32)
        && cc.conv_dim.is_multiple_of(4)
        && cc.d_inner.is_multiple_of(4)
}

/// Whether it serves this mixer on this device.
pub fn applies(k: &Kernels, cc: &ChunkConsts) -> bool {
    k.ctx.caps.coop_kernels() && takes(cc)
}

/// `cb [NC][G][Q][Q]` (the 64×64 tiles on or below the diagonal; rows past the block get
/// zeros) on the tensor cores, or their stand-ins with `emulate`. Same buffers as `ssd_cb`.
pub fn ssd_cb_coop(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    u: &wgpu::Buffer,
    cb: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
    emulate: bool,
) -> Result<Dispatch> {
    if !takes(&cc) {
        return Err(Error::Gpu(format!(
            "{name}: the cooperative C·Bᵀ takes chunks that are multiples of 64 and states of \
             32, not {} and {}",
            cc.q, cc.d_state
        )));
    }
    super::require_coop(k, name, emulate)?;
    check_len(&format!("{name}: u"), u, cc.u_words())?;
    check_len(
        &format!("{name}: cb"),
        cb,
        cc.chunks() * cc.groups * cc.q * cc.q,
    )?;
    let mut flags = Vec::new();
    cc.u_flag(&mut flags);
    let sources = super::coop_sources(COOP, EMULATED, emulate, &mut flags);
    let pipeline = k.pipeline("ssd_cb_coop", sources, &cc.consts(), &flags, false)?;
    let tiles = (cc.q / 64) as u32;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &[(0, u), (1, cb), (2, ctrl)]),
        pipeline,
        workgroups: (tiles, tiles, (cc.chunks() * cc.groups) as u32),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}
