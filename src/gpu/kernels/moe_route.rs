//! `moe_route.wgsl`: the MoE router of `T` tokens — `logits [T, E]` (the router GEMV/GEMM's
//! output) → `ids [T, KS]` (u32, best first) and `weights [T, KS]`, `KS = K + S` slots: the
//! `K` chosen, then the `S` shared-expert slices (`MoeConfig::shared_slots`, weight 1) — on
//! the device so the host
//! never sees the routing; optionally `counts [COUNT_OFF + id]` += one per choice (expert load).
//! The grouped (Nemotron-H) router reads its correction bias from `params [bias_off..+E]`.

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::config::{MoeConfig, Router};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

/// The routing itself (`route_select.wgsl`), which the decode up pass also includes.
pub const ROUTE_SELECT: &str = include_str!("../../../shaders/route_select.wgsl");

const SOURCES: super::Sources = &[
    ROUTE_SELECT,
    include_str!("../../../shaders/moe_route.wgsl"),
];

/// The router's buffers.
pub struct RouteBuffers<'a> {
    pub logits: &'a wgpu::Buffer,
    /// The layer's parameters and where the correction bias starts (grouped router).
    pub params: Option<(&'a wgpu::Buffer, usize)>,
    pub ids: &'a wgpu::Buffer,
    pub weights: &'a wgpu::Buffer,
    /// Per-expert choice counters (u32) and where this layer's `E` start, or none.
    pub counts: Option<(&'a wgpu::Buffer, usize)>,
    /// Prefill: the control block whose `prompt_len` bounds the tokens.
    pub ctrl: Option<&'a wgpu::Buffer>,
}

/// Routes `tokens` tokens (decode: 1; prefill: the block capacity, `ctrl.prompt_len` live).
pub fn moe_route(
    k: &Kernels,
    name: &str,
    m: &MoeConfig,
    tokens: usize,
    b: RouteBuffers,
) -> Result<Dispatch> {
    let (e, slots) = (m.experts, m.slots());
    check_len(&format!("{name}: logits"), b.logits, tokens * e)?;
    check_len(&format!("{name}: ids"), b.ids, tokens * slots)?;
    check_len(&format!("{name}: weights"), b.weights, tokens * slots)?;
    // Eight invocations per candidate where the device allows (each counts the rivals of
    // its slice: the rank loop is the kernel's latency), at least 256 invocations.
    let wg = k
        .max_workgroup()
        .min((8 * e.next_power_of_two()).max(256) as u32);
    let RouteSpec {
        mut consts,
        mut flags,
        bias,
        counts,
        ..
    } = route_spec(name, m, wg, b.params, b.counts)?;
    consts.push(("WG", Const::U32(wg)));
    let mut entries = vec![(0, b.logits), (2, b.ids), (3, b.weights)];
    entries.extend(bias.map(|p| (1, p)));
    entries.extend(counts.map(|c| (4, c)));
    if let Some(c) = b.ctrl {
        flags.push("PROMPT");
        entries.push((5, c));
    }
    let pipeline = k.pipeline("moe_route", SOURCES, &consts, &flags, false)?;
    let bind_group = k.bind(&pipeline, name, &entries);
    let d = Dispatch {
        pipeline,
        bind_group,
        workgroups: (tokens as u32, 1, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Moe,
        label: Label::default(),
    };
    // (Only a prefill block's tokens size the grid: a batch's lanes are all routed, its
    // decode graph's token count being KV rows.)
    Ok(if tokens > 1 && b.ctrl.is_some() {
        d.per_token(0, 1, 1)
    } else {
        d
    })
}

/// `route_select.wgsl` specialized for a router: its constants and flags (the includer adds
/// `WG`), and the buffers it reads (`params` only for a grouped router) for the includer to
/// bind under its own binding numbers.
pub struct RouteSpec<'a> {
    pub consts: Vec<(&'static str, Const)>,
    pub flags: Vec<&'static str>,
    /// The parameters holding the correction bias (grouped routers).
    pub bias: Option<&'a wgpu::Buffer>,
    /// The expert-load counters.
    pub counts: Option<&'a wgpu::Buffer>,
    /// Invocations per candidate (`TPC`).
    pub tpc: usize,
}

/// `route_select.wgsl` for a workgroup of `wg` invocations: checks the router's shape, that
/// the `KS` slots fit the workgroup, and the correction bias and counters' lengths.
pub fn route_spec<'a>(
    name: &str,
    m: &MoeConfig,
    wg: u32,
    params: Option<(&'a wgpu::Buffer, usize)>,
    counts: Option<(&'a wgpu::Buffer, usize)>,
) -> Result<RouteSpec<'a>> {
    m.check()
        .map_err(|(field, msg)| Error::Gpu(format!("{name}: `{field}`: {msg}")))?;
    let (e, top, slots) = (m.experts, m.top_k, m.slots());
    if slots > wg as usize {
        return Err(Error::Gpu(format!(
            "{name}: {slots} expert slots per token, but a workgroup holds {wg} invocations"
        )));
    }
    // Invocations per candidate: the workgroup over the experts, a power of two.
    let tpc = (wg as usize / e.next_power_of_two()).max(1);
    let u = |v: usize| Const::U32(v as u32);
    let mut consts = vec![
        ("E", u(e)),
        ("K", u(top)),
        ("KS", u(slots)),
        ("TPC", u(tpc)),
    ];
    let mut flags = Vec::new();
    let mut bias = None;
    if let Router::Grouped {
        n_group,
        topk_group,
        norm_topk_prob,
        routed_scaling_factor,
    } = m.router
    {
        let (params, off) =
            params.ok_or_else(|| Error::Gpu(format!("{name}: no correction bias buffer given")))?;
        check_len(&format!("{name}: params"), params, off + e)?;
        flags.push("GROUPED");
        bias = Some(params);
        consts.extend([
            ("NG", u(n_group)),
            ("GS", u(e / n_group)),
            ("TG", u(topk_group)),
            ("NORM", u(norm_topk_prob as usize)),
            ("RSF", Const::F32(routed_scaling_factor as f32)),
            ("BIAS_OFF", u(off)),
        ]);
    }
    if let Some((c, off)) = counts {
        check_len(&format!("{name}: counts"), c, off + e)?;
        flags.push("COUNT");
        consts.push(("COUNT_OFF", u(off)));
    }
    Ok(RouteSpec {
        consts,
        flags,
        bias,
        counts: counts.map(|(c, _)| c),
        tpc,
    })
}
