//! One Rust file per WGSL kernel: its specialization constants, bindings, dispatch size and
//! the shape checks done before anything is recorded. Every constructor returns a
//! `Dispatch` that the graph replays each token.

pub mod advance;
pub mod argmax;
pub mod attention_combine;
pub mod attention_decode;
pub mod attention_prefill;
pub mod attention_prefill_coop;
pub mod attn;
pub mod chunk;
pub mod conv_step;
pub mod embed;
pub mod expert_gemv;
pub mod fill;
pub mod gated_norm;
pub mod gemm;
pub mod gemm_coop;
pub mod gemm_reduce;
pub mod gemv;
pub mod kv_store;
pub mod mlp_act;
pub mod moe_combine;
pub mod moe_route;
pub mod moe_sort;
pub mod prefill_conv;
pub mod q8_rows;
pub mod residual_add;
pub mod rmsnorm;
pub mod sample;
pub mod ssd_cb;
pub mod ssd_cb_coop;
pub mod ssd_chunk_scan;
pub mod ssd_chunk_scan_coop;
pub mod ssd_chunk_state;
pub mod ssd_chunk_state_coop;
pub mod ssd_coop_check;
pub mod ssd_cumsum;
pub mod ssd_state_pass;
pub mod ssd_step;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::gpu::context::GpuContext;
use crate::gpu::shader::{self, Const};

/// Where a kernel's time is reported in the profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Section {
    Matmul,
    Conv,
    Ssd,
    Norm,
    Attn,
    Mlp,
    /// MoE blocks: router, routed experts and the shared expert.
    Moe,
    Other,
}

impl Section {
    pub const ALL: [Section; 8] = [
        Section::Matmul,
        Section::Conv,
        Section::Ssd,
        Section::Norm,
        Section::Attn,
        Section::Mlp,
        Section::Moe,
        Section::Other,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Section::Matmul => "MATMUL",
            Section::Conv => "CONV",
            Section::Ssd => "SSD",
            Section::Norm => "NORM",
            Section::Attn => "ATTN",
            Section::Mlp => "MLP",
            Section::Moe => "MOE",
            Section::Other => "OTHER",
        }
    }
}

/// One recorded dispatch: pipeline, bindings and grid, plus a label for the profiler.
#[derive(Clone)]
pub struct Dispatch {
    pub pipeline: wgpu::ComputePipeline,
    pub bind_group: wgpu::BindGroup,
    /// The grid for a full block (prefill kernels: for their largest token count).
    pub workgroups: (u32, u32, u32),
    /// Prefill kernels and the decode attention: which grid axis counts tokens (rows in
    /// use), and how.
    pub per_token: Option<TokenAxis>,
    /// The same work on other pipelines for shorter blocks (prefill) or contexts (decode
    /// attention), as (most tokens, dispatch), fewest first; `record_tokens` takes the
    /// first that holds them (the cooperative GEMM's smaller tiles, which keep the GPU
    /// busy where a short block would leave the big tile few workgroups; the decode
    /// attention's narrower key tiles).
    pub shorter: Vec<(u32, Dispatch)>,
    pub name: String,
    pub section: Section,
    /// Where the dispatch sits in the model, for the profiler, bench and inspector.
    pub label: Label,
}

/// A dispatch's place in the model: its layer and block kind (none for the embedding,
/// head and sampler) and its kernel's role, e.g. `in_proj+conv` — read by the profiler,
/// `bench` and the inspector instead of parsing names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Label {
    pub layer: Option<usize>,
    pub block: Option<crate::config::BlockKind>,
    pub kernel: String,
    /// A GEMM's weight matrix, rows × columns: 2·rows·columns FLOPs per token (bench's
    /// TFLOP/s per shape).
    pub gemm: Option<(usize, usize)>,
}

/// A grid axis sized by the number of tokens of a prefill block, or by the KV cache rows in
/// use of a decode step (the decode attention's segments): `ceil(T / per) · mult`, at most
/// the recorded grid's.
#[derive(Clone, Copy, Debug)]
pub struct TokenAxis {
    /// 0, 1 or 2 for x, y, z.
    pub axis: usize,
    pub per: u32,
    pub mult: u32,
}

impl Label {
    /// The label of a GEMM over `w`, before it is placed in a layer.
    pub fn gemm(w: &crate::gpu::weights::DeviceMatrix) -> Self {
        Label {
            gemm: Some((w.rows, w.cols)),
            ..Label::default()
        }
    }
}

impl Dispatch {
    /// Records the dispatch alone (a grid for `tokens` tokens where it is a prefill
    /// kernel), submits it and waits: the load-time checks of the cooperative kernels.
    pub fn run_now(&self, ctx: &GpuContext, tokens: Option<u32>) -> Result<()> {
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            self.record_tokens(&mut pass, tokens);
        }
        ctx.queue.submit([enc.finish()]);
        ctx.wait()
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        self.record_tokens(pass, None);
    }

    /// Records the dispatch; prefill kernels get a grid for `tokens` tokens only, the
    /// decode attention one for `tokens` KV rows in use.
    pub fn record_tokens(&self, pass: &mut wgpu::ComputePass<'_>, tokens: Option<u32>) {
        if let Some(t) = tokens
            && let Some((_, d)) = self.shorter.iter().find(|(most, _)| t <= *most)
        {
            return d.record_tokens(pass, tokens);
        }
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        let mut g = [self.workgroups.0, self.workgroups.1, self.workgroups.2];
        if let (Some(t), Some(a)) = (tokens, self.per_token) {
            g[a.axis] = g[a.axis].min(t.div_ceil(a.per).max(1) * a.mult);
        }
        pass.dispatch_workgroups(g[0], g[1], g[2]);
    }

    /// Places the dispatch in layer `layer`, a `block` block: the name becomes
    /// `layers.{layer}.{kernel}`.
    pub fn at(mut self, layer: usize, block: crate::config::BlockKind) -> Self {
        self.label = Label {
            layer: Some(layer),
            block: Some(block),
            kernel: std::mem::take(&mut self.name),
            gemm: self.label.gemm,
        };
        self.name = format!("layers.{layer}.{}", self.label.kernel);
        self
    }

    /// The kernel's role (`in_proj+conv`, `lm_head`…), without the layer.
    pub fn kernel(&self) -> &str {
        if self.label.kernel.is_empty() {
            &self.name
        } else {
            &self.label.kernel
        }
    }

    /// Marks the grid axis that counts tokens (prefill kernels) or KV rows in use (the
    /// decode attention).
    pub fn per_token(mut self, axis: usize, per: usize, mult: usize) -> Self {
        self.per_token = Some(TokenAxis {
            axis,
            per: per as u32,
            mult: mult as u32,
        });
        self
    }
}

/// Compiles and caches pipelines by specialization, and builds bind groups.
#[derive(Clone)]
pub struct Kernels {
    pub ctx: Arc<GpuContext>,
    cache: Arc<Mutex<HashMap<String, wgpu::ComputePipeline>>>,
}

/// The control block of a prefill block of `tokens` tokens as a storage buffer, and `n`
/// inputs uniform in [lo, hi) from `seed`: what the load-time checks of the cooperative
/// kernels feed them.
pub(super) fn check_ctrl(ctx: &GpuContext, label: &str, tokens: usize) -> Result<wgpu::Buffer> {
    let c = crate::gpu::graph::Ctrl {
        prompt_len: tokens as u32,
        ..Default::default()
    };
    ctx.storage_with(label, bytemuck::bytes_of(&c))
}

pub(super) fn check_values(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| lo + (hi - lo) * crate::sampling::uniform(seed, i))
        .collect()
}

/// A kernel's source files after `common.wgsl`.
pub type Sources = &'static [&'static str];

/// What a cooperative-matrix kernel needs of the device: the real ops need the feature
/// (`emulate`: the stand-ins run anywhere).
pub(super) fn require_coop(k: &Kernels, name: &str, emulate: bool) -> Result<()> {
    if emulate || k.ctx.caps.coop_matrix {
        Ok(())
    } else {
        Err(Error::Gpu(format!(
            "{name}: this device has no cooperative matrices"
        )))
    }
}

/// A cooperative-matrix kernel's sources: `coop` (the real ops after their `enable`, and
/// the COOP flag), or its stand-ins `emulated` with `emulate`.
pub(super) fn coop_sources(
    coop: Sources,
    emulated: Sources,
    emulate: bool,
    flags: &mut Vec<&'static str>,
) -> Sources {
    if emulate {
        emulated
    } else {
        flags.push("COOP");
        coop
    }
}

impl Kernels {
    pub fn new(ctx: Arc<GpuContext>) -> Self {
        Kernels {
            ctx,
            cache: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// The kernels built so far, by name (one entry per specialization, sorted): what a
    /// graph runs on this device.
    pub fn built(&self) -> Vec<String> {
        let cache = self
            .cache
            .lock()
            .map(|c| c.keys().cloned().collect::<Vec<_>>());
        let mut names: Vec<String> = cache
            .unwrap_or_default()
            .iter()
            .filter_map(|k| k.split('|').next().map(str::to_string))
            .collect();
        names.sort();
        names
    }

    /// The pipeline of `name` specialized by `consts` and `flags` (SUBGROUP is added when
    /// the device has subgroups and `subgroups` is true).
    pub fn pipeline(
        &self,
        name: &str,
        sources: Sources,
        consts: &[(&str, Const)],
        flags: &[&str],
        subgroups: bool,
    ) -> Result<wgpu::ComputePipeline> {
        let mut flags: Vec<&str> = flags.to_vec();
        if subgroups && self.ctx.caps.subgroups {
            flags.push("SUBGROUP");
        }
        let key = format!("{name}|{consts:?}|{flags:?}");
        let mut cache = self
            .cache
            .lock()
            .map_err(|_| Error::Gpu("pipeline cache poisoned".into()))?;
        if let Some(p) = cache.get(&key) {
            return Ok(p.clone());
        }
        let p = shader::pipeline(&self.ctx.device, name, sources, consts, &flags)?;
        cache.insert(key, p.clone());
        Ok(p)
    }

    /// Whether reductions may shuffle within subgroups (subgroups of at least 4 lanes).
    pub fn shuffles(&self) -> bool {
        let caps = &self.ctx.caps;
        caps.subgroups && caps.subgroup_min >= 4
    }

    /// Constants and flags of `team_sum` for teams of `team` lanes (a power of two): with
    /// subgroups, shuffles within pieces of `min(team, smallest subgroup)` lanes.
    pub fn team(&self, team: u32) -> (Vec<(&'static str, Const)>, Vec<&'static str>) {
        let consts = vec![
            ("TEAM", Const::U32(team)),
            ("SUB", Const::U32(self.team_piece(team))),
        ];
        if self.shuffles() {
            (consts, vec!["TEAM_REDUCE", "TEAM_SHUFFLE"])
        } else {
            (consts, vec!["TEAM_REDUCE"])
        }
    }

    /// The pieces `team_sum` reduces by one butterfly for teams of `team` lanes (`SUB`).
    pub fn team_piece(&self, team: u32) -> u32 {
        if self.shuffles() {
            team.min(self.ctx.caps.subgroup_min)
        } else {
            team
        }
    }

    /// `q8_chunk`'s shuffle piece (a power of two of 4…32 lanes, at most the smallest
    /// subgroup) as its constant and flag, or none without subgroups of at least 4.
    pub fn q8_shuffle(&self) -> Option<(&'static str, Const)> {
        self.shuffles()
            .then(|| ("Q8SUB", Const::U32(self.ctx.caps.subgroup_min.min(32))))
    }

    /// The largest workgroup size (a power of two, at most 1024) the device allows.
    pub fn max_workgroup(&self) -> u32 {
        let max = self
            .ctx
            .limits
            .max_compute_invocations_per_workgroup
            .min(1024);
        1u32 << (31 - max.leading_zeros())
    }

    /// A bind group for group 0 of `pipeline` from `(binding, buffer)` pairs.
    pub fn bind(
        &self,
        pipeline: &wgpu::ComputePipeline,
        label: &str,
        entries: &[(u32, &wgpu::Buffer)],
    ) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> = entries
            .iter()
            .map(|(binding, buffer)| wgpu::BindGroupEntry {
                binding: *binding,
                resource: buffer.as_entire_binding(),
            })
            .collect();
        self.ctx
            .device
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(label),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            })
    }
}

/// A measuring switch `name=0|1`: None when unset; any other value is an error that names
/// the variable and what each value does (`off`, `on`).
pub fn env_switch(name: &str, off: &str, on: &str) -> Result<Option<bool>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(s) => match s.trim() {
            "0" => Ok(Some(false)),
            "1" => Ok(Some(true)),
            _ => Err(Error::InvalidInput(format!(
                "{name}={s}: want 0 ({off}) or 1 ({on})"
            ))),
        },
    }
}

/// Checks that `buffer` holds at least `count` 4-byte values; `what` names it.
pub fn check_len(what: &str, buffer: &wgpu::Buffer, count: usize) -> Result<()> {
    let need = 4 * count as u64;
    if buffer.size() < need {
        return Err(Error::Gpu(format!(
            "{what}: buffer of {} bytes is smaller than the {} values the kernel reads",
            buffer.size(),
            count
        )));
    }
    Ok(())
}

/// A workgroup grid covering `n` workgroups, folded into 2-D past the 65535 limit.
pub fn grid(n: u32) -> (u32, u32, u32) {
    if n <= GRID_X {
        (n.max(1), 1, 1)
    } else {
        (GRID_X, n.div_ceil(GRID_X), 1)
    }
}

/// The widest grid row `grid` makes (the spare workgroups of its last row are fewer).
pub const GRID_X: u32 = 65535;

/// The smallest power of two ≥ n, clamped to [lo, hi].
pub fn pow2_clamp(n: usize, lo: u32, hi: u32) -> u32 {
    (n.max(1).next_power_of_two() as u32).clamp(lo, hi)
}

/// `f32` constant for WGSL, with infinities replaced by the largest finite value.
pub fn finite(x: f64) -> Const {
    Const::F32(x.clamp(-3.4e38, 3.4e38) as f32)
}

/// 32-bit words of one lane's control block (`Ctrl`).
pub const CTRL_WORDS: usize = std::mem::size_of::<crate::gpu::graph::Ctrl>() / 4;

/// Decode lanes: `n` dispatched (lanes 0…n−1) over buffers that hold `cap` lanes' rows
/// side by side (the batch's sequence slots).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lanes {
    pub n: usize,
    pub cap: usize,
}

impl Lanes {
    /// One sequence.
    pub const ONE: Lanes = Lanes { n: 1, cap: 1 };

    /// `n` of `cap` lanes (n at least 1, at most cap).
    pub fn new(n: usize, cap: usize) -> Lanes {
        let cap = cap.max(1);
        Lanes {
            n: n.clamp(1, cap),
            cap,
        }
    }
}

/// The per-lane stride, in 32-bit words, of a buffer holding `lanes.cap` equal lane rows
/// side by side (0 for one lane: lane 0 starts at 0 whatever the buffer's size).
pub fn lane_stride(buffer: &wgpu::Buffer, lanes: Lanes) -> u32 {
    if lanes.cap <= 1 {
        0
    } else {
        (buffer.size() / 4 / lanes.cap as u64) as u32
    }
}
