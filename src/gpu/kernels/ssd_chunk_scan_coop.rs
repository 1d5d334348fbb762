//! `ssd_chunk_scan_coop.wgsl`: `ssd_chunk_scan` on cooperative matrices (f16 operands, f32
//! sums that start from the exact D·x), where the device has them and the mixer's shape
//! fits its tiles (chunk and head dim multiples of 64, state a multiple of 32, rows of `u`
//! in whole vec4s) and `y` has rows for whole chunks (the last chunk's rows past the block
//! get zeros). Without the feature the same kernel runs with stand-ins for the cooperative
//! ops (`emulate`: the tests on lavapipe).

use super::chunk::ChunkConsts;
use super::ssd_chunk_scan::ScanBuffers;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

const SOURCE: &str = include_str!("../../../shaders/ssd_chunk_scan_coop.wgsl");
/// How it reads `u` (f16 or f32: `ChunkConsts::u_f16`).
const CONV_OUT: &str = include_str!("../../../shaders/conv_out.wgsl");
const EMULATED: super::Sources = &[CONV_OUT, SOURCE];
const COOP: super::Sources = &["enable wgpu_cooperative_matrix;\n", CONV_OUT, SOURCE];

/// Whether the kernel takes this mixer's shape.
pub fn takes(cc: &ChunkConsts) -> bool {
    cc.q.is_multiple_of(64)
        && cc.head_dim.is_multiple_of(64)
        && cc.d_state.is_multiple_of(32)
        && cc.conv_dim.is_multiple_of(4)
        && cc.d_inner.is_multiple_of(4)
}

/// Values of `y` the kernel writes: whole chunks of rows.
pub fn y_len(cc: &ChunkConsts) -> usize {
    cc.chunks() * cc.q * cc.d_inner
}

/// Whether it serves this mixer on this device with this `y`.
pub fn applies(k: &Kernels, cc: &ChunkConsts, y: &wgpu::Buffer) -> bool {
    k.ctx.caps.coop_kernels() && takes(cc) && y.size() >= 4 * y_len(cc) as u64
}

/// `y [T][d_inner]` of a block on the tensor cores (or their stand-ins with `emulate`); the
/// rows of the last chunk past the block are scratch. Same buffers as `ssd_chunk_scan`.
pub fn ssd_chunk_scan_coop(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    d_off: usize,
    b: ScanBuffers,
    emulate: bool,
) -> Result<Dispatch> {
    if !takes(&cc) {
        return Err(Error::Gpu(format!(
            "{name}: the cooperative chunk scan takes chunks and head dims that are multiples \
             of 64 and states of 32, not {}, {} and {}",
            cc.q, cc.head_dim, cc.d_state
        )));
    }
    super::require_coop(k, name, emulate)?;
    check_len(&format!("{name}: y"), b.y, y_len(&cc))?;
    let Some(cst16) = b.cst16 else {
        return Err(Error::Gpu(format!(
            "{name}: the cooperative chunk scan reads the entering states in f16 (`cst16`, \
             from ssd_state_pass); none was given"
        )));
    };
    check_len(&format!("{name}: cst16"), cst16, cc.states_f16_words())?;
    check_len(&format!("{name}: u"), b.u, cc.u_words())?;
    let mut consts = cc.consts();
    consts.push(("D_OFF", Const::U32(d_off as u32)));
    let mut flags = Vec::new();
    cc.u_flag(&mut flags);
    let sources = super::coop_sources(COOP, EMULATED, emulate, &mut flags);
    let pipeline = k.pipeline("ssd_chunk_scan_coop", sources, &consts, &flags, false)?;
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
                (4, cst16),
                (5, b.y),
                (6, b.ctrl),
            ],
        ),
        pipeline,
        workgroups: (
            ((cc.q / 64) * (cc.head_dim / 64)) as u32,
            cc.heads as u32,
            cc.chunks() as u32,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}
