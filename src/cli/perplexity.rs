//! `mamba2 perplexity`: exp(mean NLL) of a text file, window by window.

use std::path::PathBuf;

use clap::Args;
use mamba2_wgpu::Session;
use mamba2_wgpu::perplexity::perplexity;

use super::{EngineArgs, ModelArgs, check_at_least, read_text_arg};

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// The text to score (UTF-8, at most 256 MiB; `-` reads stdin), tokenized as one string
    /// without special tokens.
    #[arg(long, short = 'f', value_name = "TEXT")]
    file: PathBuf,
    /// Tokens per window; each window starts from a fresh state (hybrids: the KV caches
    /// hold one window).
    #[arg(long, default_value_t = 256)]
    ctx: usize,
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    // Every flag and the text itself before the model is read.
    check_at_least("--ctx", args.ctx, 2)?;
    args.engine.check()?;
    args.model.require_tokenizer("perplexity scores text")?;
    let text = read_text_arg("--file", &args.file)?;
    let (model, tokenizer) = args.model.load()?;
    let tokenizer =
        tokenizer.ok_or_else(|| args.model.no_tokenizer(&model, "perplexity scores text"))?;
    let tokens = tokenizer.encode_with(&text, false)?;
    // A window never holds more than --ctx tokens, so that is all the KV caches need.
    let mut session = Session::new(args.engine.open(&model, Some(args.ctx))?);
    let bar = mamba2_wgpu::progress::bar(
        tokens.len() as u64 * model.config.d_model as u64 * 1000,
        "scoring",
    );
    let start = std::time::Instant::now();
    let p = perplexity(&mut session, &tokens, args.ctx, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    outln!(
        "perplexity {:.4}  (mean NLL {:.5} nats over {} predicted tokens, {} windows of ≤ {} tokens)",
        p.ppl,
        p.nll,
        p.predicted,
        p.windows,
        args.ctx
    );
    eprintln!(
        "[{} tokens in {secs:.1} s = {:.0} tok/s on {}]",
        tokens.len(),
        tokens.len() as f64 / secs,
        session.describe()
    );
    Ok(())
}
