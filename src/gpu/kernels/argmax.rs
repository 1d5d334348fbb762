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

/// What the argmax reads.
#[derive(Clone, Copy)]
pub enum ArgmaxInput<'a> {
    /// `logits [lanes][V]`.
    Logits(&'a wgpu::Buffer),
    /// One token: the lm_head GEMV's `count` per-workgroup winners
    /// (`GemvBuffers::argmax_part`, 4 u32 each): the same token and non-finite flag from a
    /// few thousand values instead of the vocabulary (one workgroup reads them all, one
    /// memory round per LPT·WG of them).
    Parts(&'a wgpu::Buffer, u32),
}

/// Greedy choice for `lanes` lanes (one control block each); with `mixed`, only the lanes
/// whose temperature is ≤ 0 (`sample` serves the others).
pub fn argmax(
    k: &Kernels,
    vocab: usize,
    lanes: super::Lanes,
    mixed: bool,
    input: ArgmaxInput,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len("argmax: ctrl", ctrl, lanes.cap * super::CTRL_WORDS)?;
    let (src, n, parts) = match input {
        ArgmaxInput::Logits(l) => {
            check_len("argmax: logits", l, lanes.cap * vocab)?;
            (l, vocab, false)
        }
        ArgmaxInput::Parts(p, count) => {
            if lanes.cap > 1 || mixed {
                return Err(crate::error::Error::Gpu(
                    "argmax: lm_head partials serve one greedy token, not a batch".into(),
                ));
            }
            check_len("argmax: partials", p, 4 * count as usize)?;
            (p, count as usize, true)
        }
    };
    let wg = k.max_workgroup();
    // Loads in flight per invocation and round: the whole vocabulary in a few rounds (one
    // round per memory latency; 4 per round cost Nemotron 3 Nano's 131k logits 57 µs).
    let lpt = n.div_ceil(wg as usize).clamp(1, LOADS_PER_ROUND);
    let consts = [
        ("WG", Const::U32(wg)),
        ("V", Const::U32(vocab as u32)),
        ("NP", Const::U32(n as u32)),
        ("LPT", Const::U32(lpt as u32)),
    ];
    let mut flags: Vec<&str> = Vec::new();
    if mixed {
        flags.push("ONLY_GREEDY");
    }
    if parts {
        flags.push("PARTS");
    }
    let pipeline = k.pipeline("argmax", SOURCES, &consts, &flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, "argmax", &[(0, src), (1, ctrl)]),
        pipeline,
        workgroups: (lanes.n as u32, 1, 1),
        name: "argmax".into(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Other,
        label: Label::default(),
    })
}
