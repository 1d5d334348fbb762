//! `mamba2 info`: what a model directory holds, before anything runs.

use super::{ModelArgs, check_at_least, note_unused_ctx};
use anyhow::bail;
use clap::Args;
use mamba2_wgpu::config::{BlockKind, MlpAct};

#[derive(Args)]
pub struct InfoArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Hybrids: the context the per-sequence state is shown for (default: the config's
    /// max_position_embeddings).
    #[arg(long, value_name = "N")]
    ctx: Option<usize>,
    /// Print the model's chat template in full, as stored, instead of the description
    /// (which says only whether there is one).
    #[arg(long, conflicts_with = "ctx")]
    chat_template: bool,
}

pub fn run(args: InfoArgs) -> anyhow::Result<()> {
    if let Some(ctx) = args.ctx {
        check_at_least("--ctx", ctx, 1)?;
    }
    // A tokenizer that cannot be built (an unknown `tokenizer.ggml.pre`, a broken
    // tokenizer.json) is one line of the description: the rest of the file is still worth
    // seeing, and is what one reads to find out why.
    let (model, tokenizer) = args.model.load_parts()?;
    if args.chat_template {
        return print_chat_template(&args.model, &model, &tokenizer);
    }
    note_unused_ctx(&model, args.ctx);
    let c = &model.config;
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    outln!("model      {}", args.model.name());
    outln!("format     {}", c.format.name());
    outln!("layers     {}", c.n_layer);
    if c.is_hybrid() {
        let kinds: Vec<String> = [
            (BlockKind::Mamba2, "Mamba2"),
            (BlockKind::Attention, "attention"),
            (BlockKind::Mlp, "MLP"),
            (BlockKind::Moe, "MoE"),
        ]
        .into_iter()
        .filter(|&(k, _)| c.count(k) > 0)
        .map(|(k, name)| format!("{} {name} `{}`", c.count(k), k.letter()))
        .collect();
        outln!("pattern    {}  ({})", c.pattern(), kinds.join(", "));
    }
    if let Some(m) = &c.moe {
        let router = match m.router {
            mamba2_wgpu::config::Router::Grouped {
                n_group,
                topk_group,
                norm_topk_prob,
                routed_scaling_factor,
            } => format!(
                "sigmoid scores, best {topk_group} of {n_group} groups{}, × {routed_scaling_factor}",
                if norm_topk_prob { ", normalised" } else { "" }
            ),
            mamba2_wgpu::config::Router::SoftmaxTopK => "softmax over the top k".into(),
        };
        outln!(
            "moe        {} of {} experts per token ({router}), {} wide {}, shared expert {}",
            m.top_k,
            m.experts,
            m.intermediate,
            match m.act {
                MlpAct::Relu2 => "relu²",
                MlpAct::SiluGated => "silu-gated",
            },
            m.shared
                .as_ref()
                .map_or("none".to_string(), |s| format!("{} wide", s.intermediate)),
        );
        let (active, total) = (c.active_param_count(), c.param_count());
        outln!(
            "active     {active} of {total} parameters read per token ({:.1}%; the embedding \
             table counts one row)",
            100.0 * active as f64 / total.max(1) as f64
        );
    }
    let sc = c.scales;
    if sc != Default::default() {
        outln!(
            "scales     embedding × {}, residual × {}, logits × {:.4}",
            sc.embedding,
            sc.residual,
            sc.logits
        );
    }
    if let Some(a) = &c.attention {
        outln!(
            "attention  {} heads, {} key/value heads, head_dim {}, {}, scale {:.4}",
            a.heads,
            a.kv_heads,
            a.head_dim,
            match a.rope_theta {
                Some(t) => format!("RoPE θ {t}"),
                None => "no positional encoding".into(),
            },
            a.scale
        );
    }
    if let Some(m) = &c.mlp {
        outln!(
            "mlp        {} wide, {}",
            m.intermediate,
            match m.act {
                MlpAct::Relu2 => "relu²",
                MlpAct::SiluGated => "silu-gated",
            }
        );
    }
    outln!("d_model    {}", c.d_model);
    outln!(
        "d_inner    {}  ({} heads × head_dim {})",
        c.d_inner,
        c.n_heads,
        c.head_dim
    );
    outln!(
        "groups     {}  (d_state {}, conv kernel {})",
        c.n_groups,
        c.d_state,
        c.d_conv
    );
    outln!("vocab      {}", c.vocab_size);
    outln!("chunk      {}", c.chunk_size);
    outln!("norm eps   {:e}", c.norm_eps);
    outln!(
        "dt limit   ({}, {})",
        c.time_step_limit.0,
        c.time_step_limit.1
    );
    outln!(
        "tied head  {}",
        if model.weights.lm_head.is_none() {
            "yes"
        } else {
            "no"
        }
    );
    outln!(
        "conv dim   {}   in_proj rows {}",
        c.conv_dim(),
        c.d_in_proj()
    );
    let params = model.param_count();
    outln!("parameters {params} ({:.1} M)", params as f64 / 1e6);
    let dtypes: Vec<String> = model
        .dtype_counts()
        .iter()
        .map(|(d, n)| format!("{} ×{n}", d.name()))
        .collect();
    outln!("dtypes     {}", dtypes.join(", "));
    let weight_bytes: usize = model.weights.all().iter().map(|t| t.bytes().len()).sum();
    outln!("weights    {:.1} MiB on disk", mib(weight_bytes));
    let mamba = c.count(BlockKind::Mamba2);
    outln!(
        "state      {:.2} MiB per sequence (SSM {:.2} MiB + conv {:.3} MiB, f32)",
        mib(c.state_bytes()),
        mib(4 * mamba * c.ssm_state_len()),
        mib(4 * mamba * c.conv_state_len())
    );
    if c.attention.is_some() && c.count(BlockKind::Attention) > 0 {
        let ctx = args.ctx.or(c.max_context).unwrap_or(4096);
        // In f64: any --ctx is described, however large (the run commands refuse what the
        // adapter cannot bind).
        let kv_mib = |elem: usize| ctx as f64 * c.kv_bytes_per_token(elem) as f64 / 1048576.0;
        outln!(
            "KV cache   {:.1} MiB at {ctx} tokens in f16 ({:.1} KiB per token; f32: {:.1} MiB); \
             state + KV {:.1} MiB",
            kv_mib(2),
            c.kv_bytes_per_token(2) as f64 / 1024.0,
            kv_mib(4),
            mib(c.state_bytes()) + kv_mib(2),
        );
    }
    match &tokenizer {
        Ok(Some(t)) => outln!(
            "tokenizer  {} tokens; end of sequence {}; chat template {}",
            t.vocab_size(),
            t.eos_token.as_deref().unwrap_or("none"),
            match &t.chat_template {
                Some(c) => format!(
                    "yes ({} chars; `mamba2 info --chat-template` prints it)",
                    c.chars().count()
                ),
                None => "no".into(),
            }
        ),
        Ok(None) => match &model.gguf {
            Some(g) => outln!(
                "tokenizer  none: {} (use --prompt-ids)",
                mamba2_wgpu::gguf_tokenizer::missing(g)
            ),
            None => outln!("tokenizer  none (use --prompt-ids)"),
        },
        Err(e) => outln!(
            "tokenizer  cannot be built, so text commands refuse this model (use --prompt-ids): \
             {e}"
        ),
    }
    if let Some(g) = &model.gguf {
        print_gguf(g)?;
        let format = model.preferred_format();
        // (Every GGUF block type the reader takes has a GPU format.)
        let held: Vec<&str> = g
            .types
            .iter()
            .filter_map(|(d, _)| match d {
                mamba2_wgpu::model::DType::Quant(t) => Some(t.name()),
                _ => None,
            })
            .collect();
        let stored = if held.is_empty() {
            String::new()
        } else {
            format!(" ({} blocks go up as stored)", held.join(", "))
        };
        outln!("gpu        --dtype {} by default{stored}", format.name());
        // A quantized file's float embedding or head stays in its type (`edge_format`).
        let w = &model.weights;
        let kept: Vec<String> = std::iter::once(("embedding", &w.embedding))
            .chain(w.lm_head.as_ref().map(|t| ("lm_head", t)))
            .filter_map(|(name, t)| {
                let f = mamba2_wgpu::gpu::device_weights::edge_format(&model, t, format);
                (f != format).then(|| format!("{name} {}", f.name()))
            })
            .collect();
        if !kept.is_empty() {
            outln!(
                "kept as stored (float beside the blocks): {}",
                kept.join(", ")
            );
        }
        // Stacked projections whose parts a GGUF stores in different types (a Q4_K_M file's
        // v in Q6_K) go up as stored in parts, one GEMV or GEMM each (a dispatch more per
        // part, and for q/k/v no folded pre-norm or K/V store in that layer's decode).
        let parted = parted_projections(&model, format);
        if !parted.is_empty() {
            outln!(
                "in parts (types differ, each kept as stored): {}",
                parted.join(", ")
            );
        }
        let requantized = requantized_experts(&model, format);
        if !requantized.is_empty() {
            outln!(
                "requantized to q8_0 (experts whose types differ from one to the next): layers {}",
                requantized.join(", ")
            );
        }
    }
    Ok(())
}

/// The stacked projections that go up in parts under `format` (`type_runs`): each as
/// `layer name (types)`.
fn parted_projections(
    model: &mamba2_wgpu::Model,
    format: mamba2_wgpu::WeightFormat,
) -> Vec<String> {
    use mamba2_wgpu::gpu::device_weights::ups;
    use mamba2_wgpu::model::{MixerWeights, MlpWeights, Tensor};
    let entry = |i: usize, what: &str, parts: &[&Tensor]| -> Option<String> {
        let types: Vec<_> = parts.iter().map(|t| t.dtype).collect();
        (mamba2_wgpu::gpu::device_weights::type_runs(&types, format).len() > 1).then(|| {
            let names: Vec<&str> = types.iter().map(|d| d.name()).collect();
            format!("layer {i} {what} ({})", names.join("/"))
        })
    };
    let gate_up = |i: usize, what: &str, m: &MlpWeights| entry(i, what, &ups(m));
    let shared_apart = shared_slots(model) == 0;
    // The routed experts' banks split where every expert's gate is of one block type and
    // every up of another (`expert_up_split`).
    let experts = |i: usize, m: &mamba2_wgpu::model::MoeWeights| {
        let set: Vec<&MlpWeights> = m.experts.iter().collect();
        let split = mamba2_wgpu::gpu::device_weights::expert_up_split(&set, format);
        split
            .then(|| gate_up(i, "experts gate/up", set[0]))
            .flatten()
    };
    let mut out = Vec::new();
    for (i, l) in model.weights.layers.iter().enumerate() {
        match &l.mixer {
            MixerWeights::Attention(a) => out.extend(entry(i, "q/k/v", &[&a.q, &a.k, &a.v])),
            MixerWeights::Mlp(m) => out.extend(gate_up(i, "gate/up", m)),
            // The shared expert goes up in parts whole (`type_runs`) or cut into expert
            // slices (their bank splits as the experts' do).
            MixerWeights::Moe(m) => {
                out.extend(experts(i, m));
                let what = match shared_apart {
                    true => "shared gate/up",
                    false => "shared gate/up (expert slices)",
                };
                out.extend(m.shared.as_ref().and_then(|s| gate_up(i, what, s)));
            }
            _ => {}
        }
    }
    out
}

/// What `f` says of each layer (its index and mixer), where it says something.
fn each_layer(
    model: &mamba2_wgpu::Model,
    f: impl Fn(usize, &mamba2_wgpu::model::MixerWeights) -> Option<String>,
) -> Vec<String> {
    let layers = model.weights.layers.iter().enumerate();
    layers.filter_map(|(i, l)| f(i, &l.mixer)).collect()
}

/// The shared expert's expert-wide slices (`MoeConfig::shared_slots`; 0 without an MoE).
fn shared_slots(model: &mamba2_wgpu::Model) -> usize {
    model.config.moe.as_ref().map_or(0, |m| m.shared_slots())
}

/// The MoE layers with an expert bank whose blocks mix types in a way that parts cannot
/// hold (one expert beside another; every gate in one type and every up in another goes up
/// in two parts, `expert_up_split`): under a quantized `format` such a bank goes up
/// requantized to q8_0 (the shared expert's slices, stored after the experts, form banks of
/// their own when their types differ from the experts').
fn requantized_experts(
    model: &mamba2_wgpu::Model,
    format: mamba2_wgpu::WeightFormat,
) -> Vec<String> {
    use mamba2_wgpu::gpu::device_weights::{expert_up_split, mixed_blocks, ups};
    use mamba2_wgpu::model::{DType, MixerWeights, MlpWeights};
    let sliced = shared_slots(model) > 0;
    let mixed = |set: &[&MlpWeights]| {
        let ups: Vec<DType> = set
            .iter()
            .flat_map(|e| ups(e).into_iter().map(|t| t.dtype))
            .collect();
        let downs: Vec<DType> = set.iter().map(|e| e.down.dtype).collect();
        (mixed_blocks(&ups) && !expert_up_split(set, format)) || mixed_blocks(&downs)
    };
    each_layer(model, |i, mixer| match mixer {
        MixerWeights::Moe(m) if format.reads_q8() => {
            let experts: Vec<&MlpWeights> = m.experts.iter().collect();
            let slices: Vec<&MlpWeights> = m.shared.iter().filter(|_| sliced).collect();
            (mixed(&experts) || mixed(&slices)).then(|| i.to_string())
        }
        _ => None,
    })
}

/// `--chat-template`: the template in full, as the tokenizer holds it (a GGUF file's
/// `tokenizer.chat_template`, or tokenizer_config.json's), or else the GGUF key itself when
/// the tokenizer cannot be built. A model without one is an error, so that a script
/// piping the output never gets an empty template.
fn print_chat_template(
    args: &ModelArgs,
    model: &mamba2_wgpu::Model,
    tokenizer: &mamba2_wgpu::Result<Option<mamba2_wgpu::Tokenizer>>,
) -> anyhow::Result<()> {
    let from_tokenizer = match tokenizer {
        Ok(Some(t)) => t.chat_template.clone(),
        _ => None,
    };
    let from_gguf = || {
        model
            .gguf
            .as_ref()
            .and_then(|g| g.get("tokenizer.chat_template"))
            .and_then(|v| v.as_str())
            .map(str::to_string)
    };
    let Some(template) = from_tokenizer.or_else(from_gguf) else {
        let where_ = match &model.gguf {
            Some(_) => "no `tokenizer.chat_template` metadata key",
            None => "no chat_template in tokenizer_config.json",
        };
        bail!("{} has no chat template ({where_})", args.name());
    };
    out!("{template}");
    if !template.ends_with('\n') {
        outln!();
    }
    Ok(())
}

/// A GGUF file's header: version, stored types, and every metadata key (long arrays and
/// strings shortened).
fn print_gguf(g: &mamba2_wgpu::model::gguf::GgufInfo) -> anyhow::Result<()> {
    let types: Vec<String> = g
        .types
        .iter()
        .map(|(d, n)| format!("{} ×{n}", d.name()))
        .collect();
    outln!(
        "gguf       version {}, {} tensors ({}), {:.1} MiB",
        g.version,
        g.tensors,
        types.join(", "),
        g.file_len as f64 / (1024.0 * 1024.0)
    );
    outln!("metadata   {} keys:", g.metadata.len());
    for (key, value) in &g.metadata {
        outln!("  {key} = {}", value.summary());
    }
    Ok(())
}
