//! `Engine`: a model resident on one device. Weights are uploaded once (f32, f16 or q8_0
//! for the big matrices; the small per-layer tensors stay f32 in one buffer per layer),
//! the recurrent state and the activation scratch live in storage buffers, and the token
//! graphs (fused and unfused, for each `Tail`) are built once with all their bind groups.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gpu::context::{GpuContext, Needs};
use crate::gpu::graph::{Ctrl, Graph, Tail};
use crate::gpu::kernels::gated_norm::{Batch, GatedNormBuffers};
use crate::gpu::kernels::gemv::{self, GemvBuffers, GemvInput, GemvOutput, MixerConsts};
use crate::gpu::kernels::rmsnorm::NormBuffers;
use crate::gpu::kernels::ssd_step::{self, SsdBuffers, SsdConsts};
use crate::gpu::kernels::{
    Kernels, advance, argmax, conv_step, embed, gated_norm, residual_add, rmsnorm, sample,
};
use crate::gpu::weights::DeviceMatrix;
use crate::model::Model;
use crate::model::quant::{Packed, WeightFormat, pack};
use crate::reference::State;

/// Offsets (in f32) of the small tensors inside a layer's parameter buffer:
/// `[conv_w | conv_b | dt_bias | A | D | norm | mixer_norm]`.
#[derive(Clone, Copy, Debug)]
pub struct ParamLayout {
    pub conv_w: usize,
    pub conv_b: usize,
    pub dt_bias: usize,
    pub a: usize,
    pub d: usize,
    pub norm: usize,
    pub mixer_norm: usize,
    pub len: usize,
}

impl ParamLayout {
    pub fn new(c: &ModelConfig) -> Self {
        let conv_b = c.conv_dim() * c.d_conv;
        let dt_bias = conv_b + c.conv_dim();
        let a = dt_bias + c.n_heads;
        let d = a + c.n_heads;
        let norm = d + c.n_heads;
        let mixer_norm = norm + c.d_model;
        ParamLayout {
            conv_w: 0,
            conv_b,
            dt_bias,
            a,
            d,
            norm,
            mixer_norm,
            len: mixer_norm + c.d_inner,
        }
    }
}

/// Host-side f32 values of one layer's small tensors, in `ParamLayout` order.
pub struct LayerParams {
    pub values: Vec<f32>,
}

/// One layer on the device.
pub struct Layer {
    pub in_proj: DeviceMatrix,
    pub out_proj: DeviceMatrix,
    pub params: wgpu::Buffer,
    pub conv_state: wgpu::Buffer,
    pub ssm_state: wgpu::Buffer,
}

/// A sequence's state copied on the device: conv and SSM state buffers per layer.
pub struct DeviceSnapshot {
    buffers: Vec<wgpu::Buffer>,
}

/// Activation scratch and control buffers, shared by every layer.
pub struct Scratch {
    pub resid: wgpu::Buffer,
    /// `[z | xBC → u | dt → δ]`, d_in_proj values.
    pub mix: wgpu::Buffer,
    /// The SSD step's output (fused: `y·silu(z)·w_norm`, the out_proj input).
    pub y: wgpu::Buffer,
    /// Σv² per SSD channel block (fused).
    pub part: wgpu::Buffer,
    /// The normed input of in_proj / lm_head (f32, zero-padded to a multiple of 32).
    pub h: wgpu::Buffer,
    /// The gated-normed input of out_proj (unfused).
    pub v: wgpu::Buffer,
    /// q8 blocks of the next q8_0 GEMV's input: int8 ×4 per u32, and one scale per block.
    pub xq: wgpu::Buffer,
    pub xd: wgpu::Buffer,
    pub out: wgpu::Buffer,
    pub logits: wgpu::Buffer,
    pub probs: wgpu::Buffer,
    pub ctrl: wgpu::Buffer,
    pub prompt: wgpu::Buffer,
    /// The final norm weight (`[d]`).
    pub final_params: wgpu::Buffer,
}

/// Prompt tokens fed per submit when prefilling through the decode graph.
pub const PROMPT_WINDOW: usize = 256;

/// A model resident on a device, with its token graphs.
pub struct Engine {
    pub kernels: Kernels,
    pub config: ModelConfig,
    pub format: WeightFormat,
    pub layout: ParamLayout,
    pub embedding: DeviceMatrix,
    pub lm_head: Option<DeviceMatrix>,
    pub layers: Vec<Layer>,
    pub scratch: Scratch,
    graphs: HashMap<(bool, Tail), Graph>,
    pub fused: bool,
    /// SSD chunk length of prefill.
    pub chunk: usize,
    pub prefill_mode: PrefillMode,
}

/// Options of an engine.
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    pub format: WeightFormat,
    /// The fused graph (4 dispatches per layer) or the unfused baseline (7).
    pub fused: bool,
    /// SSD chunk length of prefill (8…256); `None` takes the config's `chunk_size`.
    pub chunk_size: Option<usize>,
    /// How prompts are fed.
    pub prefill: PrefillMode,
}

/// How a prompt is fed into the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillMode {
    /// Blocks of tokens through GEMMs and the chunked SSD.
    Chunked,
    /// Token by token through the decode graph (the slow baseline and test oracle).
    Decode,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            format: WeightFormat::F16,
            fused: std::env::var_os("MAMBA2_NO_FUSE").is_none(),
            chunk_size: None,
            prefill: PrefillMode::Chunked,
        }
    }
}

impl EngineOptions {
    /// The chunk length for `config`, checked to lie in 8…256.
    pub fn chunk_for(&self, config: &ModelConfig) -> Result<usize> {
        let q = self.chunk_size.unwrap_or(config.chunk_size);
        if !(8..=256).contains(&q) {
            return Err(Error::InvalidInput(format!(
                "chunk size must be in 8…256, found {q}"
            )));
        }
        Ok(q)
    }
}

impl Engine {
    /// What a model needs of a device in `format`, for `GpuContext::new`.
    pub fn needs(c: &ModelConfig, format: WeightFormat) -> Needs {
        let mats = [
            ("embedding / lm_head", c.vocab_size, c.d_model),
            ("in_proj", c.d_in_proj(), c.d_model),
            ("out_proj", c.d_model, c.d_inner),
        ];
        let mut largest = (
            "SSM state (one layer)".to_string(),
            4 * c.ssm_state_len() as u64,
        );
        for (name, rows, cols) in mats {
            let kp = format.padded_cols(cols);
            let bytes = match format {
                WeightFormat::Q8_0 => (rows * kp) as u64,
                _ => format.bytes(rows, cols) as u64,
            };
            if bytes > largest.1 {
                largest = (
                    format!("{name} [{rows}, {cols}] in {}", format.name()),
                    bytes,
                );
            }
        }
        // The largest workgroup arrays: the gated norm's G sums and the sampler's.
        let reduce = 4 * 256 * c.n_groups.max(3) as u32;
        Needs {
            largest_buffer: largest,
            storage_buffers_per_stage: 8,
            workgroup_storage: reduce + 1024,
            invocations_per_workgroup: 256,
        }
    }

    /// Uploads `model` (converting the big matrices to `opts.format`, with progress) and
    /// builds the graphs.
    pub fn new(ctx: Arc<GpuContext>, model: &Model, opts: EngineOptions) -> Result<Self> {
        let c = &model.config;
        let w = &model.weights;
        let format = opts.format;
        let total: u64 = w.all().iter().map(|t| t.numel() as u64).sum();
        let bar = crate::progress::bar(total, "uploading weights");
        let upload = |name: &str, t: &crate::model::Tensor| -> Result<DeviceMatrix> {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let packed = pack_parallel(format, &t.to_f32(), rows, cols);
            let m = DeviceMatrix::upload(&ctx, name, &packed)?;
            bar.inc(t.numel() as u64);
            Ok(m)
        };
        let embedding = upload("embedding", &w.embedding)?;
        let lm_head = w
            .lm_head
            .as_ref()
            .map(|t| upload("lm_head", t))
            .transpose()?;
        let layout = ParamLayout::new(c);
        let mut params = Vec::with_capacity(c.n_layer);
        let mut mats = Vec::with_capacity(c.n_layer);
        for (i, l) in w.layers.iter().enumerate() {
            let mut v = Vec::with_capacity(layout.len);
            v.extend(l.conv_weight.to_f32());
            match &l.conv_bias {
                Some(b) => v.extend(b.to_f32()),
                None => v.extend(std::iter::repeat_n(0.0, c.conv_dim())),
            }
            v.extend(l.dt_bias.to_f32());
            v.extend(l.a_log.to_f32().into_iter().map(|a| -a.exp()));
            v.extend(l.d_skip.to_f32());
            v.extend(l.norm.to_f32());
            v.extend(l.mixer_norm.to_f32());
            debug_assert_eq!(v.len(), layout.len);
            params.push(LayerParams { values: v });
            let in_proj = upload(&format!("layers.{i}.in_proj"), &l.in_proj)?;
            let out_proj = upload(&format!("layers.{i}.out_proj"), &l.out_proj)?;
            bar.inc((layout.len) as u64);
            mats.push((in_proj, out_proj));
            // Flush staged uploads layer by layer so host memory stays bounded.
            ctx.queue.submit([]);
            ctx.wait()?;
        }
        bar.finish_and_clear();
        let final_norm = w.final_norm.to_f32();
        let mut engine = Self::assemble(
            ctx,
            c,
            format,
            opts.fused,
            embedding,
            lm_head,
            mats,
            params,
            &final_norm,
        )?;
        engine.chunk = opts.chunk_for(c)?;
        engine.prefill_mode = opts.prefill;
        Ok(engine)
    }

    /// Wires uploaded matrices, parameters and fresh state/scratch into an engine.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assemble(
        ctx: Arc<GpuContext>,
        c: &ModelConfig,
        format: WeightFormat,
        fused: bool,
        embedding: DeviceMatrix,
        lm_head: Option<DeviceMatrix>,
        mats: Vec<(DeviceMatrix, DeviceMatrix)>,
        params: Vec<LayerParams>,
        final_norm: &[f32],
    ) -> Result<Self> {
        let layout = ParamLayout::new(c);
        let f32s = |n: usize| 4 * n as u64;
        let mut layers = Vec::with_capacity(c.n_layer);
        for (i, ((in_proj, out_proj), p)) in mats.into_iter().zip(params).enumerate() {
            layers.push(Layer {
                in_proj,
                out_proj,
                params: ctx.storage_with(
                    &format!("layers.{i}.params"),
                    bytemuck::cast_slice(&p.values),
                )?,
                conv_state: ctx
                    .storage_zeroed(&format!("layers.{i}.conv_state"), f32s(c.conv_state_len()))?,
                ssm_state: ctx
                    .storage_zeroed(&format!("layers.{i}.ssm_state"), f32s(c.ssm_state_len()))?,
            });
        }
        let blocks = ssd_consts(c, &layout).blocks();
        let widest = c.d_model.max(c.d_inner).next_multiple_of(32);
        let scratch = Scratch {
            resid: ctx.storage_zeroed("resid", f32s(c.d_model))?,
            mix: ctx.storage_zeroed("mix", f32s(c.d_in_proj()))?,
            y: ctx.storage_zeroed("y", f32s(c.d_inner.next_multiple_of(32)))?,
            part: ctx.storage_zeroed("part", f32s(blocks))?,
            h: ctx.storage_zeroed("h", f32s(c.d_model.next_multiple_of(32)))?,
            v: ctx.storage_zeroed("v", f32s(c.d_inner.next_multiple_of(32)))?,
            xq: ctx.storage_zeroed("xq", f32s(widest / 4))?,
            xd: ctx.storage_zeroed("xd", f32s(widest / 32))?,
            out: ctx.storage_zeroed("out", f32s(c.d_model))?,
            logits: ctx.storage_zeroed("logits", f32s(c.vocab_size))?,
            probs: ctx.storage_zeroed("probs", f32s(c.vocab_size))?,
            ctrl: ctx.storage_zeroed("ctrl", std::mem::size_of::<Ctrl>() as u64)?,
            prompt: ctx.storage_zeroed("prompt", f32s(PROMPT_WINDOW))?,
            final_params: ctx.storage_with("final_norm", bytemuck::cast_slice(final_norm))?,
        };
        let fusable = fusable(c, format);
        let mut engine = Engine {
            kernels: Kernels::new(ctx),
            config: c.clone(),
            format,
            layout,
            embedding,
            lm_head,
            layers,
            scratch,
            graphs: HashMap::new(),
            fused: fused && fusable,
            chunk: c.chunk_size.clamp(8, 256),
            prefill_mode: PrefillMode::Chunked,
        };
        for fused in [true, false] {
            for tail in [Tail::Greedy, Tail::Sample, Tail::Feed, Tail::FeedLogits] {
                // Shapes the fused kernels cannot take run the unfused graph in both modes.
                let g = engine.build_graph(fused && fusable, tail)?;
                engine.graphs.insert((fused, tail), g);
            }
        }
        engine.ctx().check()?;
        Ok(engine)
    }

    pub fn ctx(&self) -> &Arc<GpuContext> {
        &self.kernels.ctx
    }

    /// The token graph in the current fusion mode.
    pub fn graph(&self, tail: Tail) -> &Graph {
        &self.graphs[&(self.fused, tail)]
    }

    /// The end of a token graph that turns `resid` into the next token: final norm,
    /// lm_head and the sampler (`Greedy` or `Sample`), e.g. after a chunked prefill.
    pub fn head_graph(&self, tail: Tail) -> Graph {
        let all = &self.graph(tail).dispatches;
        Graph {
            dispatches: all[all.len() - 3..].to_vec(),
        }
    }

    /// The matrix that produces logits (lm_head, or the tied embedding).
    pub fn head(&self) -> &DeviceMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    pub fn mixer_consts(&self) -> MixerConsts {
        let c = &self.config;
        MixerConsts {
            d_inner: c.d_inner,
            conv_dim: c.conv_dim(),
            heads: c.n_heads,
            kernel: c.d_conv,
            cw_off: self.layout.conv_w,
            cb_off: self.layout.conv_b,
            dtb_off: self.layout.dt_bias,
            dt_limit: c.time_step_limit,
        }
    }

    fn build_graph(&self, fused: bool, tail: Tail) -> Result<Graph> {
        let k = &self.kernels;
        let c = &self.config;
        let s = &self.scratch;
        let eps = c.norm_eps;
        let ssd = ssd_consts(c, &self.layout);
        // The q8 activation blocks, when the matrices are q8_0.
        let q8 = (self.format == WeightFormat::Q8_0).then_some((&s.xq, &s.xd));
        let gemv_in = |src| GemvBuffers {
            src,
            q8,
            dst: &s.mix,
            part: None,
            params: None,
            conv_state: None,
            ctrl: None,
        };
        let mut d = vec![embed::embed(k, &self.embedding, &s.ctrl, &s.resid)?];
        for (i, l) in self.layers.iter().enumerate() {
            let name = |what: &str| format!("layers.{i}.{what}");
            let norm = NormBuffers {
                src: &s.resid,
                params: &l.params,
                dst: &s.h,
                q8,
            };
            d.push(rmsnorm::rmsnorm(
                k,
                &name("norm"),
                c.d_model,
                eps,
                self.layout.norm,
                1,
                norm,
            )?);
            if fused {
                d.push(gemv::gemv(
                    k,
                    &name("in_proj+conv"),
                    &l.in_proj,
                    GemvInput::Plain,
                    GemvOutput::Mixer(self.mixer_consts()),
                    GemvBuffers {
                        params: Some(&l.params),
                        conv_state: Some(&l.conv_state),
                        ctrl: Some(&s.ctrl),
                        ..gemv_in(&s.h)
                    },
                )?);
                d.push(ssd_step::ssd_step(
                    k,
                    &name("ssd_step+gate"),
                    ssd,
                    SsdBuffers {
                        mix: &s.mix,
                        params: &l.params,
                        state: &l.ssm_state,
                        y: &s.y,
                        part: Some(&s.part),
                        q8,
                        ctrl: &s.ctrl,
                    },
                )?);
                d.push(gemv::gemv(
                    k,
                    &name("out_proj+norm+residual"),
                    &l.out_proj,
                    GemvInput::Group {
                        groups: c.n_groups,
                        group_size: c.group_size(),
                        blocks_per_group: ssd.blocks() / c.n_groups,
                        eps,
                    },
                    GemvOutput::Add,
                    GemvBuffers {
                        dst: &s.resid,
                        part: Some(&s.part),
                        ..gemv_in(&s.y)
                    },
                )?);
            } else {
                d.push(gemv::gemv(
                    k,
                    &name("in_proj"),
                    &l.in_proj,
                    GemvInput::Plain,
                    GemvOutput::Store,
                    gemv_in(&s.h),
                )?);
                d.push(conv_step::conv_step(
                    k,
                    &name("conv_step"),
                    self.mixer_consts(),
                    &s.mix,
                    &l.params,
                    &l.conv_state,
                    &s.ctrl,
                )?);
                d.push(ssd_step::ssd_step(
                    k,
                    &name("ssd_step"),
                    ssd,
                    SsdBuffers {
                        mix: &s.mix,
                        params: &l.params,
                        state: &l.ssm_state,
                        y: &s.y,
                        part: None,
                        q8: None,
                        ctrl: &s.ctrl,
                    },
                )?);
                let gated = GatedNormBuffers {
                    y: &s.y,
                    mix: &s.mix,
                    params: &l.params,
                    dst: &s.v,
                    q8,
                };
                d.push(gated_norm::gated_norm(
                    k,
                    &name("gated_norm"),
                    c.d_inner,
                    c.n_groups,
                    eps,
                    self.layout.mixer_norm,
                    Batch {
                        tokens: 1,
                        mix_stride: c.d_in_proj(),
                    },
                    gated,
                )?);
                d.push(gemv::gemv(
                    k,
                    &name("out_proj"),
                    &l.out_proj,
                    GemvInput::Plain,
                    GemvOutput::Store,
                    GemvBuffers {
                        dst: &s.out,
                        ..gemv_in(&s.v)
                    },
                )?);
                d.push(residual_add::residual_add(
                    k,
                    &name("residual"),
                    c.d_model,
                    &s.out,
                    &s.resid,
                )?);
            }
        }
        if tail != Tail::Feed {
            let norm = NormBuffers {
                src: &s.resid,
                params: &s.final_params,
                dst: &s.h,
                q8,
            };
            d.push(rmsnorm::rmsnorm(
                k,
                "final_norm",
                c.d_model,
                eps,
                0,
                1,
                norm,
            )?);
            d.push(gemv::gemv(
                k,
                "lm_head",
                self.head(),
                GemvInput::Plain,
                GemvOutput::Store,
                GemvBuffers {
                    dst: &s.logits,
                    ..gemv_in(&s.h)
                },
            )?);
        }
        match tail {
            Tail::Greedy => d.push(argmax::argmax(k, c.vocab_size, &s.logits, &s.ctrl)?),
            Tail::Sample => d.push(sample::sample(
                k,
                c.vocab_size,
                &s.logits,
                &s.ctrl,
                &s.probs,
            )?),
            Tail::Feed | Tail::FeedLogits => d.push(advance::advance(k, &s.prompt, &s.ctrl)?),
        }
        Ok(Graph { dispatches: d })
    }

    pub fn write_ctrl(&self, ctrl: &Ctrl) {
        self.ctx()
            .queue
            .write_buffer(&self.scratch.ctrl, 0, bytemuck::bytes_of(ctrl));
    }

    pub fn read_ctrl(&self) -> Result<Ctrl> {
        let bytes = self
            .ctx()
            .read(&self.scratch.ctrl, std::mem::size_of::<Ctrl>() as u64)?;
        Ok(bytemuck::pod_read_unaligned(
            &bytes[..std::mem::size_of::<Ctrl>()],
        ))
    }

    pub fn read_logits(&self) -> Result<Vec<f32>> {
        self.ctx()
            .read_f32(&self.scratch.logits, self.config.vocab_size)
    }

    /// Zeroes the recurrent state (a fresh sequence).
    pub fn reset_state(&self) -> Result<()> {
        let mut enc = self
            .ctx()
            .device
            .create_command_encoder(&Default::default());
        for l in &self.layers {
            enc.clear_buffer(&l.conv_state, 0, None);
            enc.clear_buffer(&l.ssm_state, 0, None);
        }
        self.ctx().queue.submit([enc.finish()]);
        self.ctx().check()
    }

    /// The state as the CPU reference lays it out (blocking read; not for the hot path).
    pub fn read_state(&self) -> Result<State<f32>> {
        let c = &self.config;
        let mut st = State {
            conv: Vec::new(),
            ssm: Vec::new(),
        };
        for l in &self.layers {
            st.conv
                .push(self.ctx().read_f32(&l.conv_state, c.conv_state_len())?);
            st.ssm
                .push(self.ctx().read_f32(&l.ssm_state, c.ssm_state_len())?);
        }
        Ok(st)
    }

    /// A copy of the state kept on the device (no host round trip): for branching a
    /// conversation or regenerating a reply without re-reading the prompt.
    pub fn snapshot(&self) -> Result<DeviceSnapshot> {
        let ctx = self.ctx();
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        let mut copy = |src: &wgpu::Buffer, label: &str| -> Result<wgpu::Buffer> {
            let dst = ctx.storage_zeroed(label, src.size())?;
            enc.copy_buffer_to_buffer(src, 0, &dst, 0, None);
            Ok(dst)
        };
        let mut buffers = Vec::with_capacity(2 * self.layers.len());
        for l in &self.layers {
            buffers.push(copy(&l.conv_state, "snapshot conv")?);
            buffers.push(copy(&l.ssm_state, "snapshot ssm")?);
        }
        ctx.queue.submit([enc.finish()]);
        ctx.check()?;
        Ok(DeviceSnapshot { buffers })
    }

    /// Puts a snapshot of this engine's state back.
    pub fn restore(&self, s: &DeviceSnapshot) -> Result<()> {
        if s.buffers.len() != 2 * self.layers.len() {
            return Err(Error::InvalidInput(
                "snapshot belongs to another model".into(),
            ));
        }
        let ctx = self.ctx();
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        for (l, pair) in self.layers.iter().zip(s.buffers.chunks(2)) {
            enc.copy_buffer_to_buffer(&pair[0], 0, &l.conv_state, 0, None);
            enc.copy_buffer_to_buffer(&pair[1], 0, &l.ssm_state, 0, None);
        }
        ctx.queue.submit([enc.finish()]);
        ctx.check()
    }

    /// Replaces the state (e.g. to continue from a CPU-computed one).
    pub fn write_state(&self, st: &State<f32>) -> Result<()> {
        let c = &self.config;
        if st.conv.len() != c.n_layer || st.ssm.len() != c.n_layer {
            return Err(Error::InvalidInput(format!(
                "state has {} layers, the model {}",
                st.conv.len(),
                c.n_layer
            )));
        }
        for (l, (conv, ssm)) in self.layers.iter().zip(st.conv.iter().zip(&st.ssm)) {
            if conv.len() != c.conv_state_len() || ssm.len() != c.ssm_state_len() {
                return Err(Error::InvalidInput(
                    "state shape does not match the model".into(),
                ));
            }
            self.ctx()
                .queue
                .write_buffer(&l.conv_state, 0, bytemuck::cast_slice(conv));
            self.ctx()
                .queue
                .write_buffer(&l.ssm_state, 0, bytemuck::cast_slice(ssm));
        }
        self.ctx().queue.submit([]);
        self.ctx().check()
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> u64 {
        let mut b = self.embedding.bytes() + self.lm_head.as_ref().map_or(0, |m| m.bytes());
        for l in &self.layers {
            b += l.in_proj.bytes() + l.out_proj.bytes() + l.params.size();
        }
        b + self.scratch.final_params.size()
    }

    /// Bytes of recurrent state per sequence.
    pub fn state_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.conv_state.size() + l.ssm_state.size())
            .sum()
    }

    /// Bytes of activation scratch.
    pub fn scratch_bytes(&self) -> u64 {
        let s = &self.scratch;
        [
            &s.resid, &s.mix, &s.y, &s.part, &s.h, &s.v, &s.out, &s.logits, &s.probs, &s.ctrl,
            &s.prompt,
        ]
        .iter()
        .map(|b| b.size())
        .sum()
    }

    /// Bytes a decode step reads or writes: weights once, the state read and written.
    pub fn bytes_per_token(&self) -> u64 {
        let embed_row = (self.embedding.bytes() / self.embedding.rows as u64).max(1);
        let mut b = embed_row + self.head().bytes() + 2 * self.state_bytes();
        for l in &self.layers {
            b += l.in_proj.bytes() + l.out_proj.bytes() + l.params.size();
        }
        b
    }
}

/// The SSD step's sizes for a config.
pub fn ssd_consts(c: &ModelConfig, layout: &ParamLayout) -> SsdConsts {
    SsdConsts {
        heads: c.n_heads,
        head_dim: c.head_dim,
        groups: c.n_groups,
        d_state: c.d_state,
        d_inner: c.d_inner,
        conv_dim: c.conv_dim(),
        a_off: layout.a,
        d_off: layout.d,
        nw_off: layout.mixer_norm,
    }
}

/// Whether the fused graph can run these shapes: its out_proj scales whole input vectors
/// (4 columns, or 32 for q8_0) by one group's 1/rms, so groups must split into them.
pub fn fusable(c: &ModelConfig, format: WeightFormat) -> bool {
    let unit = if format == WeightFormat::Q8_0 { 32 } else { 4 };
    c.group_size().is_multiple_of(unit)
}

/// `pack` split by rows over the machine's cores (quantizing 7B weights is otherwise
/// tens of seconds on one core).
pub fn pack_parallel(format: WeightFormat, values: &[f32], rows: usize, cols: usize) -> Packed {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads == 1 || rows * cols < 1 << 20 {
        return pack(format, values, rows, cols);
    }
    let per = rows.div_ceil(threads);
    let parts: Vec<Packed> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..rows)
            .step_by(per)
            .map(|r0| {
                let r1 = (r0 + per).min(rows);
                s.spawn(move || pack(format, &values[r0 * cols..r1 * cols], r1 - r0, cols))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("pack thread panicked"))
            .collect()
    });
    let mut out = Packed {
        format,
        rows,
        cols,
        kp: format.padded_cols(cols),
        data: Vec::new(),
        scales: Vec::new(),
    };
    for p in parts {
        out.data.extend(p.data);
        out.scales.extend(p.scales);
    }
    out
}
