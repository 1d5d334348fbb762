//! `ModelWeights`: the checkpoint's tensors mapped onto one normalized structure — the
//! embedding, one `LayerWeights` per block (its pre-norm and its mixer's tensors), the final
//! norm and the head — each shape checked against the config. Name maps cover HF
//! (`backbone.embeddings`), mamba_ssm (`backbone.embedding`), Mistral (`model.backbone.…`)
//! and Nemotron-H (`model.` or `backbone.` + `embeddings`, `mixer.{q,k,v,o}_proj`,
//! `mixer.{up,down}_proj`).

use std::collections::BTreeMap;

use crate::config::{BlockKind, MlpAct, ModelConfig, ModelFormat};
use crate::error::{Error, Result};
use crate::model::safetensors::Tensor;

/// A Mamba2 mixer's tensors. Shapes (MAMBA2.md): `in_proj [d_in_proj, d]`,
/// `conv_weight [conv_dim, 1, K]` (or `[conv_dim, K]`), `conv_bias [conv_dim]`,
/// `dt_bias, a_log, d_skip [H]`, `mixer_norm [d_inner]`, `out_proj [d, d_inner]`.
#[derive(Clone, Debug)]
pub struct MambaWeights {
    pub in_proj: Tensor,
    pub conv_weight: Tensor,
    pub conv_bias: Option<Tensor>,
    pub dt_bias: Tensor,
    /// `A_log`, or (GGUF's `ssm_a`, `a_direct`) `A = −exp(A_log)` itself.
    pub a_log: Tensor,
    pub a_direct: bool,
    pub d_skip: Tensor,
    pub mixer_norm: Tensor,
    pub out_proj: Tensor,
}

/// An attention mixer's tensors: `q [H·hd, d]`, `k, v [Hkv·hd, d]`, `o [d, H·hd]`, and
/// their biases when the config has them.
#[derive(Clone, Debug)]
pub struct AttentionWeights {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub o: Tensor,
    /// `[q | k | v | o]` biases.
    pub bias: Option<[Tensor; 4]>,
}

/// An MLP mixer's tensors: `up [I, d]`, `gate [I, d]` (gated form only), `down [d, I]`,
/// and biases `[up, down]` (+ gate) when the config has them.
#[derive(Clone, Debug)]
pub struct MlpWeights {
    pub up: Tensor,
    pub gate: Option<Tensor>,
    pub down: Tensor,
    pub up_bias: Option<Tensor>,
    pub gate_bias: Option<Tensor>,
    pub down_bias: Option<Tensor>,
}

/// An MoE block's tensors: the router `[E, d]`, its correction bias `[E]` (grouped router),
/// each routed expert as an MLP without biases (`up [I, d]`, `gate [I, d]` when gated,
/// `down [d, I]`; views into Granite's stacked tensors), and the shared expert.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    pub router: Tensor,
    pub correction_bias: Option<Tensor>,
    pub experts: Vec<MlpWeights>,
    pub shared: Option<MlpWeights>,
    /// Latent MoE: `fc1_latent_proj [L, d]` before the routed experts (which then read and
    /// write `L` values) and `fc2_latent_proj [d, L]` after their weighted sum.
    pub latent: Option<[Tensor; 2]>,
}

impl MambaWeights {
    /// `A = −exp(A_log)` per head, checked finite (as stored when the file holds `A`).
    pub fn a(&self) -> Result<Vec<f32>> {
        if self.a_direct {
            crate::model::quant::finite_f32(&self.a_log)
        } else {
            crate::model::quant::map_finite(&self.a_log, |a| -a.exp())
        }
    }
}

impl MlpWeights {
    /// The tensors in a stable order: up, gate, down, then the biases.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.up];
        out.extend(self.gate.as_ref());
        out.push(&self.down);
        out.extend(self.up_bias.as_ref());
        out.extend(self.gate_bias.as_ref());
        out.extend(self.down_bias.as_ref());
        out
    }

    /// A bias-free MLP.
    fn plain(up: Tensor, gate: Option<Tensor>, down: Tensor) -> Self {
        MlpWeights {
            up,
            gate,
            down,
            up_bias: None,
            gate_bias: None,
            down_bias: None,
        }
    }

    /// A gated MLP from a stacked `[gate; up]` `[2I, d]` tensor (Granite's `input_linear`).
    fn from_stacked(input_linear: &Tensor, down: Tensor) -> Self {
        let (two_i, d) = (input_linear.shape[0], input_linear.shape[1]);
        let i = two_i / 2;
        MlpWeights::plain(
            input_linear.rows(i..two_i, vec![i, d], " (up half)"),
            Some(input_linear.rows(0..i, vec![i, d], " (gate half)")),
            down,
        )
    }
}

/// A block's mixer.
#[derive(Clone, Debug)]
pub enum MixerWeights {
    Mamba2(MambaWeights),
    Attention(AttentionWeights),
    Mlp(MlpWeights),
    Moe(Box<MoeWeights>),
}

impl MixerWeights {
    pub fn kind(&self) -> BlockKind {
        match self {
            MixerWeights::Mamba2(_) => BlockKind::Mamba2,
            MixerWeights::Attention(_) => BlockKind::Attention,
            MixerWeights::Mlp(_) => BlockKind::Mlp,
            MixerWeights::Moe(_) => BlockKind::Moe,
        }
    }

    /// The mixer's tensors in a stable order.
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            MixerWeights::Mamba2(m) => {
                let mut out = vec![&m.in_proj, &m.conv_weight];
                out.extend(m.conv_bias.as_ref());
                out.extend([&m.dt_bias, &m.a_log, &m.d_skip, &m.mixer_norm, &m.out_proj]);
                out
            }
            MixerWeights::Attention(a) => {
                let mut out = vec![&a.q, &a.k, &a.v, &a.o];
                if let Some(b) = &a.bias {
                    out.extend(b.iter());
                }
                out
            }
            MixerWeights::Mlp(m) => m.tensors(),
            MixerWeights::Moe(m) => {
                let mut out = vec![&m.router];
                out.extend(m.correction_bias.as_ref());
                for e in &m.experts {
                    out.extend(e.tensors());
                }
                if let Some(s) = &m.shared {
                    out.extend(s.tensors());
                }
                if let Some(l) = &m.latent {
                    out.extend(l.iter());
                }
                out
            }
        }
    }

    /// The Mamba2 tensors, if this is a Mamba2 mixer.
    pub fn mamba(&self) -> Option<&MambaWeights> {
        match self {
            MixerWeights::Mamba2(m) => Some(m),
            _ => None,
        }
    }
}

/// One block: `x ← x + mixer(rmsnorm(x) ⊙ norm)`.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// The pre-norm weight `[d]`.
    pub norm: Tensor,
    pub mixer: MixerWeights,
}

/// Every tensor of a model: `embedding [V, d]`, the layers, `final_norm [d]`, and
/// `lm_head [V, d]` (`None` when tied to the embedding).
#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub embedding: Tensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    pub lm_head: Option<Tensor>,
}

impl ModelWeights {
    /// The matrix that produces logits: lm_head, or the embedding when tied.
    pub fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    /// Every tensor, in a stable order (embedding, layers, final norm, head).
    pub fn all(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.embedding];
        for l in &self.layers {
            out.push(&l.norm);
            out.extend(l.mixer.tensors());
        }
        out.push(&self.final_norm);
        out.extend(self.lm_head.as_ref());
        out
    }

    /// The checkpoint's own tensors, in `all`'s order: views (Granite's per-expert and
    /// gate/up halves) replaced by the stacked tensor they come from, each once. What
    /// `Model::save` writes.
    pub fn checkpoint(&self) -> Vec<&Tensor> {
        let mut seen = std::collections::HashSet::new();
        self.all()
            .into_iter()
            .map(Tensor::origin)
            .filter(|t| seen.insert(t.name.clone()))
            .collect()
    }

    /// Maps checkpoint tensors onto the structure, checking that nothing is missing, extra
    /// or mis-shaped; every error names the tensor as the checkpoint spells it.
    pub fn from_tensors(
        config: &ModelConfig,
        tensors: impl IntoIterator<Item = Tensor>,
    ) -> Result<Self> {
        let mut slots: BTreeMap<Slot, Tensor> = BTreeMap::new();
        for t in tensors {
            // Nemotron-H's multi-token-prediction layers (`mtp.*`, which transformers skips
            // too): not run here; the config parser says so in a notice.
            if config.format == crate::config::ModelFormat::NemotronH && t.name.starts_with("mtp.")
            {
                continue;
            }
            let slot = Slot::parse(&t.name).ok_or_else(|| {
                Error::tensor(&t.name, "unexpected tensor: not part of a supported model")
            })?;
            let slot = match (config.format, slot) {
                (ModelFormat::GgufGranite, Slot::Layer(i, p)) => granite_gguf_block(i, p)
                    .ok_or_else(|| Error::tensor(&t.name, "layer index out of range"))?,
                _ => slot,
            };
            if let Slot::Layer(i, _) = slot
                && i >= config.n_layer
            {
                return Err(Error::tensor(
                    &t.name,
                    format!(
                        "layer {i} does not exist: the config has {} layers",
                        config.n_layer
                    ),
                ));
            }
            if let Some(prev) = slots.insert(slot, t.clone()) {
                return Err(Error::tensor(
                    &t.name,
                    format!("the same weight appears twice (also as `{}`)", prev.name),
                ));
            }
        }
        let format = config.format;
        // The layers whose file stores `A` itself (GGUF's `ssm_a`).
        let a_direct_layers: std::collections::HashSet<usize> = slots
            .keys()
            .filter_map(|s| match s {
                Slot::Layer(i, Part::A) => Some(*i),
                _ => None,
            })
            .collect();
        // The layers whose experts come stacked (GGUF's `ffn_{up,down}_exps`).
        let stacked_layers: std::collections::HashSet<usize> = slots
            .keys()
            .filter_map(|s| match s {
                Slot::Layer(i, Part::ExpertsUp | Part::ExpertsDown) => Some(*i),
                _ => None,
            })
            .collect();
        let mut take = |slot: Slot, shapes: &[Vec<usize>]| -> Result<Tensor> {
            let t = slots.remove(&slot).ok_or_else(|| {
                Error::tensor(slot.canonical_name(format), "missing from the checkpoint")
            })?;
            if !shapes.contains(&t.shape) {
                return Err(Error::tensor(
                    &t.name,
                    format!("expected shape {:?}, found {:?}", shapes[0], t.shape),
                ));
            }
            Ok(t)
        };
        let c = config;
        let (d, v, h) = (c.d_model, c.vocab_size, c.n_heads);
        let embedding = take(Slot::Embedding, &[vec![v, d]])?;
        let final_norm = take(Slot::FinalNorm, &[vec![d]])?;
        let mut layers = Vec::with_capacity(c.n_layer);
        for (i, &kind) in c.blocks.iter().enumerate() {
            let l = |p| Slot::Layer(i, p);
            let norm = take(l(Part::Norm), &[vec![d]])?;
            let mixer = match kind {
                BlockKind::Mamba2 => {
                    let conv_bias = if c.conv_bias {
                        Some(take(l(Part::ConvBias), &[vec![c.conv_dim()]])?)
                    } else {
                        None
                    };
                    // GGUF stores `A` itself (`ssm_a`, `[H, 1]`), D as `[H, 1]` and the
                    // gated norm per group.
                    let a_direct = a_direct_layers.contains(&i);
                    let a_part = if a_direct { Part::A } else { Part::ALog };
                    let g = c.n_groups.max(1);
                    MixerWeights::Mamba2(MambaWeights {
                        in_proj: take(l(Part::InProj), &[vec![c.d_in_proj(), d]])?,
                        conv_weight: take(
                            l(Part::ConvWeight),
                            &[
                                vec![c.conv_dim(), 1, c.d_conv],
                                vec![c.conv_dim(), c.d_conv],
                            ],
                        )?,
                        conv_bias,
                        dt_bias: take(l(Part::DtBias), &[vec![h]])?,
                        a_log: take(l(a_part), &[vec![h], vec![h, 1]])?,
                        a_direct,
                        d_skip: take(l(Part::D), &[vec![h], vec![h, 1]])?,
                        mixer_norm: take(
                            l(Part::MixerNorm),
                            &[vec![c.d_inner], vec![g, c.d_inner / g]],
                        )?,
                        out_proj: take(l(Part::OutProj), &[vec![d, c.d_inner]])?,
                    })
                }
                BlockKind::Attention => {
                    let a = c.attention.as_ref().ok_or_else(|| {
                        Error::InvalidInput(format!("layer {i}: attention without a shape"))
                    })?;
                    let (qw, kw) = (a.q_width(), a.kv_width());
                    let bias = if a.bias {
                        Some([
                            take(l(Part::QBias), &[vec![qw]])?,
                            take(l(Part::KBias), &[vec![kw]])?,
                            take(l(Part::VBias), &[vec![kw]])?,
                            take(l(Part::OBias), &[vec![d]])?,
                        ])
                    } else {
                        None
                    };
                    MixerWeights::Attention(AttentionWeights {
                        q: take(l(Part::Q), &[vec![qw, d]])?,
                        k: take(l(Part::K), &[vec![kw, d]])?,
                        v: take(l(Part::V), &[vec![kw, d]])?,
                        o: take(l(Part::O), &[vec![d, qw]])?,
                        bias,
                    })
                }
                BlockKind::Mlp if c.format == ModelFormat::Granite => {
                    // Granite's dense layers: the shared MLP alone, `[gate; up]` stacked.
                    let n = c.mlp.as_ref().map_or(0, |m| m.intermediate);
                    let up = take(l(Part::SharedUp), &[vec![2 * n, d]])?;
                    let down = take(l(Part::SharedDown), &[vec![d, n]])?;
                    MixerWeights::Mlp(MlpWeights::from_stacked(&up, down))
                }
                BlockKind::Moe => {
                    let m = c.moe.as_ref().ok_or_else(|| {
                        Error::InvalidInput(format!("layer {i}: MoE without a shape"))
                    })?;
                    let (e, n) = (m.experts, m.intermediate);
                    // What the routed experts read and write: d, or the latent width.
                    let x = m.expert_width(d);
                    let router = take(l(Part::Router), &[vec![e, d]])?;
                    let correction_bias = if m.has_correction_bias() {
                        Some(take(l(Part::RouterBias), &[vec![e]])?)
                    } else {
                        None
                    };
                    let gated = m.act == MlpAct::SiluGated;
                    // Stacked `[E, rows, cols]` (Granite's `input_linear`, GGUF's `*_exps`),
                    // each expert a view of its rows; else Nemotron-H's per-expert tensors.
                    // (GGUF files always stack them: a missing stack is named as such.)
                    let stacked = stacked_layers.contains(&i)
                        || matches!(
                            c.format,
                            ModelFormat::Granite
                                | ModelFormat::GgufNemotronHMoe
                                | ModelFormat::GgufGranite
                        );
                    // GGUF Granite keeps every gate apart from its up (`ffn_gate_{exps,shexp}`).
                    let gguf_granite = c.format == ModelFormat::GgufGranite;
                    let experts = if stacked {
                        // Gates apart (GGUF `ffn_gate_exps`, `[E, I, x]`) or stacked over
                        // the ups (Granite's `[gate; up]` rows).
                        let gates = if gated && gguf_granite {
                            Some(take(l(Part::ExpertsGate), &[vec![e, n, x]])?)
                        } else {
                            None
                        };
                        let up_rows = if gates.is_some() { n } else { m.up_rows() };
                        let up = take(l(Part::ExpertsUp), &[vec![e, up_rows, x]])?;
                        let down = take(l(Part::ExpertsDown), &[vec![e, x, n]])?;
                        (0..e)
                            .map(|j| {
                                let tag = format!("[expert {j}]");
                                let up_x = up.rows(j..j + 1, vec![up_rows, x], &tag);
                                let down_x = down.rows(j..j + 1, vec![x, n], &tag);
                                match &gates {
                                    Some(g) => MlpWeights::plain(
                                        up_x,
                                        Some(g.rows(j..j + 1, vec![n, x], &tag)),
                                        down_x,
                                    ),
                                    None if gated => MlpWeights::from_stacked(&up_x, down_x),
                                    None => MlpWeights::plain(up_x, None, down_x),
                                }
                            })
                            .collect()
                    } else {
                        (0..e)
                            .map(|j| {
                                Ok(MlpWeights::plain(
                                    take(l(Part::ExpertUp(j)), &[vec![n, x]])?,
                                    None,
                                    take(l(Part::ExpertDown(j)), &[vec![x, n]])?,
                                ))
                            })
                            .collect::<Result<Vec<_>>>()?
                    };
                    let shared = match &m.shared {
                        None => None,
                        Some(s) if s.act == MlpAct::SiluGated => {
                            let sn = s.intermediate;
                            if gguf_granite {
                                Some(MlpWeights::plain(
                                    take(l(Part::SharedUp), &[vec![sn, d]])?,
                                    Some(take(l(Part::SharedGate), &[vec![sn, d]])?),
                                    take(l(Part::SharedDown), &[vec![d, sn]])?,
                                ))
                            } else {
                                let up = take(l(Part::SharedUp), &[vec![2 * sn, d]])?;
                                let down = take(l(Part::SharedDown), &[vec![d, sn]])?;
                                Some(MlpWeights::from_stacked(&up, down))
                            }
                        }
                        Some(s) => {
                            let sn = s.intermediate;
                            Some(MlpWeights::plain(
                                take(l(Part::SharedUp), &[vec![sn, d]])?,
                                None,
                                take(l(Part::SharedDown), &[vec![d, sn]])?,
                            ))
                        }
                    };
                    let latent = match m.latent {
                        Some(lw) => Some([
                            take(l(Part::LatentIn), &[vec![lw, d]])?,
                            take(l(Part::LatentOut), &[vec![d, lw]])?,
                        ]),
                        None => None,
                    };
                    MixerWeights::Moe(Box::new(MoeWeights {
                        router,
                        correction_bias,
                        experts,
                        shared,
                        latent,
                    }))
                }
                BlockKind::Mlp => {
                    let m = c.mlp.as_ref().ok_or_else(|| {
                        Error::InvalidInput(format!("layer {i}: MLP without a shape"))
                    })?;
                    let n = m.intermediate;
                    let gated = m.act == MlpAct::SiluGated;
                    let mut opt = |on: bool, part, shape: Vec<usize>| -> Result<Option<Tensor>> {
                        on.then(|| take(l(part), &[shape])).transpose()
                    };
                    MixerWeights::Mlp(MlpWeights {
                        gate: opt(gated, Part::Gate, vec![n, d])?,
                        up_bias: opt(m.bias, Part::UpBias, vec![n])?,
                        gate_bias: opt(m.bias && gated, Part::GateBias, vec![n])?,
                        down_bias: opt(m.bias, Part::DownBias, vec![d])?,
                        up: take(l(Part::Up), &[vec![n, d]])?,
                        down: take(l(Part::Down), &[vec![d, n]])?,
                    })
                }
            };
            layers.push(LayerWeights { norm, mixer });
        }
        let lm_head = match slots.remove(&Slot::LmHead) {
            Some(t) if t.shape == [v, d] => Some(t),
            Some(t) => {
                return Err(Error::tensor(
                    &t.name,
                    format!("expected shape {:?}, found {:?}", [v, d], t.shape),
                ));
            }
            None if c.tie_embeddings => None,
            None => {
                return Err(Error::tensor(
                    "lm_head.weight",
                    "missing from the checkpoint, and the config does not tie it to the embedding",
                ));
            }
        };
        if let Some((slot, t)) = slots.into_iter().next() {
            let why = match slot {
                Slot::Layer(i, _) => format!(
                    "unexpected tensor for this config (layer {i} is a {} layer)",
                    c.blocks[i].name()
                ),
                _ => "unexpected tensor for this config".to_string(),
            };
            return Err(Error::tensor(&t.name, why));
        }
        Ok(ModelWeights {
            embedding,
            layers,
            final_norm,
            lm_head,
        })
    }
}

/// A tensor's role, independent of how a format spells its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Slot {
    Embedding,
    FinalNorm,
    LmHead,
    Layer(usize, Part),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Part {
    Norm,
    InProj,
    ConvWeight,
    ConvBias,
    DtBias,
    ALog,
    /// GGUF's `ssm_a`: `A` itself.
    A,
    D,
    MixerNorm,
    OutProj,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    OBias,
    Up,
    Gate,
    Down,
    UpBias,
    GateBias,
    DownBias,
    /// `[E, d]` (Nemotron `mixer.gate.weight`, Granite `block_sparse_moe.router.layer`).
    Router,
    /// `[E]` (Nemotron `mixer.gate.e_score_correction_bias`).
    RouterBias,
    /// Nemotron's per-expert `mixer.experts.N.{up,down}_proj.weight`.
    ExpertUp(usize),
    ExpertDown(usize),
    /// Granite's stacked `block_sparse_moe.{input,output}_linear.weight`; GGUF's
    /// `ffn_{up,down}_exps` (and `ffn_gate_exps`, the gates apart from the ups).
    ExpertsUp,
    ExpertsDown,
    ExpertsGate,
    /// Nemotron `mixer.shared_experts.{up,down}_proj`, Granite `shared_mlp.{input,output}_linear`.
    SharedUp,
    SharedDown,
    /// GGUF's `ffn_gate_shexp` (Granite's shared MLP gate apart from its up).
    SharedGate,
    /// GGUF granitehybrid's `ffn_norm`: the pre-norm of a layer's feed-forward block.
    FfnNorm,
    /// Nemotron's `mixer.fc1_latent_proj` / `mixer.fc2_latent_proj` (latent MoE).
    LatentIn,
    LatentOut,
}

/// Each part's name after `layers.N.` (the HF / Nemotron-H spelling).
const PART_NAMES: [(Part, &str); 29] = [
    (Part::Norm, "norm.weight"),
    (Part::InProj, "mixer.in_proj.weight"),
    (Part::ConvWeight, "mixer.conv1d.weight"),
    (Part::ConvBias, "mixer.conv1d.bias"),
    (Part::DtBias, "mixer.dt_bias"),
    (Part::ALog, "mixer.A_log"),
    (Part::D, "mixer.D"),
    (Part::MixerNorm, "mixer.norm.weight"),
    (Part::OutProj, "mixer.out_proj.weight"),
    (Part::Q, "mixer.q_proj.weight"),
    (Part::K, "mixer.k_proj.weight"),
    (Part::V, "mixer.v_proj.weight"),
    (Part::O, "mixer.o_proj.weight"),
    (Part::QBias, "mixer.q_proj.bias"),
    (Part::KBias, "mixer.k_proj.bias"),
    (Part::VBias, "mixer.v_proj.bias"),
    (Part::OBias, "mixer.o_proj.bias"),
    (Part::Up, "mixer.up_proj.weight"),
    (Part::Gate, "mixer.gate_proj.weight"),
    (Part::Down, "mixer.down_proj.weight"),
    (Part::UpBias, "mixer.up_proj.bias"),
    (Part::GateBias, "mixer.gate_proj.bias"),
    (Part::DownBias, "mixer.down_proj.bias"),
    (Part::Router, "mixer.gate.weight"),
    (Part::RouterBias, "mixer.gate.e_score_correction_bias"),
    (Part::SharedUp, "mixer.shared_experts.up_proj.weight"),
    (Part::SharedDown, "mixer.shared_experts.down_proj.weight"),
    (Part::LatentIn, "mixer.fc1_latent_proj.weight"),
    (Part::LatentOut, "mixer.fc2_latent_proj.weight"),
];

impl Slot {
    /// Strips the `model.` / `backbone.` prefixes every format adds in its own way, then
    /// recognizes the rest.
    fn parse(name: &str) -> Option<Slot> {
        if let Some(slot) = gguf_slot(name) {
            return Some(slot);
        }
        let mut rest = name;
        while let Some(r) = rest
            .strip_prefix("model.")
            .or_else(|| rest.strip_prefix("backbone."))
        {
            rest = r;
        }
        match rest {
            "embedding.weight" | "embeddings.weight" | "embed_tokens.weight" => {
                return Some(Slot::Embedding);
            }
            "norm_f.weight" | "norm.weight" => return Some(Slot::FinalNorm),
            "lm_head.weight" => return Some(Slot::LmHead),
            _ => {}
        }
        let rest = rest.strip_prefix("layers.")?;
        let (index, part) = rest.split_once('.')?;
        let index: usize = index.parse().ok()?;
        if let Some((block, part)) = granite_part(part) {
            // Granite layer N is blocks 2N (mixer) and 2N + 1 (feed-forward).
            return Some(Slot::Layer(index.checked_mul(2)?.checked_add(block)?, part));
        }
        if let Some(p) = PART_NAMES.iter().find(|(_, n)| *n == part) {
            return Some(Slot::Layer(index, p.0));
        }
        let expert = part.strip_prefix("mixer.experts.")?;
        let (e, which) = expert.split_once('.')?;
        let e: usize = e.parse().ok()?;
        match which {
            "up_proj.weight" => Some(Slot::Layer(index, Part::ExpertUp(e))),
            "down_proj.weight" => Some(Slot::Layer(index, Part::ExpertDown(e))),
            _ => None,
        }
    }

    /// The format's spelling, used when a tensor is missing and there is no name to quote.
    fn canonical_name(self, format: ModelFormat) -> String {
        let granite = format == ModelFormat::Granite;
        if matches!(
            format,
            ModelFormat::GgufMamba2
                | ModelFormat::GgufNemotronH
                | ModelFormat::GgufNemotronHMoe
                | ModelFormat::GgufGranite
        ) {
            return match self {
                Slot::Embedding => "token_embd.weight".into(),
                Slot::FinalNorm => "output_norm.weight".into(),
                Slot::LmHead => "output.weight".into(),
                // granitehybrid's layer N is blocks 2N and 2N + 1, the latter normed by
                // `ffn_norm`.
                Slot::Layer(i, p) if format == ModelFormat::GgufGranite => {
                    let ffn_norm = p == Part::Norm && i % 2 == 1;
                    gguf_name(i / 2, if ffn_norm { Part::FfnNorm } else { p })
                }
                Slot::Layer(i, p) => gguf_name(i, p),
            };
        }
        match self {
            Slot::Embedding if granite => "model.embed_tokens.weight".into(),
            Slot::FinalNorm if granite => "model.norm.weight".into(),
            Slot::Embedding => "backbone.embeddings.weight".into(),
            Slot::FinalNorm => "backbone.norm_f.weight".into(),
            Slot::LmHead => "lm_head.weight".into(),
            Slot::Layer(i, p) if granite => {
                let name = GRANITE_PARTS
                    .iter()
                    .find(|(b, q, _)| *b == i % 2 && *q == p)
                    .map_or_else(|| format!("{p:?}"), |(_, _, n)| n.to_string());
                format!("model.layers.{}.{name}", i / 2)
            }
            Slot::Layer(i, Part::ExpertUp(e)) => {
                format!("backbone.layers.{i}.mixer.experts.{e}.up_proj.weight")
            }
            Slot::Layer(i, Part::ExpertDown(e)) => {
                format!("backbone.layers.{i}.mixer.experts.{e}.down_proj.weight")
            }
            Slot::Layer(i, p) => {
                let part = PART_NAMES
                    .iter()
                    .find(|(q, _)| *q == p)
                    .map_or("?", |(_, n)| n);
                format!("backbone.layers.{i}.{part}")
            }
        }
    }
}

/// llama.cpp's `mamba2`, `nemotron_h`, `nemotron_h_moe` and `granitehybrid` names after
/// `blk.N.` (gguf-py's tensor map; an MoE layer's experts stacked `[E, rows, cols]`,
/// expert-major).
const GGUF_PARTS: [(Part, &str); 26] = [
    (Part::Norm, "attn_norm.weight"),
    (Part::InProj, "ssm_in.weight"),
    (Part::ConvWeight, "ssm_conv1d.weight"),
    (Part::ConvBias, "ssm_conv1d.bias"),
    (Part::DtBias, "ssm_dt.bias"),
    (Part::A, "ssm_a"),
    (Part::D, "ssm_d"),
    (Part::MixerNorm, "ssm_norm.weight"),
    (Part::OutProj, "ssm_out.weight"),
    (Part::Q, "attn_q.weight"),
    (Part::K, "attn_k.weight"),
    (Part::V, "attn_v.weight"),
    (Part::O, "attn_output.weight"),
    (Part::Up, "ffn_up.weight"),
    (Part::Down, "ffn_down.weight"),
    (Part::Router, "ffn_gate_inp.weight"),
    (Part::RouterBias, "exp_probs_b.bias"),
    (Part::ExpertsUp, "ffn_up_exps.weight"),
    (Part::ExpertsDown, "ffn_down_exps.weight"),
    (Part::SharedUp, "ffn_up_shexp.weight"),
    (Part::SharedDown, "ffn_down_shexp.weight"),
    (Part::LatentIn, "ffn_latent_down.weight"),
    (Part::LatentOut, "ffn_latent_up.weight"),
    (Part::ExpertsGate, "ffn_gate_exps.weight"),
    (Part::SharedGate, "ffn_gate_shexp.weight"),
    (Part::FfnNorm, "ffn_norm.weight"),
];

/// The GGUF name of layer `i`'s part (`?` for a part GGUF files do not have).
fn gguf_name(i: usize, p: Part) -> String {
    let part = GGUF_PARTS
        .iter()
        .find(|(q, _)| *q == p || (p == Part::ALog && *q == Part::A))
        .map_or("?", |(_, n)| n);
    format!("blk.{i}.{part}")
}

/// A `granitehybrid` GGUF layer `i`'s part as this engine's block: 2i for the mixer, 2i + 1
/// for the feed-forward (its `ffn_norm` that block's pre-norm).
fn granite_gguf_block(i: usize, p: Part) -> Option<Slot> {
    let ffn = matches!(
        p,
        Part::FfnNorm
            | Part::Router
            | Part::ExpertsUp
            | Part::ExpertsGate
            | Part::ExpertsDown
            | Part::SharedUp
            | Part::SharedGate
            | Part::SharedDown
    );
    let block = i.checked_mul(2)?.checked_add(usize::from(ffn))?;
    let p = if p == Part::FfnNorm { Part::Norm } else { p };
    Some(Slot::Layer(block, p))
}

/// A GGUF tensor name's slot.
fn gguf_slot(name: &str) -> Option<Slot> {
    match name {
        "token_embd.weight" => return Some(Slot::Embedding),
        "output_norm.weight" => return Some(Slot::FinalNorm),
        "output.weight" => return Some(Slot::LmHead),
        _ => {}
    }
    let (index, part) = name.strip_prefix("blk.")?.split_once('.')?;
    let index: usize = index.parse().ok()?;
    let part = GGUF_PARTS.iter().find(|(_, n)| *n == part)?.0;
    Some(Slot::Layer(index, part))
}

/// Granite's names after `model.layers.N.`: `(block within the layer, part, name)`.
const GRANITE_PARTS: [(usize, Part, &str); 19] = [
    (0, Part::Norm, "input_layernorm.weight"),
    (0, Part::InProj, "mamba.in_proj.weight"),
    (0, Part::ConvWeight, "mamba.conv1d.weight"),
    (0, Part::ConvBias, "mamba.conv1d.bias"),
    (0, Part::DtBias, "mamba.dt_bias"),
    (0, Part::ALog, "mamba.A_log"),
    (0, Part::D, "mamba.D"),
    (0, Part::MixerNorm, "mamba.norm.weight"),
    (0, Part::OutProj, "mamba.out_proj.weight"),
    (0, Part::Q, "self_attn.q_proj.weight"),
    (0, Part::K, "self_attn.k_proj.weight"),
    (0, Part::V, "self_attn.v_proj.weight"),
    (0, Part::O, "self_attn.o_proj.weight"),
    (1, Part::Norm, "post_attention_layernorm.weight"),
    (1, Part::SharedUp, "shared_mlp.input_linear.weight"),
    (1, Part::SharedDown, "shared_mlp.output_linear.weight"),
    (1, Part::Router, "block_sparse_moe.router.layer.weight"),
    (1, Part::ExpertsUp, "block_sparse_moe.input_linear.weight"),
    (
        1,
        Part::ExpertsDown,
        "block_sparse_moe.output_linear.weight",
    ),
];

/// A Granite part name: which of the layer's two blocks it belongs to, and its role.
fn granite_part(name: &str) -> Option<(usize, Part)> {
    GRANITE_PARTS
        .iter()
        .find(|(_, _, n)| *n == name)
        .map(|&(b, p, _)| (b, p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_every_format() {
        let cases = [
            ("backbone.embeddings.weight", Slot::Embedding),
            ("backbone.embedding.weight", Slot::Embedding),
            ("model.backbone.embedding.weight", Slot::Embedding),
            ("model.embeddings.weight", Slot::Embedding),
            ("model.lm_head.weight", Slot::LmHead),
            ("lm_head.weight", Slot::LmHead),
            ("model.norm_f.weight", Slot::FinalNorm),
            (
                "backbone.layers.12.mixer.A_log",
                Slot::Layer(12, Part::ALog),
            ),
            ("model.layers.0.norm.weight", Slot::Layer(0, Part::Norm)),
            (
                "model.backbone.layers.3.mixer.norm.weight",
                Slot::Layer(3, Part::MixerNorm),
            ),
        ];
        for (name, slot) in cases {
            assert_eq!(Slot::parse(name), Some(slot), "{name}");
        }
        assert_eq!(Slot::parse("backbone.layers.x.norm.weight"), None);
        assert_eq!(Slot::parse("backbone.layers.0.mixer.in_proj.bias"), None);
        assert_eq!(
            Slot::parse("backbone.layers.4.mixer.k_proj.weight"),
            Some(Slot::Layer(4, Part::K))
        );
        assert_eq!(
            Slot::parse("backbone.layers.2.mixer.down_proj.weight"),
            Some(Slot::Layer(2, Part::Down))
        );
        for (p, _) in PART_NAMES {
            let name = Slot::Layer(3, p).canonical_name(ModelFormat::NemotronH);
            assert_eq!(Slot::parse(&name), Some(Slot::Layer(3, p)), "{name}");
        }
    }
}
