//! `CpuModel`: the whole Mamba2 forward pass on the CPU, in f32 or f64, from any state,
//! with either scan. It is the oracle every GPU path is judged against.

use super::math::{Real, gated_group_rmsnorm, matmul, rmsnorm, silu, softplus};
use super::ssd::{ScanDims, ScanInputs, scan_chunked, scan_sequential};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::{Mamba2Weights, Tensor};

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

/// The recurrent state of one sequence: per layer, the conv state `[conv_dim][K−1]`
/// (oldest column first) and the SSM state `[H][P][N]`.
#[derive(Clone, Debug, PartialEq)]
pub struct State<T> {
    pub conv: Vec<Vec<T>>,
    pub ssm: Vec<Vec<T>>,
}

struct Layer<T> {
    norm: Vec<T>,
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

/// The model's weights converted to `T`, ready to run.
pub struct CpuModel<T> {
    pub config: ModelConfig,
    embedding: Vec<T>,
    layers: Vec<Layer<T>>,
    final_norm: Vec<T>,
    lm_head: Option<Vec<T>>,
}

fn convert<T: Real>(t: &Tensor) -> Vec<T> {
    t.to_f32().into_iter().map(T::of_f32).collect()
}

impl<T: Real> CpuModel<T> {
    /// Converts every weight to `T` (the memory cost is the model at `T`'s width).
    pub fn new(config: &ModelConfig, weights: &Mamba2Weights) -> Self {
        let total: u64 = weights.all().iter().map(|t| t.numel() as u64).sum();
        let bar = crate::progress::bar(total, "converting weights");
        let layers = weights
            .layers
            .iter()
            .inspect(|l| bar.inc((l.in_proj.numel() + l.out_proj.numel()) as u64))
            .map(|l| Layer {
                norm: convert(&l.norm),
                in_proj: convert(&l.in_proj),
                conv_weight: convert(&l.conv_weight),
                conv_bias: l
                    .conv_bias
                    .as_ref()
                    .map(convert)
                    .unwrap_or_else(|| vec![T::zero(); config.conv_dim()]),
                dt_bias: convert(&l.dt_bias),
                a: l.a_log
                    .to_f32()
                    .into_iter()
                    .map(|v| T::of_f32(-v.exp()))
                    .collect(),
                d_skip: convert(&l.d_skip),
                mixer_norm: convert(&l.mixer_norm),
                out_proj: convert(&l.out_proj),
            })
            .collect();
        let model = CpuModel {
            config: config.clone(),
            embedding: convert(&weights.embedding),
            layers,
            final_norm: convert(&weights.final_norm),
            lm_head: weights.lm_head.as_ref().map(convert),
        };
        bar.finish_and_clear();
        model
    }

    /// A zero state (a fresh sequence).
    pub fn new_state(&self) -> State<T> {
        let c = &self.config;
        State {
            conv: vec![vec![T::zero(); c.conv_state_len()]; c.n_layer],
            ssm: vec![vec![T::zero(); c.ssm_state_len()]; c.n_layer],
        }
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
        let c = &self.config;
        let d = c.d_model;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::InvalidInput(format!(
                "token id {bad} is outside the vocabulary (size {})",
                c.vocab_size
            )));
        }
        let mut resid: Vec<Vec<T>> = tokens
            .iter()
            .map(|&t| self.embedding[t as usize * d..][..d].to_vec())
            .collect();
        for (i, layer) in self.layers.iter().enumerate() {
            let out = self.mixer(layer, &mut state.conv[i], &mut state.ssm[i], &resid, scan);
            for (r, o) in resid.iter_mut().zip(out) {
                r.iter_mut().zip(o).for_each(|(r, o)| *r = *r + o);
            }
        }
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
        matmul(head, self.config.vocab_size, &hs)
    }

    /// One block's mixer over `L` tokens: returns the residual update of each token.
    fn mixer(
        &self,
        w: &Layer<T>,
        conv_state: &mut [T],
        ssm_state: &mut [T],
        resid: &[Vec<T>],
        scan: Scan,
    ) -> Vec<Vec<T>> {
        let c = &self.config;
        let (di, cd, heads, gn) = (c.d_inner, c.conv_dim(), c.n_heads, c.n_groups * c.d_state);
        let l = resid.len();
        let hs: Vec<Vec<T>> = resid
            .iter()
            .map(|r| rmsnorm(r, &w.norm, c.norm_eps))
            .collect();
        let zxbcdt = matmul(&w.in_proj, c.d_in_proj(), &hs);
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
