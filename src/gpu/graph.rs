//! The fixed dispatch lists of a token (fused and unfused), built once at load from the
//! engine's resident buffers, and their recording into one compute pass.
//!
//! Fused, per layer (3 dispatches):
//! 1. `gemv` in_proj with the block pre-norm in its prologue and the conv step + dt
//!    softplus in its epilogue (each conv channel has exactly one writer);
//! 2. `ssd_step` (gated): state update, y = C·S + D·x, v = y·silu(z), Σv² per block;
//! 3. `gemv` out_proj with the gated group norm in its prologue, residual add epilogue.
//!
//! Unfused (7): rmsnorm, gemv, conv_step, ssd_step, gated_norm, gemv, residual_add.
//! Around the layers: embed first; final norm + lm_head (fused: one gemv) and the sampler
//! last, or `advance` when the token only feeds the state (prefill through decode).

use bytemuck::{Pod, Zeroable};

use crate::gpu::kernels::Dispatch;

/// The control block (`Ctrl` in common.wgsl): 16 words.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable, PartialEq)]
pub struct Ctrl {
    pub token: u32,
    pub pos: u32,
    pub stopped: u32,
    pub n_stop: u32,
    pub stop_ids: [u32; 4],
    pub seed_key: u32,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub cursor: u32,
    pub prompt_len: u32,
    /// Tokens already in the attention layers' KV caches: the row the token (or the
    /// block's first token) being fed is stored at. `emit`/`advance` move it on.
    pub kv_len: u32,
    /// Set (never cleared) by the sampler (`argmax`/`sample`) when a logit is NaN or ±Inf;
    /// the host reads it with the token and turns it into an error.
    pub nonfinite: u32,
}

impl Ctrl {
    /// The control block of a sequence that feeds `token` with `kv_len` tokens already in
    /// its state and samples at position `pos` by `sampling`; a sampled id in `stop` (at
    /// most 4) stops it.
    pub fn sequence(
        token: u32,
        pos: u64,
        kv_len: usize,
        sampling: &crate::sampling::Sampling,
        stop: &[u32],
    ) -> crate::error::Result<Ctrl> {
        if stop.len() > 4 {
            return Err(crate::error::Error::InvalidInput(format!(
                "at most 4 stop tokens on the GPU, got {}",
                stop.len()
            )));
        }
        let mut stop_ids = [0u32; 4];
        stop_ids[..stop.len()].copy_from_slice(stop);
        Ok(Ctrl {
            token,
            pos: pos as u32,
            stopped: 0,
            n_stop: stop.len() as u32,
            stop_ids,
            seed_key: crate::sampling::seed_key(sampling.seed),
            temperature: sampling.temperature,
            // More than u32::MAX candidates means "all of them", as does any k ≥ vocab.
            top_k: sampling.top_k.min(u32::MAX as usize) as u32,
            top_p: sampling.top_p,
            cursor: 0,
            prompt_len: 0,
            kv_len: kv_len as u32,
            nonfinite: 0,
        })
    }
}

/// What ends a token's dispatch list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tail {
    /// lm_head + argmax: the next token chosen greedily on the device.
    Greedy,
    /// lm_head + the sampling kernel.
    Sample,
    /// No logits: the next prompt token is loaded (prefill through the decode graph).
    Feed,
    /// lm_head, then the next prompt token (logits of every position).
    FeedLogits,
    /// A batch whose lanes both pick greedily and sample: argmax serves the lanes with
    /// temperature ≤ 0, the sampling kernel the others.
    Mixed,
}

impl Tail {
    /// The tail that picks the next token by `sampling`: argmax when greedy.
    pub fn sampling(sampling: &crate::sampling::Sampling) -> Tail {
        if sampling.is_greedy() {
            Tail::Greedy
        } else {
            Tail::Sample
        }
    }
}

/// A token's dispatches, in order.
#[derive(Clone, Default)]
pub struct Graph {
    pub dispatches: Vec<Dispatch>,
}

impl Graph {
    pub fn len(&self) -> usize {
        self.dispatches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.dispatches.is_empty()
    }

    /// Records every dispatch into `pass`; with a query set, a timestamp before the first
    /// dispatch and after each (timestamps inside one pass). `tokens` sizes the grids of
    /// prefill kernels for a block of that many tokens; for a decode graph it is the
    /// rows of the KV caches in use after the step (at most), which picks the decode
    /// attention's tile (`Dispatch::shorter`) and its grid's segments. None
    /// records every dispatch for the longest length.
    pub fn record(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        timestamps: Option<(&wgpu::QuerySet, u32)>,
        tokens: Option<u32>,
    ) {
        if let Some((qs, base)) = timestamps {
            pass.write_timestamp(qs, base);
        }
        for (i, d) in self.dispatches.iter().enumerate() {
            d.record_tokens(pass, tokens);
            if let Some((qs, base)) = timestamps {
                pass.write_timestamp(qs, base + 1 + i as u32);
            }
        }
    }
}
