//! The library in a few lines: load a model (here the embedded one, or a directory given as
//! the first argument), open it on the best device, and stream a greedy continuation.
//!
//!     cargo run --release --example generate -- [MODEL_DIR] ["prompt"]

use std::io::Write;

use mamba2_wgpu::{
    DeviceChoice, EngineOptions, GenerateOptions, Model, Session, Tokenizer, assets, open_backend,
};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (model, tokenizer) = match args.first() {
        Some(dir) if std::path::Path::new(dir).is_dir() => {
            let dir = std::path::Path::new(dir);
            (
                Model::load(dir)?,
                Tokenizer::from_dir(dir)?.ok_or_else(|| anyhow::anyhow!("no tokenizer.json"))?,
            )
        }
        _ => assets::embedded()?,
    };
    let prompt = args
        .iter()
        .find(|a| !std::path::Path::new(a).is_dir())
        .map_or("The meaning of life", |s| s);
    let backend = open_backend(
        &model,
        &DeviceChoice::Auto,
        EngineOptions::default(),
        &mut |n| eprintln!("{n}"),
    )?;
    let mut session = Session::new(backend);
    let opts = GenerateOptions {
        max_new_tokens: 48,
        stop: tokenizer.eos.into_iter().collect(),
        ..Default::default()
    };
    let mut decoder = tokenizer.stream();
    print!("{prompt}");
    session.generate(&tokenizer.encode(prompt)?, &opts, |id| {
        if let Ok(Some(piece)) = decoder.step(&tokenizer, id) {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        }
        true
    })?;
    println!();
    Ok(())
}
