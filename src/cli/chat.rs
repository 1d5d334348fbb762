//! `mamba2 chat`: a terminal conversation. The state carries between turns, so each turn
//! feeds only its new tokens; /regen redoes the last reply from a state snapshot.

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use mamba2_wgpu::chat::Chat;
use mamba2_wgpu::state_file::{self, StateDtype};
use mamba2_wgpu::{GenerateOptions, Sampling, Session};

use super::{EngineArgs, ModelArgs, check_at_least, check_sampling, note_unused_ctx, state_key};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Hybrid models: tokens the attention layers' KV caches hold (default: the config's
    /// max_position_embeddings, capped by what the adapter can bind).
    #[arg(long, value_name = "N")]
    ctx: Option<usize>,
    /// Most tokens per reply (at least 1: a turn has a reply).
    #[arg(short = 'n', long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    // Negative values are parsed so that `check` refuses them naming the flag (clap would
    // take `-1` for an unknown option).
    #[arg(long, default_value_t = 0.7, allow_negative_numbers = true, value_parser = super::parse_f32)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Keep the most likely tokens up to this probability mass (1 = off).
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true, value_parser = super::parse_f32)]
    top_p: f32,
    /// Seed of the sampler; /regen moves to the next one.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the conversation and its state to FILE after every turn (a safetensors file
    /// that `--resume` and the server's prefix cache also read).
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// Continue the conversation saved in FILE (refused if it was saved with another
    /// model, weight format or engine version).
    #[arg(long, value_name = "FILE")]
    resume: Option<PathBuf>,
    /// How --save stores the state: f32 (exact) or f16 (half the bytes).
    #[arg(long, default_value = "f32")]
    save_dtype: StateDtype,
}

impl ChatArgs {
    fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
        }
    }

    /// Every flag, before the model is read and the conversation starts: a value that
    /// would fail every turn is refused once, naming its flag.
    fn check(&self) -> anyhow::Result<()> {
        check_sampling(&self.sampling())?;
        check_at_least("--max-tokens", self.max_tokens, 1)?;
        if let Some(ctx) = self.ctx {
            check_at_least("--ctx", ctx, 1)?;
        }
        self.engine.check()?;
        if let Some(p) = &self.resume {
            if !p.exists() {
                bail!("--resume {}: no such file", p.display());
            }
            mamba2_wgpu::files::check_regular(p)
                .with_context(|| format!("--resume {}", p.display()))?;
        }
        if let Some(p) = &self.save {
            mamba2_wgpu::files::replaceable(p, true)
                .with_context(|| format!("--save {}", p.display()))?;
        }
        self.model.require_tokenizer("chat needs one")
    }
}

/// The most one line (one message) on stdin may hold: the server's default body limit.
const MAX_LINE_BYTES: u64 = 16 << 20;

/// The commands a chat line may be.
const COMMANDS: [&str; 4] = ["/regen", "/reset", "/quit", "/exit"];

pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    args.check()?;
    let (model, tokenizer) = args.model.load()?;
    note_unused_ctx(&model, args.ctx);
    let tokenizer = tokenizer.ok_or_else(|| args.model.no_tokenizer(&model, "chat needs one"))?;
    let mut backend = args.engine.open(&model, args.ctx)?;
    let key = state_key(&model, &args.engine, backend.as_mut());
    let mut session = Session::new(backend);
    session.set_prompt_progress(Some(mamba2_wgpu::progress::prompt_progress()));
    eprintln!("{} on {}", args.model.name(), session.describe());
    let mut chat = Chat::new(session, tokenizer);
    if let Some(path) = &args.resume {
        let saved = state_file::load(path, &key, &model.config)?;
        chat.import(&saved, path)
            .with_context(|| format!("--resume {}", path.display()))?;
        eprintln!(
            "(resumed {}: {} messages, {} tokens in the state)",
            path.display(),
            chat.messages.len(),
            chat.session.position()
        );
    }
    let save = |chat: &Chat| -> anyhow::Result<()> {
        if let Some(path) = &args.save {
            // Through a symlink, into its target (resolved at each save: the link may move).
            let target = mamba2_wgpu::files::replaceable(path, true)
                .with_context(|| format!("--save {}", path.display()))?;
            state_file::save(
                &target,
                &key,
                &chat.export()?,
                args.save_dtype,
                &model.config,
            )
            .with_context(|| format!("--save {}", path.display()))?;
        }
        Ok(())
    };
    if !chat.has_template() {
        eprintln!("(no chat template: each message is continued as plain text)");
    }
    eprintln!("commands: {}  (//text sends /text)", COMMANDS.join("  "));
    let opts = GenerateOptions {
        max_new_tokens: args.max_tokens,
        sampling: args.sampling(),
        // The end of text and the template's end of turn, as the server stops on (the
        // latter even for a tokenizer without an end-of-text token).
        stop: mamba2_wgpu::chat::stop_ids(&chat.tokenizer),
    };
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    // Lines that were refused or whose turn failed: the conversation goes on, but the
    // session did not do all it was asked, so the exit status says so at the end.
    let mut failed = 0usize;
    // Regenerations so far: each takes the next seed after the session's.
    let mut regens = 0u64;
    loop {
        eprint!("> ");
        let mut bytes = Vec::new();
        if stdin
            .lock()
            .take(MAX_LINE_BYTES + 1)
            .read_until(b'\n', &mut bytes)?
            == 0
        {
            break;
        }
        if bytes.len() as u64 > MAX_LINE_BYTES {
            // (`/dev/zero`, or a file without line ends: reading on would take all the
            // memory there is; what was said before is saved.)
            bail!(
                "stdin: a line of more than {} (a message is one line); the chat ends here",
                mamba2_wgpu::files::human_bytes(MAX_LINE_BYTES)
            );
        }
        // A line that is not UTF-8 is refused on its own; the conversation goes on.
        let line = match String::from_utf8(bytes) {
            Ok(line) => line,
            Err(e) => {
                eprintln!(
                    "error: that line is not valid UTF-8 (byte {}); nothing was sent",
                    e.utf8_error().valid_up_to()
                );
                failed += 1;
                continue;
            }
        };
        let line = line.trim_end_matches(['\n', '\r']);
        let start = Instant::now();
        let stream = |piece: &str| {
            let _ = write!(out, "{piece}");
            let _ = out.flush();
            true
        };
        // A line whose first word starts with `/` is a command (`//` sends a line that
        // starts with `/`): a mistyped one, or one with words after it, is not sent to the
        // model as a message.
        let text = line.trim();
        let word = text.split_whitespace().next().unwrap_or("");
        let command = (word.starts_with('/') && !word.starts_with("//")).then_some(word);
        if let Some(c) = command
            && (!COMMANDS.contains(&c) || c != text)
        {
            match COMMANDS.contains(&c) {
                true => eprintln!("error: `{c}` takes nothing after it; nothing was sent"),
                false => eprintln!(
                    "error: unknown command `{c}` (commands: {}; start a message with // to \
                     send a leading /); nothing was sent",
                    COMMANDS.join(" ")
                ),
            }
            failed += 1;
            continue;
        }
        // The message as sent (`//text` sends `/text`).
        let message = match text.starts_with("//") {
            true => &line.trim_start()[1..],
            false => line,
        };
        let reply = match text {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                chat.reset()?;
                save(&chat)?;
                eprintln!("(new conversation)");
                continue;
            }
            "/regen" => {
                // Another seed for this regeneration only (as the app does): the turns
                // after it, and a refused /regen, keep the session's seed.
                regens = regens.wrapping_add(1);
                let mut again = opts.clone();
                again.sampling.seed = opts.sampling.seed.wrapping_add(regens);
                chat.regenerate(&again, stream)
            }
            _ => chat.say(message, &opts, stream),
        };
        match reply {
            Ok(r) => {
                save(&chat)?;
                let secs = start.elapsed().as_secs_f64();
                outln!();
                eprintln!(
                    "[{} new tokens fed, {} generated in {secs:.2} s, {:?}; {} tokens in the state]",
                    r.fed,
                    r.tokens,
                    r.finish,
                    chat.session.position()
                );
            }
            // A device error leaves the state (and likely the device) unusable: stop.
            Err(e @ mamba2_wgpu::Error::Gpu(_)) => return Err(e.into()),
            Err(e) => {
                let e = e.to_string();
                if e.contains(mamba2_wgpu::session::CONTEXT_FULL) {
                    // (/regen's message is already in the conversation.)
                    let alone = (text != "/regen")
                        .then(|| chat.too_long_alone(message))
                        .flatten();
                    match alone {
                        Some((n, ctx)) => eprintln!(
                            "error: {e}; nothing was sent: this message alone takes {n} \
                             of the {ctx}-token context, leaving no room for a reply: run \
                             with a larger --ctx"
                        ),
                        None => eprintln!(
                            "error: {e}; nothing was sent: /reset starts a new conversation \
                             (or run with a larger --ctx)"
                        ),
                    }
                } else {
                    eprintln!("error: {e}");
                }
                failed += 1;
            }
        }
    }
    if failed > 0 {
        bail!(
            "{failed} line{} of this conversation failed (see the errors above)",
            if failed == 1 { "" } else { "s" }
        );
    }
    Ok(())
}
