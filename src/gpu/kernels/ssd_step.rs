//! `ssd_step.wgsl`: one token's selective state update and output, over blocks of CB
//! consecutive channels. Shapes: `mix [d_in_proj]` = [z | x B C | δ], `state [H][P][N]`,
//! `y [H·P]`; gated: `part [d_inner/CB]`, and with q8 `xq [d_inner/4]`, `xd [d_inner/32]`.
//! Over `lanes` lanes every buffer holds the lanes' rows side by side (strides from the
//! buffer sizes; the state one slot per lane) and workgroup row y is the lane.
//! A state row's team: the one-token step gives a row up to 32 invocations (one 16-byte
//! state vector each for N = 128); a batch gives it fewer (`lanes_team`), each with
//! several vectors in flight, and replays the one-token team's reduction tree, so a lane's
//! y is bitwise its one-token y (`gpu_batch`).

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/ssd_step.wgsl")];

/// Sizes of the scan and where A, D and the mixer norm live in the layer's parameters.
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
    pub nw_off: usize,
}

impl SsdConsts {
    /// Channels per workgroup: 32 when the gated norm's groups split into 32-channel blocks
    /// (every released model), else the largest power of two that divides the group size.
    pub fn block(&self) -> usize {
        let gs = self.d_inner / self.groups;
        [32, 16, 8, 4, 2, 1]
            .into_iter()
            .find(|b| gs.is_multiple_of(*b))
            .unwrap_or(1)
    }

    /// Channel blocks (workgroups, and entries of `part`).
    pub fn blocks(&self) -> usize {
        self.d_inner / self.block()
    }
}

/// The buffers of the SSD step; `part` selects the gated (fused) variant, `q8` its q8
/// activation output.
pub struct SsdBuffers<'a> {
    pub mix: &'a wgpu::Buffer,
    pub params: &'a wgpu::Buffer,
    pub state: &'a wgpu::Buffer,
    pub y: &'a wgpu::Buffer,
    pub part: Option<&'a wgpu::Buffer>,
    pub q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
    pub ctrl: &'a wgpu::Buffer,
    /// Lanes side by side (`Lanes::ONE`: one token).
    pub lanes: super::Lanes,
}

pub fn ssd_step(k: &Kernels, name: &str, c: SsdConsts, b: SsdBuffers) -> Result<Dispatch> {
    let lanes = b.lanes;
    let cap = lanes.cap;
    let ls = |buf: &wgpu::Buffer| Const::U32(super::lane_stride(buf, lanes));
    check_len(
        &format!("{name}: mix"),
        b.mix,
        cap * (c.d_inner + c.conv_dim + c.heads),
    )?;
    check_len(
        &format!("{name}: state"),
        b.state,
        cap * c.heads * c.head_dim * c.d_state,
    )?;
    check_len(&format!("{name}: y"), b.y, cap * c.d_inner)?;
    check_len(&format!("{name}: ctrl"), b.ctrl, cap * super::CTRL_WORDS)?;
    let cb = c.block();
    // A row's team: up to 32 lanes (a warp reads a whole row of N = 128 contiguously, four
    // columns per lane when N is a multiple of 4), no more than the state columns (or
    // groups of four), within the device's workgroup size.
    let vec4 = c.d_state.is_multiple_of(4);
    let columns = if vec4 { c.d_state / 4 } else { c.d_state };
    let rteam = 32
        .min(columns.next_power_of_two())
        .min(k.max_workgroup() as usize / cb)
        .max(1);
    let rsub = k.team_piece(rteam as u32) as usize;
    let team = if vec4 && cap > 1 {
        lanes_team(rteam, rsub)
    } else {
        rteam
    };
    let u = |v: usize| Const::U32(v as u32);
    let (team_consts, team_flags) = k.team(team as u32);
    let mut consts = vec![
        ("WG", u(cb * team)),
        ("CB", u(cb)),
        ("H", u(c.heads)),
        ("P", u(c.head_dim)),
        ("G", u(c.groups)),
        ("N", u(c.d_state)),
        ("DI", u(c.d_inner)),
        ("CD", u(c.conv_dim)),
        ("A_OFF", u(c.a_off)),
        ("D_OFF", u(c.d_off)),
        ("NW_OFF", u(c.nw_off)),
        ("NB", u(c.d_inner / 32)),
        ("SPL", u(columns.div_ceil(team))),
        ("FQ", u(rteam / team)),
        ("RTEAM", u(rteam)),
        ("RSUB", u(rsub)),
        ("MIX_LS", ls(b.mix)),
        ("STATE_LS", ls(b.state)),
        ("Y_LS", ls(b.y)),
        ("PART_LS", b.part.map_or(Const::U32(0), ls)),
        ("XQ_LS", b.q8.map_or(Const::U32(0), |q| ls(q.0))),
        ("XD_LS", b.q8.map_or(Const::U32(0), |q| ls(q.1))),
    ];
    consts.extend(team_consts);
    let mut flags = team_flags;
    if vec4 {
        flags.push("VEC4");
    }
    let mut entries = vec![
        (0, b.mix),
        (1, b.params),
        (2, b.state),
        (3, b.y),
        (5, b.ctrl),
    ];
    if let Some(part) = b.part {
        check_len(&format!("{name}: part"), part, cap * c.blocks())?;
        flags.push("GATED");
        entries.push((4, part));
        if let Some((q, d)) = b.q8 {
            if cb != 32 {
                return Err(Error::Gpu(format!(
                    "{name}: q8 output needs 32-channel blocks, the groups allow {cb}"
                )));
            }
            check_len(&format!("{name}: xq"), q, cap * c.d_inner / 4)?;
            check_len(&format!("{name}: xd"), d, cap * c.d_inner / 32)?;
            flags.push("Q8_OUT");
            entries.extend([(6, q), (7, d)]);
        }
    }
    let pipeline = k.pipeline("ssd_step", SOURCES, &consts, &flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (c.blocks() as u32, lanes.n as u32, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}

/// The lanes per state row of the batched step: 16 by default (two 16-byte state vectors
/// each for N = 128, both issued before the first sum; Codestral q8_0 at 16 lanes, H200,
/// GPU ms per step: 32 lanes (the one-token team) 3.29–3.52, 16: 2.69, 8: 2.81–2.84, 4:
/// 3.20, runs 100–102) or `MAMBA2_SSD_LANES_TEAM`, kept to a divisor of the one-token team
/// `rteam` no larger than its shuffle piece `rsub`, where the one-token butterfly can be
/// replayed exactly (lavapipe's 8-wide subgroups get 8).
fn lanes_team(rteam: usize, rsub: usize) -> usize {
    // `check_overrides` refused anything but a power of two of 1…32.
    let want = std::env::var("MAMBA2_SSD_LANES_TEAM")
        .ok()
        .and_then(|s| parse_lanes_team(&s).ok())
        .unwrap_or(16);
    want.min(rsub).min(rteam).max(1)
}

fn parse_lanes_team(s: &str) -> Result<usize> {
    match s.trim().parse::<usize>() {
        Ok(t) if t.is_power_of_two() && t <= 32 => Ok(t),
        _ => Err(Error::InvalidInput(format!(
            "MAMBA2_SSD_LANES_TEAM={s}: want 1, 2, 4, 8, 16 or 32 lanes per state row"
        ))),
    }
}

/// The batched step's tuning override (MAMBA2_SSD_LANES_TEAM), checked before a device is
/// made.
pub fn check_overrides() -> Result<()> {
    if let Ok(s) = std::env::var("MAMBA2_SSD_LANES_TEAM") {
        parse_lanes_team(&s)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_team_override_is_a_power_of_two_up_to_32() {
        for ok in ["1", "4", " 8", "32"] {
            assert!(parse_lanes_team(ok).is_ok(), "{ok}");
        }
        for bad in ["0", "3", "64", "eight", ""] {
            let e = parse_lanes_team(bad).unwrap_err().to_string();
            assert!(e.contains("MAMBA2_SSD_LANES_TEAM"), "{bad}: {e}");
        }
    }
}
