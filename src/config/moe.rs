//! The mixture-of-experts block's shape: how many experts, how a token picks its `top_k`, what
//! an expert computes, and the always-on shared expert. Parsed from Nemotron-H
//! (`n_routed_experts`, group routing) and Granite-4.0-H (`num_local_experts`, softmax top-k).

use super::{Fields, MlpAct, MlpConfig};
use crate::error::Result;
use crate::reference::moe::{GroupRouting, check_top_k};

/// How a token's router logits become its experts and their weights (HYBRIDS.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Router {
    /// Nemotron-H (DeepSeek-V3's router): sigmoid scores, selection on scores plus the
    /// `e_score_correction_bias`, limited to the best `topk_group` of `n_group` groups;
    /// weights from the uncorrected scores, normalised when `norm_topk_prob`, times
    /// `routed_scaling_factor`.
    Grouped {
        n_group: usize,
        topk_group: usize,
        norm_topk_prob: bool,
        routed_scaling_factor: f64,
    },
    /// Granite (Mixtral's router): the `top_k` best logits, softmax over those only.
    SoftmaxTopK,
}

/// The MoE layers' shape.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts `E`.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Width of one routed expert.
    pub intermediate: usize,
    /// What a routed expert computes (`relu2`: `down(relu(up x)²)`; gated: `[gate; up]`).
    pub act: MlpAct,
    pub router: Router,
    /// The shared expert added to every token (its own width and activation).
    pub shared: Option<MlpConfig>,
    /// Latent MoE (`moe_latent_size`, Nemotron 3 Super): the routed experts read
    /// `fc1_latent_proj · x` of this width and their weighted sum goes back through
    /// `fc2_latent_proj`; the router and the shared expert read `x`.
    pub latent: Option<usize>,
}

impl MoeConfig {
    /// Width of what the routed experts read and write: the latent width, or `d`.
    pub fn expert_width(&self, d_model: usize) -> usize {
        self.latent.unwrap_or(d_model)
    }

    /// Rows of one expert's up projection: `I`, or `2I` for `[gate; up]`.
    pub fn up_rows(&self) -> usize {
        match self.act {
            MlpAct::Relu2 => self.intermediate,
            MlpAct::SiluGated => 2 * self.intermediate,
        }
    }

    /// The shared expert as `S` always-chosen experts of the routed experts' width, when its
    /// width is a multiple of theirs and it computes the same activation (0 otherwise): an
    /// MLP of width `S·I` is the sum of `S` MLPs of width `I` over its slices of intermediate
    /// channels. The GPU stores them after the routed experts and runs them in the same
    /// dispatches (Nemotron 3 Nano: 3712 = 2 × 1856; Granite-4.0-H: 1024 = 2 × 512,
    /// 1536 = 2 × 768). Not with latent projections: the shared expert reads `x`, the routed
    /// experts the latent.
    pub fn shared_slots(&self) -> usize {
        match &self.shared {
            // With latent projections the shared expert reads `x`, the routed ones the latent.
            Some(_) if self.latent.is_some() => 0,
            Some(s) if s.act == self.act && s.intermediate.is_multiple_of(self.intermediate) => {
                s.intermediate / self.intermediate
            }
            _ => 0,
        }
    }

    /// Experts chosen per token on the GPU: `top_k` routed plus the shared slots.
    pub fn slots(&self) -> usize {
        self.top_k + self.shared_slots()
    }

    /// Experts stored in the GPU's banks: the routed ones, then the shared slots.
    pub fn stored_experts(&self) -> usize {
        self.experts + self.shared_slots()
    }

    /// Whether the router adds a per-expert correction bias before choosing.
    pub fn has_correction_bias(&self) -> bool {
        matches!(self.router, Router::Grouped { .. })
    }

    /// The grouped router's settings for the CPU reference (`None` for softmax top-k).
    pub fn group_routing(&self) -> Option<GroupRouting> {
        match self.router {
            Router::Grouped {
                n_group,
                topk_group,
                norm_topk_prob,
                routed_scaling_factor,
            } => Some(GroupRouting {
                experts: self.experts,
                n_group,
                topk_group,
                top_k: self.top_k,
                norm_topk_prob,
                routed_scaling_factor,
            }),
            Router::SoftmaxTopK => None,
        }
    }

    /// The routing settings every kernel relies on: a message naming the config key when
    /// transformers itself could not run them.
    pub fn check(&self) -> std::result::Result<(), (&'static str, String)> {
        match self.group_routing() {
            Some(g) => g.check().map_err(|m| {
                let field = if m.starts_with("num_experts_per_tok") {
                    "num_experts_per_tok"
                } else if m.starts_with("topk_group") {
                    "topk_group"
                } else {
                    "n_group"
                };
                (field, m)
            }),
            None => check_top_k(self.experts, self.top_k).map_err(|m| ("num_experts_per_tok", m)),
        }?;
        if let Router::Grouped {
            routed_scaling_factor: s,
            ..
        } = self.router
            && !(s == 0.0 || super::f32_normal(s))
        {
            // (An f32 in the routing kernel and the reference.)
            return Err((
                "routed_scaling_factor",
                format!(
                    "must be 0 or an f32 (magnitude {}), found {s}",
                    super::f32_range()
                ),
            ));
        }
        if self.intermediate == 0 {
            return Err(("moe_intermediate_size", "must be positive".into()));
        }
        if self.latent == Some(0) {
            return Err(("moe_latent_size", "must be positive (or null)".into()));
        }
        Ok(())
    }
}

/// Nemotron-H's `E` layers (transformers 5.17 `NemotronHMOE`): one shared expert of
/// `moe_shared_expert_intermediate_size` whatever `n_shared_experts` says, as transformers
/// builds it.
pub(super) fn parse_nemotron_h_moe(f: &Fields) -> Result<MoeConfig> {
    if let Some(act) = f.opt_str("mlp_hidden_act")? {
        f.reject_if(
            "mlp_hidden_act",
            act != "relu2",
            &format!("the expert activation `{act}` (Nemotron-H experts are relu2)"),
        )?;
    }
    let shared = match f.usize_or("moe_shared_expert_intermediate_size", 0)? {
        0 => None,
        width => Some(MlpConfig {
            intermediate: width,
            act: MlpAct::Relu2,
            bias: false,
        }),
    };
    Ok(MoeConfig {
        experts: f.usize("n_routed_experts")?,
        top_k: f.usize("num_experts_per_tok")?,
        intermediate: f.usize("moe_intermediate_size")?,
        act: MlpAct::Relu2,
        router: Router::Grouped {
            n_group: f.usize_or("n_group", 1)?,
            topk_group: f.usize_or("topk_group", 1)?,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            routed_scaling_factor: f.f64_or("routed_scaling_factor", 1.0)?,
        },
        shared,
        latent: f.opt_usize("moe_latent_size")?,
    })
}
