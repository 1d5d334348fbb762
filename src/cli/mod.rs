//! clap definitions and dispatch for the `mamba2` binary.

/// `println!` for a command's output that returns an error naming stdout, instead of
/// panicking, when stdout is closed or full (`mamba2 info | head -1`, `> /dev/full`).
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($arg)*).map_err($crate::cli::stdout_failed)?
    }};
}

/// `print!` as `outln!` does it.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout(), $($arg)*).map_err($crate::cli::stdout_failed)?
    }};
}

#[cfg(feature = "ui")]
mod app;
mod bench;
mod chat;
mod devices;
mod generate;
mod info;
#[cfg(feature = "ui")]
mod inspect;
mod perplexity;
mod serve;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, anyhow, bail};
use clap::{Args, Parser, Subcommand};
use mamba2_wgpu::gpu::context::pick_adapter;
use mamba2_wgpu::{DeviceChoice, Sampling};

#[derive(Parser)]
#[command(name = "mamba2", version, about = "Portable Mamba2 inference on wgpu")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Continue a prompt, streaming the text as it is produced.
    Generate(generate::GenerateArgs),
    /// A terminal conversation that carries the state between turns.
    Chat(chat::ChatArgs),
    /// Describe a model: format, normalized config, parameters, dtypes, state size.
    Info(info::InfoArgs),
    /// Perplexity of a text file (window by window from a fresh state).
    Perplexity(perplexity::PerplexityArgs),
    /// List the GPU adapters with their features and limits.
    Devices(devices::DevicesArgs),
    /// Decode speed at real model shapes (synthetic weights made on the GPU).
    Bench(bench::BenchArgs),
    /// An OpenAI-compatible HTTP server with a prefix cache.
    Serve(serve::ServeArgs),
    /// The desktop chat window.
    #[cfg(feature = "ui")]
    App(app::AppArgs),
    /// The kernel-timing and state inspector window.
    #[cfg(feature = "ui")]
    Inspect(inspect::InspectArgs),
}

/// Where the model comes from.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model directory (config.json or params.json, *.safetensors, tokenizer.json), or a
    /// GGUF file (or a directory holding one); without it, the small model embedded in the
    /// binary.
    #[arg(long, short = 'm', value_name = "DIR|FILE.gguf")]
    pub model: Option<PathBuf>,
}

impl ModelArgs {
    /// The model and its tokenizer (when the directory has one).
    pub fn load(&self) -> anyhow::Result<(mamba2_wgpu::Model, Option<mamba2_wgpu::Tokenizer>)> {
        let loaded = match &self.model {
            Some(path) => mamba2_wgpu::Model::load_with_tokenizer(path)?,
            None => {
                let (m, t) = mamba2_wgpu::assets::embedded()?;
                (m, Some(t))
            }
        };
        for n in &loaded.0.config.notices {
            eprintln!("note: {n}");
        }
        Ok(loaded)
    }

    /// The model, and apart from it whether its tokenizer could be built: for `mamba2 info`,
    /// which describes a file whose tokenizer metadata it cannot use instead of failing.
    /// (The same tokenizer as `load`: the GGUF rule is `gguf_tokenizer::for_gguf_model`.)
    pub fn load_parts(
        &self,
    ) -> anyhow::Result<(
        mamba2_wgpu::Model,
        mamba2_wgpu::Result<Option<mamba2_wgpu::Tokenizer>>,
    )> {
        let loaded = match &self.model {
            Some(path) => {
                let model = mamba2_wgpu::Model::load(path)?;
                let tokenizer = match &model.gguf {
                    Some(g) => mamba2_wgpu::gguf_tokenizer::for_gguf_model(path, g),
                    None => mamba2_wgpu::Tokenizer::from_dir(path),
                };
                (model, tokenizer)
            }
            None => {
                let (m, t) = mamba2_wgpu::assets::embedded()?;
                (m, Ok(Some(t)))
            }
        };
        for n in &loaded.0.config.notices {
            eprintln!("note: {n}");
        }
        Ok(loaded)
    }

    /// The error for a loaded `model` without a tokenizer, for a command that needs text
    /// (`hint` says what to do instead): a GGUF file is named with the `tokenizer.ggml.*`
    /// keys it lacks, a directory with its missing tokenizer.json.
    pub fn no_tokenizer(&self, model: &mamba2_wgpu::Model, hint: &str) -> anyhow::Error {
        match &model.gguf {
            Some(g) => anyhow!("{}: {hint}", mamba2_wgpu::gguf_tokenizer::missing(g)),
            None => anyhow!("{} has no tokenizer.json: {hint}", self.name()),
        }
    }

    /// Refuses a model directory without `tokenizer.json` before its weights are read, for
    /// a command that needs text (`hint` says what to do instead). A directory holding one
    /// GGUF file passes (its metadata is judged once read), one holding several is refused
    /// with `gguf_path`'s message naming them. A directory that does not exist is left to
    /// `load`, whose message says so.
    pub fn require_tokenizer(&self, hint: &str) -> anyhow::Result<()> {
        match &self.model {
            Some(dir) if dir.is_dir() && !dir.join("tokenizer.json").exists() => {
                match mamba2_wgpu::model::gguf::gguf_path(dir)? {
                    Some(_) => Ok(()),
                    None => bail!("{} has no tokenizer.json: {hint}", self.name()),
                }
            }
            _ => Ok(()),
        }
    }

    /// How to name the model in messages.
    pub fn name(&self) -> String {
        match &self.model {
            Some(dir) => dir.display().to_string(),
            None => mamba2_wgpu::assets::NAME.to_string(),
        }
    }
}

/// Which device runs the model and how its weights are stored there: what every
/// front-end honors, the windows (`app`, `inspect`) included.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// auto (a hardware GPU, else the CPU reference; a software adapter such as lavapipe
    /// only with `gpu`), cpu, gpu, gpu:INDEX or gpu:NAME.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Storage of the big matrices on the GPU: f32, f16, bf16, q8_0, q6_k, q5_k, q5_1, q5_0,
    /// q4_k, q4_1 or q4_0 (default: f16; for a GGUF file, its most common block type, with
    /// every block-format tensor used as stored, f32 for an F32 file, bf16 for a BF16 one;
    /// `mamba2 info` says).
    #[arg(long)]
    pub dtype: Option<mamba2_wgpu::WeightFormat>,
    /// Run the unfused graph (one kernel per op) instead of the fused one (also: MAMBA2_NO_FUSE=1).
    #[arg(long)]
    pub no_fuse: bool,
}

impl DeviceArgs {
    /// Resolves an explicit `gpu…` choice now, so that a missing adapter is said before
    /// a model is read (`auto` and `cpu` always resolve).
    pub fn check(&self) -> anyhow::Result<()> {
        check_device("--device", &self.device)
    }
}

/// Refuses a `gpu…` choice that names no adapter, naming `flag`.
pub fn check_device(flag: &str, choice: &DeviceChoice) -> anyhow::Result<()> {
    if let DeviceChoice::Gpu(which) = choice {
        let shown = which.as_ref().map_or("gpu".into(), |w| format!("gpu:{w}"));
        pick_adapter(choice).map_err(|e| anyhow!("{flag} {shown}: {e}"))?;
    }
    Ok(())
}

/// How the command-line runs feed the engine, on top of `DeviceArgs` (the windows do not
/// take these, so they do not offer them).
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// SSD chunk length of prefill, 8…256 (default: the model config's chunk_size).
    #[arg(long, value_name = "Q")]
    pub chunk_size: Option<usize>,
    /// Feed prompts token by token through the decode graph instead of the chunked prefill.
    #[arg(long)]
    pub prefill_by_decode: bool,
    /// Hybrid models: how the KV caches store K and V on the GPU, f16 or f32.
    #[arg(long, default_value = "f16")]
    pub kv: mamba2_wgpu::gpu::state_store::KvFormat,
}

impl EngineArgs {
    /// Every flag that can be judged without the model.
    pub fn check(&self) -> anyhow::Result<()> {
        check_chunk_size(self.chunk_size)?;
        self.device.check()
    }

    /// The engine options, with `context` tokens in the KV caches of hybrids (`None`: the
    /// config's, capped by the adapter).
    pub fn engine_options(
        &self,
        model: &mamba2_wgpu::Model,
        context: Option<usize>,
    ) -> mamba2_wgpu::EngineOptions {
        let mut o = mamba2_wgpu::EngineOptions {
            format: self
                .device
                .dtype
                .unwrap_or_else(|| model.preferred_format()),
            chunk_size: self.chunk_size,
            context,
            kv: self.kv,
            ..Default::default()
        };
        if self.prefill_by_decode {
            o.prefill = mamba2_wgpu::gpu::engine::PrefillMode::Decode;
        }
        if self.device.no_fuse {
            o.fused = false;
        }
        o
    }

    /// The backend for a loaded model, printing one-line notices (a CPU fallback, a capped
    /// KV cache).
    pub fn open(
        &self,
        model: &mamba2_wgpu::Model,
        context: Option<usize>,
    ) -> anyhow::Result<Box<dyn mamba2_wgpu::Backend>> {
        let mut backend = mamba2_wgpu::open_backend(
            model,
            &self.device.device,
            self.engine_options(model, context),
            &mut |n| eprintln!("note: {n}"),
        )?;
        // The CPU reference computes in f32 with its own graph: the GPU's flags change
        // nothing there, which is said rather than left to look as if they had worked.
        if backend.gpu().is_none() {
            note_ignored(
                [
                    (self.device.dtype.is_some(), "--dtype"),
                    (self.device.no_fuse, "--no-fuse"),
                    (self.prefill_by_decode, "--prefill-by-decode"),
                    (
                        self.kv != mamba2_wgpu::gpu::state_store::KvFormat::F16,
                        "--kv",
                    ),
                ],
                "on the CPU reference (it computes in f32)",
            );
        }
        Ok(backend)
    }
}

/// What a saved state must match to be loaded into `backend` running `model` as `engine`
/// says: the model's fingerprint, the weight (and KV) format, the block pattern.
pub fn state_key(
    model: &mamba2_wgpu::Model,
    engine: &EngineArgs,
    backend: &mut dyn mamba2_wgpu::Backend,
) -> mamba2_wgpu::state_file::StateKey {
    let format = if backend.gpu().is_some() {
        let o = engine.engine_options(model, None);
        if model.config.attention.is_some() {
            format!("{}+kv-{}", o.format.name(), o.kv.name())
        } else {
            o.format.name().to_string()
        }
    } else {
        "cpu-f32".to_string()
    };
    mamba2_wgpu::state_file::StateKey {
        model: model.fingerprint(),
        format,
        blocks: model.config.pattern(),
    }
}

/// A byte count written as `123`, `64K`, `512M`, `4G` or `1T` (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("`{s}`: expected a size like 512M or 4G")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{s}`: expected a size like 512M or 4G"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{s}`: too large"))
}

/// An f32 flag's value, refused by its own text where f32 cannot hold it (`1e39` would
/// otherwise become `inf` and be reported as such, `1e-50` a silent 0); range checks come
/// after, by flag.
pub fn parse_f32(s: &str) -> Result<f32, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    mamba2_wgpu::sampling::narrow_f32(v).map_err(|why| format!("`{s}` {why}"))
}

/// Refuses a `--chunk-size` the engine would refuse, before the model is read.
pub fn check_chunk_size(q: Option<usize>) -> anyhow::Result<()> {
    match q {
        Some(q) if !mamba2_wgpu::gpu::engine::CHUNK_SIZES.contains(&q) => bail!(
            "--chunk-size: must be in {}…{}, found {q}",
            mamba2_wgpu::gpu::engine::CHUNK_SIZES.start(),
            mamba2_wgpu::gpu::engine::CHUNK_SIZES.end()
        ),
        _ => Ok(()),
    }
}

/// Refuses a count below `min`, naming the flag.
pub fn check_at_least(flag: &str, value: usize, min: usize) -> anyhow::Result<()> {
    if value < min {
        bail!("{flag}: must be at least {min}, found {value}");
    }
    Ok(())
}

/// Refuses sampling values that have no meaning, naming the flag.
pub fn check_sampling(s: &Sampling) -> anyhow::Result<()> {
    match s.problem() {
        Some((option, why)) => bail!("--{option}: {why}"),
        None => Ok(()),
    }
}

/// A note when `--ctx` was given for a model whose state does not grow with the context
/// (no attention layers): the flag has nothing to size.
pub fn note_unused_ctx(model: &mamba2_wgpu::Model, ctx: Option<usize>) {
    let attention = model
        .config
        .count(mamba2_wgpu::config::BlockKind::Attention);
    if ctx.is_some() && attention == 0 {
        eprintln!(
            "note: --ctx has no effect: the model has no attention layers (its state has a fixed size)"
        );
    }
}

/// The UTF-8 text a flag names: `-` is stdin, anything else must be a regular file
/// (`/dev/zero` or a FIFO would be read forever). At most `MAX_TEXT_BYTES` either way.
pub fn read_text_arg(flag: &str, path: &Path) -> anyhow::Result<String> {
    use mamba2_wgpu::files::{MAX_TEXT_BYTES, human_bytes, read_text};
    if path != Path::new("-") {
        return read_text(path, MAX_TEXT_BYTES).with_context(|| flag.to_string());
    }
    let mut bytes = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_TEXT_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("{flag} -: reading stdin"))?;
    if bytes.len() as u64 > MAX_TEXT_BYTES {
        bail!(
            "{flag} -: stdin holds more than the {} this reads",
            human_bytes(MAX_TEXT_BYTES)
        );
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow!(
            "{flag} -: stdin is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

pub fn run() -> ExitCode {
    let cli = Cli::parse();
    log_to_stderr(matches!(cli.command, Command::Serve(_)));
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Info(a) => info::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Devices(a) => devices::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Serve(a) => serve::run(a),
        #[cfg(feature = "ui")]
        Command::App(a) => app::run(a),
        #[cfg(feature = "ui")]
        Command::Inspect(a) => inspect::run(a),
    };
    // What `out!` left in stdout's buffer (a last line without its end).
    let result = result.and_then(|()| {
        use std::io::Write as _;
        std::io::stdout().flush().map_err(stdout_failed)
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// This program's `tracing` events go to stderr (not other crates': a windowing library's
/// chatter is not the user's business): warnings such as a bad `MAMBA2_SHADER_CHECKS` or a
/// prefix-cache entry `serve` could not keep, and for `serve` its notices too, with the
/// time (batched decode on or off, prefix-cache files written). `MAMBA2_LOG=off|error|warn|
/// info|debug|trace` sets the level instead.
fn log_to_stderr(serve: bool) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::prelude::*;
    let default = match serve {
        true => LevelFilter::INFO,
        false => LevelFilter::WARN,
    };
    let level = match std::env::var("MAMBA2_LOG") {
        Err(_) => default,
        // (tracing's own names, any case.)
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            eprintln!("note: MAMBA2_LOG={v} ignored: want off, error, warn, info, debug or trace");
            default
        }),
    };
    let ours = Targets::new()
        .with_target("mamba2_wgpu", level)
        .with_target("mamba2", level);
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    // (Only fails where a subscriber is already set: none is.)
    let _ = match serve {
        true => tracing_subscriber::registry()
            .with(fmt.with_filter(ours))
            .try_init(),
        false => tracing_subscriber::registry()
            .with(fmt.without_time().with_filter(ours))
            .try_init(),
    };
}

/// A failed write of a command's output (`outln!`).
pub(crate) fn stdout_failed(e: std::io::Error) -> anyhow::Error {
    anyhow!("writing to stdout: {e}")
}

/// Says which of the flags given (`(given, flag)`) have no effect, and `why`, rather than
/// leave them to look as if they had worked.
pub(crate) fn note_ignored<const N: usize>(flags: [(bool, &str); N], why: &str) {
    let given: Vec<&str> = flags
        .into_iter()
        .filter_map(|(given, flag)| given.then_some(flag))
        .collect();
    if !given.is_empty() {
        eprintln!(
            "note: {} {} no effect {why}",
            given.join(", "),
            if given.len() == 1 { "has" } else { "have" }
        );
    }
}
