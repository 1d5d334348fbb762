//! Reading the GPU state back without stalling decode: a copy of every Mamba2 layer's conv
//! and SSM state buffers into staging buffers is queued behind the tokens already submitted
//! (so it sees the state at a token boundary), mapped asynchronously, and picked up later
//! when the decode loop's own polling has completed it. Nothing waits for it on the hot
//! path; at most one copy is in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::config::{BlockKind, ModelConfig};
use crate::error::{Error, Result};
use crate::gpu::context::GpuContext;
use crate::gpu::engine::Engine;
use crate::state::{LayerState, State};

struct Pending {
    remaining: Arc<AtomicUsize>,
    failed: Arc<AtomicBool>,
    position: u64,
    /// Tokens in the KV caches when the copy was queued.
    len: usize,
}

/// Asynchronous snapshots of an engine's state.
pub struct StateTap {
    ctx: Arc<GpuContext>,
    config: ModelConfig,
    /// Per layer: (conv state, SSM state) buffers of the engine.
    sources: Vec<(wgpu::Buffer, wgpu::Buffer)>,
    conv_bytes: u64,
    ssm_bytes: u64,
    /// One staging buffer per layer, `[conv | ssm]`, made on first use.
    staging: Vec<wgpu::Buffer>,
    pending: Option<Pending>,
}

impl StateTap {
    pub fn new(engine: &Engine) -> Self {
        let c = &engine.config;
        StateTap {
            ctx: engine.ctx().clone(),
            config: c.clone(),
            sources: engine.state.mamba_buffers(),
            conv_bytes: 4 * c.conv_state_len() as u64,
            ssm_bytes: 4 * c.ssm_state_len() as u64,
            staging: Vec::new(),
            pending: None,
        }
    }

    /// Whether a copy is in flight.
    pub fn busy(&self) -> bool {
        self.pending.is_some()
    }

    /// Queues a copy of the state as the work submitted so far leaves it; `position` is
    /// remembered with it. Returns false (and does nothing) while a copy is in flight.
    pub fn request(&mut self, position: u64) -> Result<bool> {
        if self.pending.is_some() {
            return Ok(false);
        }
        if self.staging.is_empty() {
            let usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
            for i in 0..self.sources.len() {
                let b = self.ctx.buffer(
                    &format!("state tap {i}"),
                    self.conv_bytes + self.ssm_bytes,
                    usage,
                )?;
                self.staging.push(b);
            }
        }
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        for ((conv, ssm), dst) in self.sources.iter().zip(&self.staging) {
            enc.copy_buffer_to_buffer(conv, 0, dst, 0, Some(self.conv_bytes));
            enc.copy_buffer_to_buffer(ssm, 0, dst, self.conv_bytes, Some(self.ssm_bytes));
        }
        self.ctx.queue.submit([enc.finish()]);
        let remaining = Arc::new(AtomicUsize::new(self.staging.len()));
        let failed = Arc::new(AtomicBool::new(false));
        for dst in &self.staging {
            let (r, f) = (remaining.clone(), failed.clone());
            dst.map_async(wgpu::MapMode::Read, .., move |res| {
                if res.is_err() {
                    f.store(true, Ordering::SeqCst);
                }
                r.fetch_sub(1, Ordering::SeqCst);
            });
        }
        self.pending = Some(Pending {
            remaining,
            failed,
            position,
            // Tokens fed so far: the rows in every KV cache.
            len: position as usize,
        });
        Ok(true)
    }

    /// The state of the copy in flight once it has landed (never blocks; the decode loop's
    /// polling completes it, or `poll` when idle).
    pub fn try_take(&mut self) -> Result<Option<(State<f32>, u64)>> {
        let done = self
            .pending
            .as_ref()
            .is_some_and(|p| p.remaining.load(Ordering::SeqCst) == 0);
        if !done {
            return Ok(None);
        }
        let Some(p) = self.pending.take() else {
            return Ok(None);
        };
        if p.failed.load(Ordering::SeqCst) {
            for b in &self.staging {
                b.unmap();
            }
            return Err(Error::Gpu(
                "state readback: mapping failed (device lost?)".into(),
            ));
        }
        let conv_len = (self.conv_bytes / 4) as usize;
        let mut tapped = Vec::with_capacity(self.staging.len());
        for b in &self.staging {
            {
                let view = b
                    .get_mapped_range(..)
                    .map_err(|e| Error::Gpu(format!("state readback: {e}")))?;
                let all: &[f32] = bytemuck::cast_slice(&view);
                tapped.push((all[..conv_len].to_vec(), all[conv_len..].to_vec()));
            }
            b.unmap();
        }
        // The Mamba2 layers as read; attention layers with their length only (the view
        // shows their occupancy, not their values).
        let mut tapped = tapped.into_iter();
        let layers = self
            .config
            .blocks
            .iter()
            .map(|k| match k {
                BlockKind::Mamba2 => {
                    let (conv, ssm) = tapped.next().unwrap_or_default();
                    LayerState::Mamba2 { conv, ssm }
                }
                BlockKind::Attention => LayerState::Attention {
                    k: Vec::new(),
                    v: Vec::new(),
                },
                BlockKind::Mlp | BlockKind::Moe => LayerState::Stateless,
            })
            .collect();
        let st = State { layers, len: p.len };
        Ok(Some((st, p.position)))
    }

    /// Drives wgpu's callbacks without waiting (for idle moments), then `try_take`.
    pub fn poll(&mut self) -> Result<Option<(State<f32>, u64)>> {
        if self.pending.is_some() {
            let _ = self.ctx.device.poll(wgpu::PollType::Poll);
        }
        self.try_take()
    }

    /// Waits for the copy in flight (idle moments only).
    pub fn wait(&mut self) -> Result<Option<(State<f32>, u64)>> {
        if self.pending.is_some() {
            self.ctx.wait()?;
        }
        self.try_take()
    }

    /// Frees the staging memory (when live state is turned off).
    pub fn release(&mut self) -> Result<()> {
        if self.pending.is_some() {
            let _ = self.wait()?;
        }
        self.staging.clear();
        Ok(())
    }
}
