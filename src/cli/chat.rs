//! `mamba2 chat`: a terminal conversation. The state carries between turns, so each turn
//! feeds only its new tokens; /regen redoes the last reply from a state snapshot.

use std::io::{BufRead, Write};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use mamba2_wgpu::chat::Chat;
use mamba2_wgpu::{GenerateOptions, Sampling, Session};

use super::{DeviceArgs, ModelArgs};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Most tokens per reply.
    #[arg(short = 'n', long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    let (model, tokenizer) = args.model.load()?;
    let tokenizer = tokenizer.with_context(|| {
        format!(
            "{} has no tokenizer.json: chat needs one",
            args.model.name()
        )
    })?;
    let session = Session::new(args.device.open(&model)?);
    eprintln!("{} on {}", args.model.name(), session.describe());
    let mut chat = Chat::new(session, tokenizer);
    if !chat.has_template() {
        eprintln!("(no chat template: each message is continued as plain text)");
    }
    eprintln!("commands: /regen  /reset  /quit");
    let mut opts = GenerateOptions {
        max_new_tokens: args.max_tokens,
        sampling: Sampling {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
        stop: chat.tokenizer.eos.into_iter().collect(),
    };
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    loop {
        eprint!("> ");
        let mut bytes = Vec::new();
        if stdin.lock().read_until(b'\n', &mut bytes)? == 0 {
            break;
        }
        // A line that is not UTF-8 is refused on its own; the conversation goes on.
        let line = match String::from_utf8(bytes) {
            Ok(line) => line,
            Err(e) => {
                eprintln!(
                    "error: that line is not valid UTF-8 (byte {}); nothing was sent",
                    e.utf8_error().valid_up_to()
                );
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
        let reply = match line.trim() {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                chat.reset()?;
                eprintln!("(new conversation)");
                continue;
            }
            "/regen" => {
                opts.sampling.seed = opts.sampling.seed.wrapping_add(1);
                chat.regenerate(&opts, stream)
            }
            _ => chat.say(line, &opts, stream),
        };
        match reply {
            Ok(r) => {
                let secs = start.elapsed().as_secs_f64();
                println!();
                eprintln!(
                    "[{} new tokens fed, {} generated in {secs:.2} s, {:?}; {} tokens in the state]",
                    r.fed,
                    r.tokens,
                    r.finish,
                    chat.session.position()
                );
            }
            Err(e) => eprintln!("error: {e}"),
        }
    }
    Ok(())
}
