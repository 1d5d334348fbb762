//! `Mamba2Weights`: the checkpoint's tensors mapped onto one normalized structure, each
//! shape checked against the config. Name maps cover HF (`backbone.embeddings`), mamba_ssm
//! (`backbone.embedding`), Mistral (`model.backbone.…`) and Nemotron-H (`model.` or
//! `backbone.` + `embeddings`).

use std::collections::BTreeMap;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::safetensors::Tensor;

/// One Mamba2 block's tensors. Shapes (MAMBA2.md): `norm [d]`, `in_proj [d_in_proj, d]`,
/// `conv_weight [conv_dim, 1, K]` (or `[conv_dim, K]`), `conv_bias [conv_dim]`,
/// `dt_bias, a_log, d_skip [H]`, `mixer_norm [d_inner]`, `out_proj [d, d_inner]`.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub norm: Tensor,
    pub in_proj: Tensor,
    pub conv_weight: Tensor,
    pub conv_bias: Option<Tensor>,
    pub dt_bias: Tensor,
    pub a_log: Tensor,
    pub d_skip: Tensor,
    pub mixer_norm: Tensor,
    pub out_proj: Tensor,
}

/// Every tensor of a model: `embedding [V, d]`, the layers, `final_norm [d]`, and
/// `lm_head [V, d]` (`None` when tied to the embedding).
#[derive(Clone, Debug)]
pub struct Mamba2Weights {
    pub embedding: Tensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    pub lm_head: Option<Tensor>,
}

impl Mamba2Weights {
    /// The matrix that produces logits: lm_head, or the embedding when tied.
    pub fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    /// Every tensor, in a stable order (embedding, layers, final norm, head).
    pub fn all(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.embedding];
        for l in &self.layers {
            out.extend([&l.norm, &l.in_proj, &l.conv_weight]);
            out.extend(l.conv_bias.as_ref());
            out.extend([&l.dt_bias, &l.a_log, &l.d_skip, &l.mixer_norm, &l.out_proj]);
        }
        out.push(&self.final_norm);
        out.extend(self.lm_head.as_ref());
        out
    }

    /// Maps checkpoint tensors onto the structure, checking that nothing is missing, extra
    /// or mis-shaped; every error names the tensor as the checkpoint spells it.
    pub fn from_tensors(
        config: &ModelConfig,
        tensors: impl IntoIterator<Item = Tensor>,
    ) -> Result<Self> {
        let mut slots: BTreeMap<Slot, Tensor> = BTreeMap::new();
        for t in tensors {
            let slot = Slot::parse(&t.name).ok_or_else(|| {
                Error::tensor(&t.name, "unexpected tensor: not part of a Mamba2 model")
            })?;
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
        let mut take = |slot: Slot, shapes: &[Vec<usize>]| -> Result<Tensor> {
            let t = slots.remove(&slot).ok_or_else(|| {
                Error::tensor(slot.canonical_name(), "missing from the checkpoint")
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
        for i in 0..c.n_layer {
            let l = |p| Slot::Layer(i, p);
            let conv_bias = if c.conv_bias {
                Some(take(l(Part::ConvBias), &[vec![c.conv_dim()]])?)
            } else {
                None
            };
            layers.push(LayerWeights {
                norm: take(l(Part::Norm), &[vec![d]])?,
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
                a_log: take(l(Part::ALog), &[vec![h]])?,
                d_skip: take(l(Part::D), &[vec![h]])?,
                mixer_norm: take(l(Part::MixerNorm), &[vec![c.d_inner]])?,
                out_proj: take(l(Part::OutProj), &[vec![d, c.d_inner]])?,
            });
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
        if let Some((_, t)) = slots.into_iter().next() {
            return Err(Error::tensor(&t.name, "unexpected tensor for this config"));
        }
        Ok(Mamba2Weights {
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
    D,
    MixerNorm,
    OutProj,
}

impl Slot {
    /// Strips the `model.` / `backbone.` prefixes every format adds in its own way, then
    /// recognizes the rest.
    fn parse(name: &str) -> Option<Slot> {
        let mut rest = name;
        while let Some(r) = rest
            .strip_prefix("model.")
            .or_else(|| rest.strip_prefix("backbone."))
        {
            rest = r;
        }
        match rest {
            "embedding.weight" | "embeddings.weight" => return Some(Slot::Embedding),
            "norm_f.weight" => return Some(Slot::FinalNorm),
            "lm_head.weight" => return Some(Slot::LmHead),
            _ => {}
        }
        let rest = rest.strip_prefix("layers.")?;
        let (index, part) = rest.split_once('.')?;
        let index: usize = index.parse().ok()?;
        let part = match part {
            "norm.weight" => Part::Norm,
            "mixer.in_proj.weight" => Part::InProj,
            "mixer.conv1d.weight" => Part::ConvWeight,
            "mixer.conv1d.bias" => Part::ConvBias,
            "mixer.dt_bias" => Part::DtBias,
            "mixer.A_log" => Part::ALog,
            "mixer.D" => Part::D,
            "mixer.norm.weight" => Part::MixerNorm,
            "mixer.out_proj.weight" => Part::OutProj,
            _ => return None,
        };
        Some(Slot::Layer(index, part))
    }

    /// The HF spelling, used when a tensor is missing and there is no name to quote.
    fn canonical_name(self) -> String {
        match self {
            Slot::Embedding => "backbone.embeddings.weight".into(),
            Slot::FinalNorm => "backbone.norm_f.weight".into(),
            Slot::LmHead => "lm_head.weight".into(),
            Slot::Layer(i, p) => {
                let part = match p {
                    Part::Norm => "norm.weight",
                    Part::InProj => "mixer.in_proj.weight",
                    Part::ConvWeight => "mixer.conv1d.weight",
                    Part::ConvBias => "mixer.conv1d.bias",
                    Part::DtBias => "mixer.dt_bias",
                    Part::ALog => "mixer.A_log",
                    Part::D => "mixer.D",
                    Part::MixerNorm => "mixer.norm.weight",
                    Part::OutProj => "mixer.out_proj.weight",
                };
                format!("backbone.layers.{i}.{part}")
            }
        }
    }
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
    }
}
