//! `mamba2 info`: what a model directory holds, before anything runs.

use super::ModelArgs;
use clap::Args;

#[derive(Args)]
pub struct InfoArgs {
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(args: InfoArgs) -> anyhow::Result<()> {
    let (model, tokenizer) = args.model.load()?;
    let c = &model.config;
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    println!("model      {}", args.model.name());
    println!("format     {}", c.format.name());
    println!("layers     {}", c.n_layer);
    println!("d_model    {}", c.d_model);
    println!(
        "d_inner    {}  ({} heads × head_dim {})",
        c.d_inner, c.n_heads, c.head_dim
    );
    println!(
        "groups     {}  (d_state {}, conv kernel {})",
        c.n_groups, c.d_state, c.d_conv
    );
    println!("vocab      {}", c.vocab_size);
    println!("chunk      {}", c.chunk_size);
    println!("norm eps   {:e}", c.norm_eps);
    println!(
        "dt limit   ({}, {})",
        c.time_step_limit.0, c.time_step_limit.1
    );
    println!(
        "tied head  {}",
        if model.weights.lm_head.is_none() {
            "yes"
        } else {
            "no"
        }
    );
    println!(
        "conv dim   {}   in_proj rows {}",
        c.conv_dim(),
        c.d_in_proj()
    );
    let params = model.param_count();
    println!("parameters {params} ({:.1} M)", params as f64 / 1e6);
    let dtypes: Vec<String> = model
        .dtype_counts()
        .iter()
        .map(|(d, n)| format!("{} ×{n}", d.name()))
        .collect();
    println!("dtypes     {}", dtypes.join(", "));
    let weight_bytes: usize = model.weights.all().iter().map(|t| t.bytes().len()).sum();
    println!("weights    {:.1} MiB on disk", mib(weight_bytes));
    println!(
        "state      {:.2} MiB per sequence (SSM {:.2} MiB + conv {:.3} MiB, f32)",
        mib(c.state_bytes()),
        mib(4 * c.n_layer * c.ssm_state_len()),
        mib(4 * c.n_layer * c.conv_state_len())
    );
    match &tokenizer {
        Some(t) => println!(
            "tokenizer  {} tokens; end of sequence {}; chat template {}",
            t.vocab_size(),
            t.eos_token.as_deref().unwrap_or("none"),
            if t.chat_template.is_some() {
                "yes"
            } else {
                "no"
            }
        ),
        None => println!("tokenizer  none (use --prompt-ids)"),
    }
    Ok(())
}
