//! `mamba2 bench`: decode speed at real model shapes with synthetic weights made on the
//! device, compared with the anchors of PERFORMANCE.md.

use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Args;
use mamba2_wgpu::bench::{PRESETS, decode, preset};
use mamba2_wgpu::gpu::context::{GpuContext, pick_adapter};
use mamba2_wgpu::gpu::{Engine, GpuBackend};
use mamba2_wgpu::{DeviceChoice, ModelConfig, WeightFormat};

use super::{check_at_least, check_chunk_size, check_device};

/// The most tokens any one bench flag may name (2^24: a 16M-token context is far past every
/// preset's; the sums of several stay far from overflow).
const MAX_COUNT: usize = 1 << 24;

#[derive(Args)]
pub struct BenchArgs {
    /// Model shapes: tiny, tiny-hybrid, 130m, 370m, 780m, 1.3b, 2.7b, codestral-7b,
    /// nemotron-h-8b, nemotron-nano-9b-v2, tiny-moe, nemotron-3-nano-30b-a3b,
    /// granite-4.0-h-tiny, granite-4.0-h-small (comma-separated list allowed).
    #[arg(long, default_value = "130m", value_delimiter = ',')]
    config: Vec<String>,
    /// Weight formats of the big matrices: f32, f16, bf16, q8_0, q6_k, q5_k, q5_1, q5_0, q4_k,
    /// q4_1, q4_0
    /// (comma-separated list allowed).
    #[arg(long, default_value = "f16", value_delimiter = ',')]
    dtype: Vec<WeightFormat>,
    /// Timed decode tokens (after warm-up).
    #[arg(long, default_value_t = 100)]
    tokens: usize,
    /// Untimed warm-up tokens.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Tokens decoded with GPU timestamps for the per-section split (0 = none) [default:
    /// 20].
    // An Option so that the CPU reference, which has no timestamps, can refuse it given.
    #[arg(long)]
    profile_tokens: Option<usize>,
    /// Benchmark the unfused graph (7 dispatches per layer) instead of the fused one.
    #[arg(long)]
    no_fuse: bool,
    /// Run both the fused and the unfused graph.
    #[arg(long, conflicts_with = "no_fuse")]
    both: bool,
    /// The device: gpu, gpu:INDEX, gpu:NAME, cpu (the f32 reference, decode only), or
    /// auto (a hardware GPU, else cpu).
    #[arg(long, default_value = "gpu")]
    device: DeviceChoice,
    /// Also time prompts of these lengths (chunked prefill), e.g. 512,4096.
    #[arg(long, value_delimiter = ',')]
    prefill: Vec<usize>,
    /// Timed runs per prefill length, cached prefix and batch size (after a first run and
    /// at least 2 s of warm-up runs) [default: 3].
    #[arg(long)]
    prefill_runs: Option<usize>,
    /// Skip the decode benchmark (with --prefill).
    #[arg(long)]
    no_decode: bool,
    /// SSD chunk length of prefill (default: the model's, 256).
    #[arg(long)]
    chunk_size: Option<usize>,
    /// Hybrids: time decode with this many tokens already in the KV caches, e.g.
    /// 1024,32768 (0 = an empty cache).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    ctx: Vec<usize>,
    /// Also time the first token of requests whose first N tokens are in the prefix cache
    /// (restored from a device snapshot and from host memory), e.g. 4096.
    #[arg(long, value_delimiter = ',', value_name = "N")]
    cached_prefix: Vec<usize>,
    /// New tokens after the cached prefix (with --cached-prefix) [default: 32].
    #[arg(long)]
    new_tokens: Option<usize>,
    /// Also time batched decode: this many sequences advanced together, e.g. 1,4,16,64
    /// (aggregate tokens/s; each lane checked against its run alone).
    #[arg(long, value_delimiter = ',', value_name = "B")]
    batch: Vec<usize>,
    /// Print JSON lines instead of text.
    #[arg(long)]
    json: bool,
}

impl BenchArgs {
    /// The configs, and every flag checked, before anything is built: a typo in the third
    /// config or a count of 0 is said at once, not after the first benchmarks ran.
    fn check(&self) -> anyhow::Result<Vec<(String, ModelConfig)>> {
        let configs = self
            .config
            .iter()
            .map(|name| {
                let config = preset(name).with_context(|| {
                    format!("--config: unknown `{name}` (one of {})", PRESETS.join(", "))
                })?;
                Ok((name.clone(), config))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Decode speed is a median of the gaps between tokens: it needs two.
        check_at_least("--tokens", self.tokens, 2)?;
        // The token counts are summed (with the runs multiplying some) into the context the
        // engine is sized for: each is bounded so those sums cannot overflow and a typo
        // cannot start a run of days.
        let counts = [
            ("--tokens", self.tokens),
            ("--warmup", self.warmup),
            ("--profile-tokens", self.profile_tokens()),
            ("--new-tokens", self.new_tokens()),
            ("--prefill-runs", self.prefill_runs()),
        ];
        let lists = [
            ("--ctx", &self.ctx),
            ("--prefill", &self.prefill),
            ("--cached-prefix", &self.cached_prefix),
        ];
        let too_big = counts.into_iter().chain(
            lists
                .into_iter()
                .filter_map(|(flag, l)| l.iter().max().map(|&m| (flag, m))),
        );
        for (flag, value) in too_big {
            if value > MAX_COUNT {
                bail!("{flag}: at most {MAX_COUNT} in a benchmark, found {value}");
            }
        }
        if let Some(0) = self.prefill.iter().copied().min() {
            bail!("--prefill: a prompt length must be at least 1, found 0");
        }
        let runs = self.times_runs();
        if runs {
            check_at_least("--prefill-runs", self.prefill_runs(), 1)?;
        }
        if self.no_decode && !runs {
            bail!("--no-decode: nothing left to time (add --prefill 512,4096)");
        }
        if let Some(0) = self.cached_prefix.iter().copied().min() {
            bail!("--cached-prefix: a prefix must be at least 1 token, found 0");
        }
        check_at_least("--new-tokens", self.new_tokens(), 1)?;
        if let Some(&b) = self.batch.iter().find(|&&b| !(1..=256).contains(&b)) {
            bail!("--batch: a batch holds 1…256 sequences, found {b}");
        }
        check_chunk_size(self.chunk_size)?;
        if self.device == DeviceChoice::Cpu {
            self.check_cpu_flags()?;
        }
        check_device("--device", &self.device)?;
        Ok(configs)
    }

    /// Whether anything besides decode is timed (prefill, cached prefixes, batches: the
    /// benchmarks `--prefill-runs` counts the runs of).
    fn times_runs(&self) -> bool {
        !self.prefill.is_empty() || !self.cached_prefix.is_empty() || !self.batch.is_empty()
    }

    /// Timed runs of each prefill length, cached prefix and batch: 3 unless given.
    fn prefill_runs(&self) -> usize {
        self.prefill_runs.unwrap_or(3)
    }

    /// Tokens fed after a cached prefix: 32 unless given.
    fn new_tokens(&self) -> usize {
        self.new_tokens.unwrap_or(32)
    }

    /// Notes the flags given without what they apply to.
    fn note_unused(&self) {
        super::note_ignored(
            [(
                self.prefill_runs.is_some() && !self.times_runs(),
                "--prefill-runs",
            )],
            "without --prefill, --cached-prefix or --batch",
        );
        super::note_ignored(
            [(
                self.new_tokens.is_some() && self.cached_prefix.is_empty(),
                "--new-tokens",
            )],
            "without --cached-prefix",
        );
    }

    /// Tokens decoded with timestamps: 20 unless given.
    fn profile_tokens(&self) -> usize {
        self.profile_tokens.unwrap_or(20)
    }

    /// The CPU reference times f32 decode from an empty state, nothing else: refuses the
    /// flags it would ignore.
    fn check_cpu_flags(&self) -> anyhow::Result<()> {
        let unused = [
            ("--prefill", !self.prefill.is_empty()),
            ("--cached-prefix", !self.cached_prefix.is_empty()),
            ("--batch", !self.batch.is_empty()),
            ("--no-decode", self.no_decode),
            ("--ctx", self.ctx.iter().any(|&c| c > 0)),
            ("--dtype", self.dtype != [WeightFormat::F16]),
            ("--no-fuse", self.no_fuse),
            ("--both", self.both),
            ("--chunk-size", self.chunk_size.is_some()),
            (
                "--profile-tokens",
                self.profile_tokens.is_some_and(|n| n > 0),
            ),
        ];
        match unused.iter().find(|(_, given)| *given) {
            Some((flag, _)) => bail!(
                "{flag}: the CPU reference benchmark times f32 decode from an empty state only (drop {flag} or use --device gpu)"
            ),
            None => Ok(()),
        }
    }
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let configs = args.check()?;
    args.note_unused();
    // `auto` as everywhere: a hardware GPU, else the CPU reference.
    let on_cpu = match &args.device {
        DeviceChoice::Cpu => true,
        DeviceChoice::Auto => {
            let none = pick_adapter(&DeviceChoice::Auto)?.is_none();
            if none {
                args.check_cpu_flags()?;
                eprintln!(
                    "note: no hardware GPU adapter: benchmarking the CPU reference (use --device gpu for a software one)"
                );
            }
            none
        }
        DeviceChoice::Gpu(_) => false,
    };
    if on_cpu {
        // The CPU reference: decode only, f32 weights in host memory.
        for (name, config) in &configs {
            let r = mamba2_wgpu::bench::decode_cpu(name, config, args.tokens, args.warmup)?;
            if args.json {
                outln!("{}", serde_json::to_string(&r)?);
            } else {
                outln!(
                    "{} f32 on the CPU reference ({} threads): {:.1} ms/token median over {} tokens = {:.1} tok/s",
                    r.config,
                    r.threads,
                    r.median_ms,
                    r.tokens,
                    r.tokens_per_s
                );
            }
        }
        return Ok(());
    }
    let fused_modes: Vec<bool> = match (args.both, args.no_fuse) {
        (true, _) => vec![true, false],
        (false, true) => vec![false],
        (false, false) => vec![true],
    };
    for (name, config) in &configs {
        let config = config.clone();
        for &format in &args.dtype {
            let adapter = pick_adapter(&args.device)?.context("no GPU adapter")?;
            let ctx = Arc::new(GpuContext::new(adapter, &Engine::needs(&config, format))?);
            for &fused in &fused_modes {
                if !args.json {
                    eprintln!(
                        "building {name} {} ({}) …",
                        format.name(),
                        if fused { "fused" } else { "unfused" }
                    );
                }
                // Room for the longest cached context plus every timed token, and for the
                // longest prompt.
                let longest = args.ctx.iter().max().copied().unwrap_or(0)
                    + args.warmup
                    + args.tokens
                    + args.profile_tokens()
                    + 8;
                let batched = if args.batch.is_empty() {
                    0
                } else {
                    args.warmup + args.tokens * args.prefill_runs() + 8
                };
                let longest = longest
                    .max(batched)
                    .max(args.prefill.iter().max().copied().unwrap_or(0))
                    .max(
                        args.cached_prefix
                            .iter()
                            .max()
                            .map_or(0, |p| p + args.new_tokens()),
                    );
                let opts = mamba2_wgpu::EngineOptions {
                    format,
                    fused,
                    chunk_size: args.chunk_size,
                    context: config.attention.as_ref().map(|_| longest),
                    ..Default::default()
                };
                // The engine's positions include the bench's own tokens: a refusal names
                // both, not a --ctx the user never gave.
                opts.context_for(
                    &config,
                    ctx.limits.max_storage_buffer_binding_size,
                    &mut |_| {},
                )
                .map_err(|e| {
                    let asked = args.ctx.iter().max().copied().unwrap_or(0);
                    let why = match &e {
                        mamba2_wgpu::Error::InvalidInput(m) => m
                            .strip_prefix(&format!("--ctx {longest}: "))
                            .unwrap_or(m)
                            .to_string(),
                        other => other.to_string(),
                    };
                    anyhow::anyhow!(
                        "the bench needs {longest} positions (--ctx {asked} plus {} for its \
                         warm-up, timed tokens and prompts): {why}",
                        longest - asked.min(longest)
                    )
                })?;
                let engine = Engine::synthetic(ctx.clone(), &config, opts, 7)?;
                let mut backend = GpuBackend::new(engine)?;
                if !args.no_decode {
                    let mut reports = Vec::new();
                    for &cached in &args.ctx {
                        let report = decode(
                            &mut backend,
                            name,
                            args.tokens,
                            args.warmup,
                            args.profile_tokens(),
                            cached,
                        )?;
                        show(args.json, &report, report.text())?;
                        reports.push(report);
                    }
                    if let Some(g) = mamba2_wgpu::bench::ContextGrowth::of(&reports) {
                        show(args.json, &g, g.text())?;
                    }
                }
                for &prefix in &args.cached_prefix {
                    let report = mamba2_wgpu::bench::cached_prefix(
                        &mut backend,
                        name,
                        prefix,
                        args.new_tokens(),
                        args.prefill_runs(),
                    )?;
                    show(args.json, &report, report.text())?;
                }
                for &b in &args.batch {
                    let report = mamba2_wgpu::bench::batch(
                        &mut backend,
                        name,
                        b,
                        args.tokens,
                        args.warmup,
                        args.prefill_runs(),
                    )?;
                    show(args.json, &report, report.text())?;
                }
                for &len in &args.prefill {
                    let report =
                        mamba2_wgpu::bench::prefill(&mut backend, name, len, args.prefill_runs())?;
                    show(args.json, &report, report.text())?;
                }
            }
        }
    }
    Ok(())
}

/// Prints a report: one JSON line with `--json`, else its text.
fn show(json: bool, report: &impl serde::Serialize, text: String) -> anyhow::Result<()> {
    if json {
        outln!("{}", serde_json::to_string(report)?);
    } else {
        out!("{text}");
    }
    Ok(())
}
