//! The `mamba2` command line: generate | info (and more as the engine grows).

mod cli;

fn main() -> std::process::ExitCode {
    cli::run()
}
