//! `norm_tail.wgsl`: the next block's RMS pre-norm, made in the epilogue of the one-token
//! kernel that finishes the residual (the experts' last down pass, `expert_gemv`; a block's
//! last GEMV adding into the residual, `gemv`), so the norm's own dispatch goes. Shapes:
//! the residual `[M]` (d_model); out: the q8 blocks of `x ⊙ w` without the 1/rms,
//! `xq [⌈M/32⌉·8]`, `xd [⌈M/32⌉]`, and Σx² per block of 32 rows, `part [⌈M/32⌉]`, which
//! the next GEMV turns into the 1/rms (`GemvInput::Group` with one group of M);
//! `counts [⌈M/32⌉]` (u32, zero between tokens) say which workgroup of a block came last.

use super::{Kernels, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

pub const NORM_TAIL: &str = include_str!("../../../shaders/norm_tail.wgsl");

/// The tail's buffers, and the norm weights `params [nw_off..nw_off + M]`.
pub struct NormTail<'a> {
    pub params: &'a wgpu::Buffer,
    pub nw_off: usize,
    pub xq: &'a wgpu::Buffer,
    pub xd: &'a wgpu::Buffer,
    pub part: &'a wgpu::Buffer,
    pub counts: &'a wgpu::Buffer,
}

/// The storage buffers the tail adds to its kernel.
pub const BUFFERS: u32 = 5;

/// Whether workgroups of `rows` rows tile the q8 blocks: several to a block, or whole
/// blocks each.
pub fn tiles_blocks(rows: usize) -> bool {
    rows > 0 && (32 % rows == 0 || rows.is_multiple_of(32))
}

/// Whether the device binds a kernel of `others` storage buffers plus the tail's.
pub fn binds(k: &Kernels, others: u32) -> bool {
    k.ctx.device.limits().max_storage_buffers_per_shader_stage >= others + BUFFERS
}

/// Checks the tail's buffers for `m` residual rows made by workgroups of `rows` rows each
/// and adds its flags, constants and bindings to the kernel's.
#[allow(clippy::too_many_arguments)]
pub fn add<'a>(
    k: &Kernels,
    name: &str,
    n: &NormTail<'a>,
    m: usize,
    rows: usize,
    flags: &mut Vec<&'static str>,
    consts: &mut Vec<(&'static str, Const)>,
    entries: &mut Vec<(u32, &'a wgpu::Buffer)>,
) -> Result<()> {
    if !tiles_blocks(rows) {
        return Err(Error::Gpu(format!(
            "{name}: workgroups of {rows} rows do not tile the next pre-norm's q8 blocks (a \
             divisor or a multiple of 32 rows do)"
        )));
    }
    let blocks = m.div_ceil(32);
    check_len(&format!("{name}: norm params"), n.params, n.nw_off + m)?;
    check_len(&format!("{name}: norm xq"), n.xq, blocks * 8)?;
    check_len(&format!("{name}: norm xd"), n.xd, blocks)?;
    check_len(&format!("{name}: norm part"), n.part, blocks)?;
    check_len(&format!("{name}: norm counts"), n.counts, blocks)?;
    flags.extend(["NORM_TAIL", "Q8_OUT", "Q8_BLOCK"]);
    if let Some(piece) = k.q8_shuffle() {
        flags.push("Q8_SHUFFLE");
        consts.push(piece);
    }
    let u = |v: usize| Const::U32(v as u32);
    consts.extend([
        ("NB", u(blocks)),
        ("NW_OFF", u(n.nw_off)),
        ("TR", u(rows.max(32))),
    ]);
    entries.extend([
        (17, n.xq),
        (18, n.xd),
        (19, n.params),
        (20, n.part),
        (21, n.counts),
    ]);
    Ok(())
}
