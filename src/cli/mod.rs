//! clap definitions and dispatch for the `mamba2` binary.

mod generate;
mod info;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

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
    /// Describe a model: format, normalized config, parameters, dtypes, state size.
    Info(info::InfoArgs),
}

/// Where the model comes from.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model directory (config.json or params.json, *.safetensors, tokenizer.json).
    #[arg(long, short = 'm', value_name = "DIR")]
    pub model: PathBuf,
}

pub fn run() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Info(a) => info::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
