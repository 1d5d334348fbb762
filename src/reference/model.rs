//! `CpuModel`: the whole forward pass on the CPU — embedding, blocks (Mamba2, attention,
//! MLP), final norm, head — in f32 or f64, from any state, with either scan. It is the
//! oracle every GPU path is judged against.

use super::attention::{attend, rope};
use super::math::{Real, gated_group_rmsnorm, matmul, rmsnorm, silu, softplus};
use super::moe::{Route, route_grouped, route_softmax_top_k, routed_sum};
use super::ssd::{ScanDims, ScanInputs, scan_chunked, scan_sequential};
use crate::config::{AttentionConfig, MlpAct, MlpConfig, ModelConfig, MoeConfig};
use crate::error::{Error, Result};
use crate::model::quant::map_finite;
use crate::model::{MambaWeights, MixerWeights, MlpWeights, ModelWeights, Tensor};
pub use crate::state::{LayerState, State};

/// How the SSM part of a forward pass is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scan {
    /// The decode recurrence, token by token.
    Sequential,
    /// The chunked SSD with this chunk length.
    Chunked(usize),
}

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// A Mamba2 mixer's weights in `T`.
struct Mamba<T> {
    in_proj: Vec<T>,
    conv_weight: Vec<T>,
    conv_bias: Vec<T>,
    dt_bias: Vec<T>,
    /// `A = −exp(A_log)`, computed in f32 as every implementation does, then widened.
    a: Vec<T>,
    d_skip: Vec<T>,
    mixer_norm: Vec<T>,
    out_proj: Vec<T>,
}

/// An attention mixer's weights in `T`: `[q | k | v]` rows stacked, `o`, biases.
struct Attention<T> {
    qkv: Vec<T>,
    qkv_bias: Option<Vec<T>>,
    o: Vec<T>,
    o_bias: Option<Vec<T>>,
}

/// An MLP mixer's weights in `T`.
struct Mlp<T> {
    up: Vec<T>,
    up_bias: Option<Vec<T>>,
    gate: Option<(Vec<T>, Option<Vec<T>>)>,
    down: Vec<T>,
    down_bias: Option<Vec<T>>,
}

/// An MoE block's weights in `T`: router `[E, d]`, correction bias `[E]`, the experts and
/// the shared expert as MLPs.
struct Moe<T> {
    router: Vec<T>,
    correction_bias: Option<Vec<T>>,
    experts: Vec<Mlp<T>>,
    shared: Option<Mlp<T>>,
    /// `fc1_latent_proj [L, d]`, `fc2_latent_proj [d, L]`.
    latent: Option<(Vec<T>, Vec<T>)>,
}

enum Mixer<T> {
    Mamba2(Mamba<T>),
    Attention(Attention<T>),
    Mlp(Mlp<T>),
    Moe(Moe<T>),
}

struct Layer<T> {
    norm: Vec<T>,
    mixer: Mixer<T>,
}

/// The model's weights converted to `T`, ready to run.
pub struct CpuModel<T> {
    pub config: ModelConfig,
    /// The longest sequence the KV caches may hold (`--ctx`; no limit without attention).
    pub context: usize,
    embedding: Vec<T>,
    layers: Vec<Layer<T>>,
    final_norm: Vec<T>,
    lm_head: Option<Vec<T>>,
}

/// `t` in `T`, or an error naming it if it holds a NaN or ±Inf (checked in the same pass).
fn convert<T: Real>(t: &Tensor) -> Result<Vec<T>> {
    map_finite(t, T::of_f32)
}

/// `convert` of an optional tensor.
fn convert_opt<T: Real>(t: Option<&Tensor>) -> Result<Option<Vec<T>>> {
    t.map(convert).transpose()
}

impl<T: Real> CpuModel<T> {
    /// Converts every weight to `T` (the memory cost is the model at `T`'s width). A weight
    /// holding a NaN or ±Inf is an error naming it.
    pub fn new(config: &ModelConfig, weights: &ModelWeights) -> Result<Self> {
        let total: u64 = weights.all().iter().map(|t| t.numel() as u64).sum();
        let bar = crate::progress::bar(total, "converting weights");
        let mut layers = Vec::with_capacity(weights.layers.len());
        for l in &weights.layers {
            bar.inc(
                l.mixer
                    .tensors()
                    .iter()
                    .map(|t| t.numel() as u64)
                    .sum::<u64>(),
            );
            let mixer = match &l.mixer {
                MixerWeights::Mamba2(m) => Mixer::Mamba2(mamba(config, m)?),
                MixerWeights::Attention(a) => {
                    let mut qkv: Vec<T> = convert(&a.q)?;
                    qkv.extend(convert::<T>(&a.k)?);
                    qkv.extend(convert::<T>(&a.v)?);
                    let qkv_bias = match &a.bias {
                        Some(b) => {
                            let mut v: Vec<T> = convert(&b[0])?;
                            v.extend(convert::<T>(&b[1])?);
                            v.extend(convert::<T>(&b[2])?);
                            Some(v)
                        }
                        None => None,
                    };
                    Mixer::Attention(Attention {
                        qkv,
                        qkv_bias,
                        o: convert(&a.o)?,
                        o_bias: convert_opt(a.bias.as_ref().map(|b| &b[3]))?,
                    })
                }
                MixerWeights::Mlp(m) => Mixer::Mlp(mlp_weights(m)?),
                MixerWeights::Moe(m) => Mixer::Moe(Moe {
                    router: convert(&m.router)?,
                    correction_bias: convert_opt(m.correction_bias.as_ref())?,
                    experts: m.experts.iter().map(mlp_weights).collect::<Result<_>>()?,
                    shared: m.shared.as_ref().map(mlp_weights).transpose()?,
                    latent: match &m.latent {
                        Some([a, b]) => Some((convert(a)?, convert(b)?)),
                        None => None,
                    },
                }),
            };
            layers.push(Layer {
                norm: convert(&l.norm)?,
                mixer,
            });
        }
        let model = CpuModel {
            config: config.clone(),
            context: if config.attention.is_some() {
                config.max_context.unwrap_or(usize::MAX)
            } else {
                usize::MAX
            },
            embedding: convert(&weights.embedding)?,
            layers,
            final_norm: convert(&weights.final_norm)?,
            lm_head: convert_opt(weights.lm_head.as_ref())?,
        };
        bar.finish_and_clear();
        Ok(model)
    }

    /// A zero state (a fresh sequence).
    pub fn new_state(&self) -> State<T> {
        State::new(&self.config)
    }

    /// Limits the sequence length (the KV caches) to `n` tokens.
    pub fn with_context(mut self, n: usize) -> Self {
        self.context = n;
        self
    }

    /// Refuses `tokens` that `forward` could not feed from `state`: none, an id outside the
    /// vocabulary, more than the context holds, a state of another shape.
    pub fn check_feed(&self, state: &State<T>, tokens: &[u32]) -> Result<()> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(Error::InvalidInput("no tokens to feed".into()));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::InvalidInput(format!(
                "token id {bad} is outside the vocabulary (size {})",
                c.vocab_size
            )));
        }
        state.check(c)?;
        if state.len.saturating_add(tokens.len()) > self.context {
            return Err(Error::InvalidInput(format!(
                "{}: {} tokens so far + {} new exceed the {}-token context \
                 (--ctx)",
                crate::session::CONTEXT_FULL,
                state.len,
                tokens.len(),
                self.context
            )));
        }
        Ok(())
    }

    /// Feeds `tokens` through the model from `state` (updated in place) and returns the
    /// requested logits, each `[vocab]`.
    pub fn forward(
        &self,
        state: &mut State<T>,
        tokens: &[u32],
        scan: Scan,
        want: Logits,
    ) -> Result<Vec<Vec<T>>> {
        self.check_feed(state, tokens)?;
        let c = &self.config;
        let d = c.d_model;
        let (embedding_scale, residual_scale) =
            (T::of(c.scales.embedding), T::of(c.scales.residual));
        let mut resid: Vec<Vec<T>> = tokens
            .iter()
            .map(|&t| {
                self.embedding[t as usize * d..][..d]
                    .iter()
                    .map(|&e| e * embedding_scale)
                    .collect()
            })
            .collect();
        let pos0 = state.len;
        for (layer, st) in self.layers.iter().zip(state.layers.iter_mut()) {
            let hs: Vec<Vec<T>> = resid
                .iter()
                .map(|r| rmsnorm(r, &layer.norm, c.norm_eps))
                .collect();
            let out = match (&layer.mixer, st) {
                (Mixer::Mamba2(m), LayerState::Mamba2 { conv, ssm }) => {
                    self.mamba(m, conv, ssm, &hs, scan)
                }
                (Mixer::Attention(a), LayerState::Attention { k, v }) => {
                    let ac = c.attention.as_ref().ok_or_else(|| {
                        Error::InvalidInput("an attention layer without an attention shape".into())
                    })?;
                    attention(ac, a, k, v, pos0, &hs)
                }
                (Mixer::Mlp(m), LayerState::Stateless) => {
                    let mc = c.mlp.as_ref().ok_or_else(|| {
                        Error::InvalidInput("an MLP layer without an MLP shape".into())
                    })?;
                    mlp(mc, m, &hs)
                }
                (Mixer::Moe(m), LayerState::Stateless) => {
                    let mc = c.moe.as_ref().ok_or_else(|| {
                        Error::InvalidInput("an MoE layer without an MoE shape".into())
                    })?;
                    moe(mc, m, &hs)
                }
                _ => unreachable!("State::check matched the layers"),
            };
            for (r, o) in resid.iter_mut().zip(out) {
                r.iter_mut()
                    .zip(o)
                    .for_each(|(r, o)| *r = *r + residual_scale * o);
            }
        }
        state.len += tokens.len();
        let positions: &[Vec<T>] = match want {
            Logits::None => &[],
            Logits::Last => &resid[resid.len().saturating_sub(1)..],
            Logits::All => &resid,
        };
        Ok(self.logits(positions))
    }

    /// `lm_head · RMSNorm(r)·w_f` for each residual vector.
    pub fn logits(&self, resid: &[Vec<T>]) -> Vec<Vec<T>> {
        let hs: Vec<Vec<T>> = resid
            .iter()
            .map(|r| rmsnorm(r, &self.final_norm, self.config.norm_eps))
            .collect();
        let head = self.lm_head.as_ref().unwrap_or(&self.embedding);
        let mut out = matmul(head, self.config.vocab_size, &hs);
        let scale = T::of(self.config.scales.logits);
        for v in out.iter_mut().flatten() {
            *v = *v * scale;
        }
        out
    }

    /// A Mamba2 mixer over the `L` normed inputs `hs`: the residual update of each token.
    fn mamba(
        &self,
        w: &Mamba<T>,
        conv_state: &mut [T],
        ssm_state: &mut [T],
        hs: &[Vec<T>],
        scan: Scan,
    ) -> Vec<Vec<T>> {
        let c = &self.config;
        let (di, cd, heads, gn) = (c.d_inner, c.conv_dim(), c.n_heads, c.n_groups * c.d_state);
        let l = hs.len();
        let zxbcdt = matmul(&w.in_proj, c.d_in_proj(), hs);
        // Causal depthwise conv over [cached K−1 columns | this chunk], then SiLU.
        let k = c.d_conv;
        let mut x = Vec::with_capacity(l * di);
        let mut b = Vec::with_capacity(l * gn);
        let mut cc = Vec::with_capacity(l * gn);
        let mut window = vec![T::zero(); k - 1 + l];
        let mut u_all = vec![T::zero(); l * cd];
        for ch in 0..cd {
            window[..k - 1].copy_from_slice(&conv_state[ch * (k - 1)..][..k - 1]);
            for t in 0..l {
                window[k - 1 + t] = zxbcdt[t][di + ch];
            }
            let wk = &w.conv_weight[ch * k..][..k];
            for t in 0..l {
                let acc: T = (0..k).map(|j| wk[j] * window[t + j]).sum();
                u_all[t * cd + ch] = silu(acc + w.conv_bias[ch]);
            }
            conv_state[ch * (k - 1)..][..k - 1].copy_from_slice(&window[l..l + k - 1]);
        }
        for t in 0..l {
            let u = &u_all[t * cd..][..cd];
            x.extend_from_slice(&u[..di]);
            b.extend_from_slice(&u[di..di + gn]);
            cc.extend_from_slice(&u[di + gn..]);
        }
        let (lo, hi) = c.time_step_limit;
        let dt: Vec<T> = zxbcdt
            .iter()
            .flat_map(|z| {
                (0..heads).map(move |h| {
                    let v = softplus(z[di + cd + h] + w.dt_bias[h]);
                    v.max(T::of(lo)).min(T::of(hi))
                })
            })
            .collect();
        let inputs = ScanInputs {
            dims: ScanDims {
                heads,
                head_dim: c.head_dim,
                groups: c.n_groups,
                d_state: c.d_state,
            },
            x: &x,
            dt: &dt,
            a: &w.a,
            b: &b,
            c: &cc,
            d: &w.d_skip,
        };
        let y = match scan {
            Scan::Sequential => scan_sequential(&inputs, ssm_state),
            Scan::Chunked(q) => scan_chunked(&inputs, ssm_state, q),
        };
        let vs: Vec<Vec<T>> = (0..l)
            .map(|t| {
                gated_group_rmsnorm(
                    &y[t * di..][..di],
                    &zxbcdt[t][..di],
                    &w.mixer_norm,
                    c.n_groups,
                    c.norm_eps,
                )
            })
            .collect();
        matmul(&w.out_proj, c.d_model, &vs)
    }
}

/// A Mamba2 mixer's weights in `T` (`A = −exp(A_log)` computed in f32, as every
/// implementation does, then widened).
fn mamba<T: Real>(c: &ModelConfig, m: &MambaWeights) -> Result<Mamba<T>> {
    Ok(Mamba {
        in_proj: convert(&m.in_proj)?,
        conv_weight: convert(&m.conv_weight)?,
        conv_bias: convert_opt(m.conv_bias.as_ref())?
            .unwrap_or_else(|| vec![T::zero(); c.conv_dim()]),
        dt_bias: convert(&m.dt_bias)?,
        a: m.a()?.into_iter().map(T::of_f32).collect(),
        d_skip: convert(&m.d_skip)?,
        mixer_norm: convert(&m.mixer_norm)?,
        out_proj: convert(&m.out_proj)?,
    })
}

/// An MLP's weights in `T`.
fn mlp_weights<T: Real>(m: &MlpWeights) -> Result<Mlp<T>> {
    Ok(Mlp {
        up: convert(&m.up)?,
        up_bias: convert_opt(m.up_bias.as_ref())?,
        gate: match &m.gate {
            Some(g) => Some((convert(g)?, convert_opt(m.gate_bias.as_ref())?)),
            None => None,
        },
        down: convert(&m.down)?,
        down_bias: convert_opt(m.down_bias.as_ref())?,
    })
}

/// One token's routing (`moe.rs`: transformers' formulas) from its router logits.
pub fn route<T: Real>(mc: &MoeConfig, logits: &[T], correction_bias: Option<&[T]>) -> Route<T> {
    match (mc.group_routing(), correction_bias) {
        (Some(g), Some(bias)) => route_grouped(logits, bias, &g),
        (Some(g), None) => route_grouped(logits, &vec![T::zero(); mc.experts], &g),
        (None, _) => route_softmax_top_k(logits, mc.top_k),
    }
}

/// An MoE block over the normed inputs `hs`: each token's `top_k` experts, weighted, plus
/// the shared expert.
fn moe<T: Real>(mc: &MoeConfig, w: &Moe<T>, hs: &[Vec<T>]) -> Vec<Vec<T>> {
    let expert_shape = MlpConfig {
        intermediate: mc.intermediate,
        act: mc.act,
        bias: false,
    };
    let logits = matmul(&w.router, mc.experts, hs);
    // The routed experts read the latent projection of x when there is one.
    let xs = match &w.latent {
        Some((fc1, _)) => matmul(fc1, fc1.len() / hs[0].len(), hs),
        None => hs.to_vec(),
    };
    let routed: Vec<Vec<T>> = xs
        .iter()
        .zip(&logits)
        .map(|(x, logits)| {
            let r = route(mc, logits, w.correction_bias.as_deref());
            let x = std::slice::from_ref(x);
            routed_sum(&r, x[0].len(), |e| {
                mlp(&expert_shape, &w.experts[e], x).swap_remove(0)
            })
        })
        .collect();
    let mut out = match &w.latent {
        Some((_, fc2)) => matmul(fc2, hs[0].len(), &routed),
        None => routed,
    };
    if let (Some(sc), Some(sw)) = (&mc.shared, &w.shared) {
        for (o, s) in out.iter_mut().zip(mlp(sc, sw, hs)) {
            o.iter_mut().zip(s).for_each(|(o, s)| *o = *o + s);
        }
    }
    out
}

/// `W·x + b` for each row of `xs`.
fn linear<T: Real>(w: &[T], bias: Option<&Vec<T>>, rows: usize, xs: &[Vec<T>]) -> Vec<Vec<T>> {
    let mut out = matmul(w, rows, xs);
    if let Some(b) = bias {
        for o in &mut out {
            o.iter_mut().zip(b).for_each(|(o, &b)| *o = *o + b);
        }
    }
    out
}

/// An attention mixer over the normed inputs `hs` of the tokens at `pos0…`: their K and V
/// rows are appended to the caches, then each token attends to every row up to its own.
fn attention<T: Real>(
    ac: &AttentionConfig,
    w: &Attention<T>,
    k_cache: &mut Vec<T>,
    v_cache: &mut Vec<T>,
    pos0: usize,
    hs: &[Vec<T>],
) -> Vec<Vec<T>> {
    let (qw, kw) = (ac.q_width(), ac.kv_width());
    let qkv = linear(&w.qkv, w.qkv_bias.as_ref(), ac.qkv_rows(), hs);
    let mut q = Vec::with_capacity(hs.len() * qw);
    for (t, row) in qkv.iter().enumerate() {
        let (mut qt, mut kt) = (row[..qw].to_vec(), row[qw..qw + kw].to_vec());
        if let Some(theta) = ac.rope_theta {
            rope(&mut qt, ac.head_dim, pos0 + t, theta);
            rope(&mut kt, ac.head_dim, pos0 + t, theta);
        }
        q.extend(qt);
        k_cache.extend(kt);
        v_cache.extend_from_slice(&row[qw + kw..]);
    }
    let o = attend(ac.dims(), &q, k_cache, v_cache, pos0, T::of(ac.scale));
    let rows: Vec<Vec<T>> = o.chunks(qw).map(<[T]>::to_vec).collect();
    linear(&w.o, w.o_bias.as_ref(), w.o.len() / qw, &rows)
}

/// An MLP mixer: `down(relu(up(x))²)` or `down(silu(gate(x)) · up(x))`.
fn mlp<T: Real>(mc: &MlpConfig, w: &Mlp<T>, hs: &[Vec<T>]) -> Vec<Vec<T>> {
    let n = mc.intermediate;
    let mut a = linear(&w.up, w.up_bias.as_ref(), n, hs);
    match (mc.act, &w.gate) {
        (MlpAct::Relu2, _) => {
            for x in a.iter_mut().flatten() {
                let r = x.max(T::zero());
                *x = r * r;
            }
        }
        (MlpAct::SiluGated, Some((g, gb))) => {
            let g = linear(g, gb.as_ref(), n, hs);
            for (x, g) in a.iter_mut().flatten().zip(g.iter().flatten()) {
                *x = silu(*g) * *x;
            }
        }
        (MlpAct::SiluGated, None) => unreachable!("gated MLPs load a gate"),
    }
    linear(&w.down, w.down_bias.as_ref(), w.down.len() / n, &a)
}
