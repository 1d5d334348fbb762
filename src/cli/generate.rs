//! `mamba2 generate`: stream a continuation of a prompt.

use std::io::Write;
use std::time::Instant;

use anyhow::bail;
use clap::Args;
use mamba2_wgpu::gpu::kernels::Section;
use mamba2_wgpu::{GenerateOptions, Sampling, Session};

use super::{
    EngineArgs, ModelArgs, check_at_least, check_sampling, note_unused_ctx, read_text_arg,
};

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Hybrid models: tokens the attention layers' KV caches hold (default: the config's
    /// max_position_embeddings, capped by what the adapter can bind).
    #[arg(long, value_name = "N")]
    ctx: Option<usize>,
    /// Print GPU time per kernel section and host time per token at the end.
    #[arg(long)]
    profile: bool,
    /// The prompt text (or use --prompt).
    #[arg(value_name = "PROMPT")]
    text: Option<String>,
    /// The prompt text.
    #[arg(long, short = 'p', conflicts_with = "text")]
    prompt: Option<String>,
    /// The prompt as token ids, e.g. 1,2,3 (for models without a tokenizer; prints ids).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["text", "prompt"])]
    prompt_ids: Option<Vec<u32>>,
    /// The prompt read from a UTF-8 text file (`-`: stdin), e.g. a document to continue.
    #[arg(long, short = 'f', value_name = "FILE", conflicts_with_all = ["text", "prompt", "prompt_ids"])]
    prompt_file: Option<std::path::PathBuf>,
    /// How many tokens to generate (0 reads the prompt and generates nothing; the summary
    /// line then times the prompt's reading).
    #[arg(short = 'n', long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    // Negative values are parsed so that `check` refuses them naming the flag (clap would
    // take `-1` for an unknown option).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = super::parse_f32)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the most likely tokens up to this probability mass (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = super::parse_f32)]
    top_p: f32,
    /// Seed of the sampler; the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
}

impl GenerateArgs {
    fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
        }
    }

    /// The prompt text, if given as text.
    fn text(&self) -> Option<&str> {
        self.text.as_deref().or(self.prompt.as_deref())
    }

    /// Every flag, before the model is read: a bad value is said at once, naming its flag,
    /// not after minutes of loading (or instead of a missing model's error).
    fn check(&self) -> anyhow::Result<()> {
        check_sampling(&self.sampling())?;
        self.engine.check()?;
        if let Some(ctx) = self.ctx {
            check_at_least("--ctx", ctx, 1)?;
        }
        match (&self.prompt_ids, self.text()) {
            (Some(ids), _) if ids.is_empty() => bail!("--prompt-ids: no ids given"),
            (Some(_), _) => Ok(()),
            (None, Some("")) => bail!("the prompt is empty"),
            (None, None) if self.prompt_file.is_none() => {
                bail!(
                    "give a prompt: `generate \"text\"`, --prompt TEXT, --prompt-file FILE or \
                     --prompt-ids 1,2,3"
                )
            }
            // Text, inline or in a file.
            (None, _) => self
                .model
                .require_tokenizer("pass the prompt as --prompt-ids"),
        }
    }
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    args.check()?;
    // Read before the model loads: a missing or binary file is refused at once.
    let file_text = match &args.prompt_file {
        Some(p) => {
            let text = read_text_arg("--prompt-file", p)?;
            if text.is_empty() {
                bail!("--prompt-file {}: empty", p.display());
            }
            Some(text)
        }
        None => None,
    };
    let (model, tokenizer) = args.model.load()?;
    note_unused_ctx(&model, args.ctx);
    let text = file_text.as_deref().or(args.text());
    // The model's end of text stops the reply whether the prompt came as text or as ids
    // (which print ids: the tokenizer is not used for them otherwise).
    let eos = tokenizer.as_ref().and_then(|t| t.eos);
    let (prompt, tokenizer) = match (&args.prompt_ids, text) {
        (Some(ids), _) => (ids.clone(), None),
        (None, text) => {
            let tok = tokenizer.ok_or_else(|| {
                args.model
                    .no_tokenizer(&model, "pass the prompt as --prompt-ids")
            })?;
            (tok.encode(text.unwrap_or_default())?, Some(tok))
        }
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let sampling = args.sampling();
    if sampling.temperature == 0.0 {
        super::note_ignored(
            [
                (args.top_k != 0, "--top-k"),
                (args.top_p != 1.0, "--top-p"),
                (args.seed != 0, "--seed"),
            ],
            "at --temperature 0 (greedy); give a temperature to sample",
        );
    }
    let stop = match args.ignore_eos {
        false => eos.into_iter().collect(),
        true => Vec::new(),
    };
    let opts = GenerateOptions {
        max_new_tokens: args.max_tokens,
        sampling,
        stop,
    };
    let mut session = Session::new(args.engine.open(&model, args.ctx)?);
    session.set_prompt_progress(Some(mamba2_wgpu::progress::prompt_progress()));
    if args.profile {
        match session.backend_mut().gpu() {
            Some(g) => {
                if !g.set_profiling(true)? {
                    eprintln!(
                        "note: this adapter has no timestamp queries; --profile shows nothing"
                    );
                }
            }
            None => eprintln!("note: --profile times GPU kernels; the CPU device has none"),
        }
    }

    let mut out = std::io::stdout().lock();
    let mut decoder = tokenizer.as_ref().map(|t| t.stream());
    // The prompt is echoed once it is read: a long one's progress bar (on stderr) would
    // otherwise clear the terminal line the echo ends on.
    let mut echo = Some(match &tokenizer {
        Some(t) => t.decode(&prompt)?,
        None => join_ids(&prompt),
    });
    let start = Instant::now();
    let mut first_at = None;
    let mut failure = None;
    let (reply, finish) = session.generate(&prompt, &opts, |id| {
        first_at.get_or_insert_with(Instant::now);
        if let Some(e) = echo.take() {
            let _ = write!(out, "{e}");
        }
        let piece = match (&tokenizer, decoder.as_mut()) {
            (Some(t), Some(d)) => match d.step(t, id) {
                Ok(p) => p,
                Err(e) => {
                    failure = Some(e);
                    return false;
                }
            },
            _ => Some(format!(",{id}")),
        };
        if let Some(p) = piece {
            let _ = write!(out, "{p}");
            let _ = out.flush();
        }
        true
    })?;
    if let Some(e) = echo.take() {
        write!(out, "{e}")?;
    }
    writeln!(out)?;
    if let Some(e) = failure {
        return Err(e.into());
    }
    let total = start.elapsed().as_secs_f64();
    let decode_s = first_at.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let rate = if reply.len() > 1 {
        (reply.len() - 1) as f64 / decode_s
    } else {
        0.0
    };
    eprintln!(
        "[{} prompt + {} generated tokens in {:.2} s, {:.1} tok/s decode, {finish:?}, {}]",
        prompt.len(),
        reply.len(),
        total,
        rate,
        session.describe()
    );
    if let Some(g) = session.backend_mut().gpu() {
        print_profile(&g.profiles);
    }
    Ok(())
}

/// Median per-section GPU time and host time over the profiled tokens.
fn print_profile(profiles: &[mamba2_wgpu::gpu::profiler::TokenProfile]) {
    if profiles.is_empty() {
        return;
    }
    let med = |f: &dyn Fn(&mamba2_wgpu::gpu::profiler::TokenProfile) -> f64| {
        let mut v: Vec<f64> = profiles.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2] / 1e6
    };
    eprint!(
        "[profile, median of {} tokens: GPU {:.3} ms =",
        profiles.len(),
        med(&|p| p.gpu_ns())
    );
    for s in Section::ALL {
        eprint!(" {} {:.3}", s.name(), med(&|p| p.section_ns(s)));
    }
    eprintln!(
        "; host encode {:.3} ms, submit {:.3} ms]",
        med(&|p| p.encode_ns),
        med(&|p| p.submit_ns)
    );
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}
