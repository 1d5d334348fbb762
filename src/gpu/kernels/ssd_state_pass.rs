//! `ssd_state_pass.wgsl`: the state entering each chunk (over `cst`, or in f16 to `cst16`
//! for the tensor-core chunk scan), and the sequence's state `[H][P][N]` after the block.

use super::chunk::ChunkConsts;
use super::{Dispatch, Kernels, Label, Section, check_len, grid};
use crate::error::{Error, Result};

const SOURCE: &str = include_str!("../../../shaders/ssd_state_pass.wgsl");
const SOURCES: super::Sources = &[SOURCE];
const SOURCES_F16: super::Sources = &["enable f16;\n", SOURCE];

#[allow(clippy::too_many_arguments)]
pub fn ssd_state_pass(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    lam: &wgpu::Buffer,
    cst: &wgpu::Buffer,
    state: &wgpu::Buffer,
    cst16: Option<&wgpu::Buffer>,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    let hpn = cc.heads * cc.head_dim * cc.d_state;
    check_len(&format!("{name}: state"), state, hpn)?;
    // Four values per invocation when a head's P·N values split into 16-byte vectors.
    let vec4 = (cc.head_dim * cc.d_state).is_multiple_of(4);
    let v = if vec4 { 4 } else { 1 };
    let mut entries = vec![(0, lam), (1, cst), (2, state), (3, ctrl)];
    let (flags, sources): (&[&str], _) = match cst16 {
        Some(b) => {
            if !vec4 {
                return Err(Error::Gpu(format!(
                    "{name}: f16 entering states take P·N a multiple of 4, not {}",
                    cc.head_dim * cc.d_state
                )));
            }
            check_len(&format!("{name}: cst16"), b, cc.states_f16_words())?;
            entries.push((4, b));
            (&["VEC4", "S16"], SOURCES_F16)
        }
        None if vec4 => (&["VEC4"], SOURCES),
        None => (&[], SOURCES),
    };
    let pipeline = k.pipeline("ssd_state_pass", sources, &cc.consts(), flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: grid((hpn / v).div_ceil(256) as u32),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}
