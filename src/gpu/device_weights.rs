//! The model's weights resident on the device: big matrices in the engine's format
//! (`DeviceMatrix`), and per layer one small f32 parameter buffer holding the block's
//! pre-norm weight and its mixer's small tensors (`ParamLayout` for Mamba2; just the
//! norm for attention and MLP blocks). Uploaded once, from a checkpoint or made at random
//! on the device (`gpu::synthetic`).

use crate::config::{BlockKind, ModelConfig};
use crate::error::{Error, Result};
use crate::gpu::context::GpuContext;
use crate::gpu::weights::DeviceMatrix;
use crate::model::DType;
use crate::model::quant::{
    Packed, WeightFormat, finite_f32, map_finite, pack_checked, repack_ggml, unfit,
};
use crate::model::{MixerWeights, Model};

/// Offsets (in f32) of the small tensors inside a Mamba2 layer's parameter buffer:
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

/// A block's big matrices.
pub enum DeviceMixer {
    Mamba2 {
        in_proj: DeviceMatrix,
        out_proj: DeviceMatrix,
    },
    /// `qkv` is `[q; k; v]` stacked, `o` the output projection. `qkv` is one matrix (one
    /// GEMV per token) but where a GGUF stores q, k and v in block types that differ (a
    /// Q4_K_M file's Q6_K v): then its parts are the runs of one type, in order, each kept
    /// as stored and multiplied into its own rows of the projection (`type_runs`).
    Attention {
        qkv: Vec<DeviceMatrix>,
        o: DeviceMatrix,
    },
    /// `up` is `[I, d]`, or `[gate; up]` `[2I, d]` for gated MLPs: one matrix, or where a
    /// GGUF stores gate and up in block types that differ, the two as parts, each as stored
    /// (`type_runs`, as attention's q, k and v); `bias`: where the up (or gate+up) and down
    /// biases start in the layer's parameters.
    Mlp {
        up: Vec<DeviceMatrix>,
        down: DeviceMatrix,
        bias: Option<(usize, usize)>,
    },
    Moe(Box<DeviceMoe>),
}

/// An MoE block on the device: the router (always f32: the choice of experts should not
/// move with the weight format), the experts in banks (each bank one binding within the
/// adapter's limit; `up[b]` holds the experts from `firsts[b]` on as one matrix
/// `[n·up_rows, d]` (`[gate; up]` per expert when gated), or where a GGUF stores the
/// experts' gate and up in block types that differ, as two, gate `[n·I, d]` and up
/// `[n·I, d]`, each as stored (`expert_up_split`); `down[b]` as `[n·d, I]`), the shared
/// expert as an MLP (its up in parts, as `DeviceMixer::Mlp`'s), and where the correction
/// bias starts in the layer's parameters (`[norm | bias]`).
pub struct DeviceMoe {
    pub router: DeviceMatrix,
    pub up: Vec<Vec<DeviceMatrix>>,
    pub down: Vec<DeviceMatrix>,
    /// The first expert of each bank.
    pub firsts: Vec<usize>,
    pub shared: Option<(Vec<DeviceMatrix>, DeviceMatrix)>,
    pub bias_off: Option<usize>,
    /// Rows of one expert's down projection: `d`, or the latent width.
    pub d_model: usize,
    /// Latent MoE: `fc1_latent_proj [L, d]` and `fc2_latent_proj [d, L]`, in f16 under
    /// q8_0 (their GEMVs read f32 vectors) and in the model's format otherwise.
    pub latent: Option<(DeviceMatrix, DeviceMatrix)>,
}

impl DeviceMoe {
    /// The banks as `(first expert, expert count, up bank's parts, down bank)`.
    pub fn banks(&self) -> impl Iterator<Item = (usize, usize, &[DeviceMatrix], &DeviceMatrix)> {
        self.up
            .iter()
            .zip(&self.down)
            .zip(&self.firsts)
            .map(|((u, d), &first)| (first, d.rows / self.d_model, u.as_slice(), d))
    }
}

/// The format of a matrix whose blocks cannot go up as stored (`upload_as`). Quantized
/// blocks joined with parts of another type (an expert bank whose experts differ in type
/// from one to the next; attention's q, k and v, an MLP's gate and up and a bank's gates
/// and ups go up in parts instead, `type_runs`, `expert_up_split`) are requantized to q8_0,
/// whose 8-bit grid keeps them closest: a second 4/5/6-bit rounding would add about as much
/// error as the file's own. Everything else takes `format`'s choice for its width.
fn requantized_format(dtypes: &[DType], format: WeightFormat, cols: usize) -> WeightFormat {
    if format.reads_q8() && mixed_blocks(dtypes) {
        WeightFormat::Q8_0
    } else {
        format.for_cols(cols)
    }
}

/// The GPU format of a GGUF's embedding or head `t` under the run's `format`: as stored
/// (f16, bf16 or f32) where a quantized format meets a file that keeps these two in a float
/// type beside block-quantized matrices, as llama.cpp writes with `--leave-output-tensor` or
/// `--token-embedding-type` / `--output-tensor-type f16` for the logits' precision; else
/// `format`, which also quantizes an all-float file's on request. Their kernels take f32
/// inputs whatever the run's format (the embedding is a row lookup; the final norm writes
/// its f32 output beside the q8 blocks). (`DeviceWeights::upload` still takes `format` for
/// one too large for a binding of the adapter.)
pub fn edge_format(model: &Model, t: &crate::model::Tensor, format: WeightFormat) -> WeightFormat {
    let quantized_file = model
        .gguf
        .as_ref()
        .is_some_and(|g| g.types.iter().any(|(d, _)| matches!(d, DType::Quant(_))));
    match t.dtype {
        _ if !(quantized_file && format.reads_q8()) => format,
        DType::F16 => WeightFormat::F16,
        DType::BF16 => WeightFormat::BF16,
        DType::F32 => WeightFormat::F32,
        DType::Quant(_) => format,
    }
}

/// Whether the parts of one matrix hold block-quantized values in more than one type (or
/// beside floats), so that under a quantized format they cannot go up as one matrix as
/// stored.
pub fn mixed_blocks(dtypes: &[DType]) -> bool {
    dtypes.iter().any(|d| matches!(d, DType::Quant(_))) && dtypes.iter().any(|d| *d != dtypes[0])
}

/// The parts of a stacked matrix (`dtypes`, in order) that go up as one GPU matrix each
/// under `format`: all of them together, or, where a quantized format meets block types
/// that differ (`mixed_blocks`), each run of consecutive parts of one type, so that every
/// block goes up as stored. Ranges of part indices (`mamba2 info` lists the projections
/// this splits).
pub fn type_runs(dtypes: &[DType], format: WeightFormat) -> Vec<std::ops::Range<usize>> {
    let split = format.reads_q8() && mixed_blocks(dtypes);
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, d) in dtypes.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if !split || dtypes[r.start] == *d => r.end = i + 1,
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

/// Whether an expert bank's up projection (`bank`: its experts, or the shared expert's
/// slices) goes up under `format` as two GPU matrices, every gate then every up, rather than
/// one of `[gate; up]` per expert: where a quantized format meets gated experts whose gates
/// share one block type and ups another (a GGUF's `ffn_gate_exps` and `ffn_up_exps` in
/// different types), so that both go up as stored. Experts whose types differ among
/// themselves (no GGUF stacks those) still go up as one matrix, requantized to q8_0
/// (`requantized_format`).
pub fn expert_up_split(bank: &[&crate::model::MlpWeights], format: WeightFormat) -> bool {
    let gates: Option<Vec<DType>> = bank
        .iter()
        .map(|e| e.gate.as_ref().map(|g| g.dtype))
        .collect();
    let ups: Vec<DType> = bank.iter().map(|e| e.up.dtype).collect();
    let one_type = |d: &[DType]| d.iter().all(|t| *t == d[0]);
    match gates {
        Some(gates) if !bank.is_empty() && one_type(&gates) && one_type(&ups) => {
            type_runs(&[gates[0], ups[0]], format).len() == 2
        }
        _ => false,
    }
}

/// An MLP's up projection as the matrices it stacks, in row order: `[gate, up]`, or up
/// alone.
pub fn ups(m: &crate::model::MlpWeights) -> Vec<&crate::model::Tensor> {
    match &m.gate {
        Some(g) => vec![g, &m.up],
        None => vec![&m.up],
    }
}

/// The names of an MLP's up parts (`ups`, for `upload_parts`): gate and up, or up alone.
fn up_labels(m: &crate::model::MlpWeights) -> &'static [&'static str] {
    match m.gate {
        Some(_) => &["gate", "up"],
        None => &["up"],
    }
}

/// Experts per bank: as many as fit one storage binding of `max_binding` bytes (both
/// projections), all of them when they fit. Under a quantized format a bank may hold any
/// block format a GGUF stores (or q8_0, where it is requantized): sized for q8_0, whose
/// quants take the most bytes.
pub fn experts_per_bank(c: &ModelConfig, format: WeightFormat, max_binding: u64) -> usize {
    let Some(m) = &c.moe else { return 1 };
    let format = if format.reads_q8() {
        WeightFormat::Q8_0
    } else {
        expert_format(format)
    };
    let bytes = |rows: usize, cols: usize| -> u64 { format.data_bytes(rows, cols) as u64 };
    let x = m.expert_width(c.d_model);
    let per_expert = bytes(m.up_rows(), x).max(bytes(x, m.intermediate));
    ((max_binding / per_expert.max(1)) as usize).clamp(1, m.stored_experts())
}

/// The format of MoE expert banks: the model's, but f16 for bf16. (A latent MoE's experts
/// too: in a quantized run they read the q8 blocks of the latent vector, `q8_rows`.)
pub fn expert_format(format: WeightFormat) -> WeightFormat {
    match format {
        WeightFormat::BF16 => WeightFormat::F16,
        f => f,
    }
}

/// The format of the latent MoE projections: f16 under the quantized formats (their GEMVs
/// read f32 vectors), the model's otherwise.
pub fn latent_format(format: WeightFormat) -> WeightFormat {
    if format.reads_q8() {
        WeightFormat::F16
    } else {
        format
    }
}

/// One block on the device.
pub struct DeviceLayer {
    pub kind: BlockKind,
    /// f32 small tensors: `ParamLayout` for Mamba2, `[norm]` otherwise.
    pub params: wgpu::Buffer,
    pub mixer: DeviceMixer,
}

impl DeviceMixer {
    /// The projections whose products end the block (added into the residual, or summed
    /// into it with the routing weights): attention's o_proj, an MLP's down projection, an
    /// MoE's expert and shared-expert down projections, or, with latent projections, fc2.
    /// Granite's residual multiplier is their `out_scale`. (Mamba2's out_proj takes it in
    /// its input instead: the gated norm's weight, in the layer's parameters.)
    fn block_ends_mut(&mut self) -> Vec<&mut DeviceMatrix> {
        match self {
            DeviceMixer::Mamba2 { .. } => Vec::new(),
            DeviceMixer::Attention { o, .. } => vec![o],
            DeviceMixer::Mlp { down, .. } => vec![down],
            DeviceMixer::Moe(m) => match &mut m.latent {
                Some((_, fc2)) => vec![fc2],
                None => m
                    .down
                    .iter_mut()
                    .chain(m.shared.as_mut().map(|(_, d)| d))
                    .collect(),
            },
        }
    }

    /// `block_ends_mut` with their products multiplied by `s` (Granite's residual
    /// multiplier).
    pub fn with_block_ends_scaled(mut self, s: f32) -> Self {
        for m in self.block_ends_mut() {
            m.out_scale = s;
        }
        self
    }
}

impl DeviceLayer {
    /// Where the pre-norm weight starts in `params`.
    pub fn norm_offset(&self, layout: &ParamLayout) -> usize {
        match self.kind {
            BlockKind::Mamba2 => layout.norm,
            _ => 0,
        }
    }

    pub fn matrices(&self) -> Vec<&DeviceMatrix> {
        match &self.mixer {
            DeviceMixer::Mamba2 { in_proj, out_proj } => vec![in_proj, out_proj],
            DeviceMixer::Attention { qkv, o } => qkv.iter().chain([o]).collect(),
            DeviceMixer::Mlp { up, down, .. } => up.iter().chain([down]).collect(),
            DeviceMixer::Moe(m) => {
                let mut v = vec![&m.router];
                v.extend(m.up.iter().flatten().chain(&m.down));
                if let Some((u, d)) = &m.shared {
                    v.extend(u.iter().chain([d]));
                }
                if let Some((a, b)) = &m.latent {
                    v.extend([a, b]);
                }
                v
            }
        }
    }
}

/// Every weight of the model on the device.
pub struct DeviceWeights {
    pub embedding: DeviceMatrix,
    pub lm_head: Option<DeviceMatrix>,
    pub layers: Vec<DeviceLayer>,
    /// The final norm weight `[d]`.
    pub final_params: wgpu::Buffer,
}

impl DeviceWeights {
    /// The projections of every Mamba2, attention and MLP layer and the MoE routers and
    /// shared experts (what a prefill block multiplies with `gemm::projection`, so what its
    /// split-K partials are sized for).
    pub fn dense_projections(&self) -> impl Iterator<Item = &DeviceMatrix> {
        self.layers.iter().flat_map(|l| match &l.mixer {
            DeviceMixer::Moe(m) => {
                let mut v = vec![&m.router];
                if let Some((u, d)) = &m.shared {
                    v.extend(u.iter().chain([d]));
                }
                v
            }
            _ => l.matrices(),
        })
    }

    /// The matrix that produces logits (lm_head, or the tied embedding).
    pub fn head(&self) -> &DeviceMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    /// How many matrices each format holds, most first (a GGUF's blocks go up as stored,
    /// the k-quants fall back to q8_0 on other widths, MoE experts and routers keep their
    /// own formats).
    pub fn format_counts(&self) -> Vec<(WeightFormat, usize)> {
        let mut all: Vec<&DeviceMatrix> = vec![&self.embedding];
        all.extend(&self.lm_head);
        for l in &self.layers {
            all.extend(l.matrices());
        }
        let mut counts: Vec<(WeightFormat, usize)> = Vec::new();
        for m in all {
            match counts.iter_mut().find(|(f, _)| *f == m.format) {
                Some((_, n)) => *n += 1,
                None => counts.push((m.format, 1)),
            }
        }
        counts.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        counts
    }

    /// Device bytes of all weights.
    pub fn bytes(&self) -> u64 {
        let mut b = self.embedding.bytes() + self.lm_head.as_ref().map_or(0, |m| m.bytes());
        for l in &self.layers {
            b += l.matrices().iter().map(|m| m.bytes()).sum::<u64>() + l.params.size();
        }
        b + self.final_params.size()
    }

    /// Uploads `model`'s weights, converting the big matrices to `format` (with progress,
    /// layer by layer so host memory stays bounded).
    /// `bank_bytes`: the most bytes one bank of experts may hold (at most the adapter's
    /// storage-binding limit).
    pub fn upload(
        ctx: &GpuContext,
        model: &Model,
        format: WeightFormat,
        bank_bytes: u64,
    ) -> Result<Self> {
        let c = &model.config;
        let w = &model.weights;
        let total: u64 = w.all().iter().map(|t| t.numel() as u64).sum();
        let bar = crate::progress::bar(total, "uploading weights");
        // Every value is checked for NaN/±Inf as it is converted, and for what `format`
        // cannot hold as it is packed; an error names the checkpoint's tensor.
        // (Granite's residual multiplier is the block-ending projections' `out_scale`,
        // `block_ends_mut`, not folded into their values.)
        // A GGUF's quantized blocks in a type the GPU holds go up as stored, never
        // requantized, when a quantized format was asked for (after the same check for
        // NaN/±Inf every weight gets); f32/f16 asks for everything dequantized.
        let upload_as = |name: &str,
                         parts: &[&crate::model::Tensor],
                         format: WeightFormat|
         -> Result<DeviceMatrix> {
            let cols = parts[0].shape[1];
            let rows: usize = parts.iter().map(|t| t.shape[0]).sum();
            let stored = match parts[0].dtype {
                DType::Quant(t) => WeightFormat::from_ggml(t),
                _ => None,
            };
            if let Some(stored) = stored
                && format.reads_q8()
                && parts
                    .iter()
                    .all(|t| t.dtype == parts[0].dtype && t.shape[1] == cols)
            {
                for t in parts {
                    finite_f32(t)?;
                    bar.inc(t.numel() as u64);
                }
                return DeviceMatrix::upload(ctx, name, &repack_ggml(stored, parts));
            }
            let mut values = Vec::with_capacity(rows * cols);
            let mut starts = Vec::with_capacity(parts.len());
            for t in parts {
                starts.push(values.len() / cols);
                values.extend(finite_f32(t)?);
                bar.inc(t.numel() as u64);
            }
            let dtypes: Vec<DType> = parts.iter().map(|t| t.dtype).collect();
            let format = requantized_format(&dtypes, format, cols);
            let packed = pack_parallel(format, &values, rows, cols).map_err(|i| {
                // Name the part (of a stacked matrix) holding the value.
                let (r, c) = (i / cols, i % cols);
                let p = starts.iter().rposition(|&s| s <= r).unwrap_or(0);
                unfit(&parts[p].name, format, values[i], r - starts[p], c, cols)
            })?;
            DeviceMatrix::upload(ctx, name, &packed)
        };
        let upload = |name: &str, parts: &[&crate::model::Tensor]| upload_as(name, parts, format);
        // A stacked projection (`labels` name its parts): one matrix, or where a quantized
        // format meets block types that differ, one per run of one type (`type_runs`), named
        // `name.label`.
        let upload_parts = |name: &str,
                            parts: &[&crate::model::Tensor],
                            labels: &[&str]|
         -> Result<Vec<DeviceMatrix>> {
            let dtypes: Vec<DType> = parts.iter().map(|t| t.dtype).collect();
            let runs = type_runs(&dtypes, format);
            runs.iter()
                .map(|r| {
                    let n = match runs.len() {
                        1 => name.to_string(),
                        _ => format!("{name}.{}", labels[r.clone()].concat()),
                    };
                    upload(&n, &parts[r.clone()])
                })
                .collect()
        };
        let per_bank = experts_per_bank(c, format, bank_bytes);
        // A float embedding or head too large for one binding of this adapter (`Engine::needs`
        // sized the run for `format`) goes up in `format` after all.
        let binding = ctx.limits.max_storage_buffer_binding_size;
        let edge = |t: &crate::model::Tensor| {
            let f = edge_format(model, t, format);
            let (rows, cols) = (t.shape[0], t.shape.get(1).copied().unwrap_or(1));
            match f.data_bytes(rows, cols) as u64 > binding {
                true => format,
                false => f,
            }
        };
        let embedding = upload_as("embedding", &[&w.embedding], edge(&w.embedding))?;
        let lm_head = w
            .lm_head
            .as_ref()
            .map(|t| upload_as("lm_head", &[t], edge(t)))
            .transpose()?;
        let layout = ParamLayout::new(c);
        let mut layers = Vec::with_capacity(c.n_layer);
        for (i, l) in w.layers.iter().enumerate() {
            let name = |what: &str| format!("layers.{i}.{what}");
            let mut params = Vec::new();
            let mixer = match &l.mixer {
                MixerWeights::Mamba2(m) => {
                    params.extend(finite_f32(&m.conv_weight)?);
                    match &m.conv_bias {
                        Some(b) => params.extend(finite_f32(b)?),
                        None => params.extend(std::iter::repeat_n(0.0, c.conv_dim())),
                    }
                    params.extend(finite_f32(&m.dt_bias)?);
                    params.extend(m.a()?);
                    params.extend(finite_f32(&m.d_skip)?);
                    params.extend(finite_f32(&l.norm)?);
                    // Granite's residual multiplier goes into the gated norm's weight, which
                    // makes out_proj's input: the same product, and out_proj's GEMMs keep the
                    // cooperative direct epilogue that an output scale rules out (Granite-Tiny's
                    // 4096-token prefill: out_proj 16.6 → 13.1 ms, run 211).
                    let resid = c.scales.residual as f32;
                    params.extend(map_finite(&m.mixer_norm, |v| v * resid)?);
                    debug_assert_eq!(params.len(), layout.len);
                    DeviceMixer::Mamba2 {
                        in_proj: upload(&name("in_proj"), &[&m.in_proj])?,
                        out_proj: upload(&name("out_proj"), &[&m.out_proj])?,
                    }
                }
                MixerWeights::Attention(a) => {
                    if a.bias.is_some() {
                        return Err(gpu_unsupported(i, "attention projection biases"));
                    }
                    params.extend(finite_f32(&l.norm)?);
                    let qkv =
                        upload_parts(&name("qkv_proj"), &[&a.q, &a.k, &a.v], &["q", "k", "v"])?;
                    DeviceMixer::Attention {
                        qkv,
                        o: upload(&name("o_proj"), &[&a.o])?,
                    }
                }
                MixerWeights::Moe(m) => {
                    params.extend(finite_f32(&l.norm)?);
                    let bias_off = match &m.correction_bias {
                        Some(b) => {
                            let off = params.len();
                            params.extend(finite_f32(b)?);
                            Some(off)
                        }
                        None => None,
                    };
                    // The shared expert as slices of the experts' width, stored after them.
                    let mc = c.moe.as_ref().ok_or_else(|| {
                        Error::InvalidInput(format!("layer {i}: MoE without a shape"))
                    })?;
                    let slices = match &m.shared {
                        Some(s) if mc.shared_slots() > 0 => {
                            shared_slices(s, mc.shared_slots(), mc.intermediate)?
                        }
                        _ => Vec::new(),
                    };
                    // Banks of `per_bank` experts; the shared slices in banks of their own
                    // where their stored types differ from the experts' (a GGUF mix), so
                    // that both go up as stored.
                    let types = |e: &crate::model::MlpWeights| {
                        let mut t: Vec<_> = ups(e).iter().map(|t| t.dtype).collect();
                        t.push(e.down.dtype);
                        t
                    };
                    let apart = match (m.experts.first(), slices.first()) {
                        (Some(e), Some(s)) => format.reads_q8() && types(e) != types(s),
                        _ => false,
                    };
                    let stored: Vec<&crate::model::MlpWeights> =
                        m.experts.iter().chain(&slices).collect();
                    let n = m.experts.len();
                    // (Ranges of `stored`: the experts and slices together, or apart.)
                    let groups: [std::ops::Range<usize>; 2] = if apart {
                        [0..n, n..stored.len()]
                    } else {
                        [0..stored.len(), stored.len()..stored.len()]
                    };
                    let ranges = groups.into_iter().flat_map(|g| {
                        (g.start..g.end)
                            .step_by(per_bank)
                            .map(move |a| a..(a + per_bank).min(g.end))
                    });
                    let ef = expert_format(format);
                    let (mut up, mut down, mut firsts) = (Vec::new(), Vec::new(), Vec::new());
                    for (b, r) in ranges.enumerate() {
                        firsts.push(r.start);
                        let bank = &stored[r];
                        let up_name = name(&format!("experts.up.bank{b}"));
                        up.push(if expert_up_split(bank, ef) {
                            // (Every expert is gated: `expert_up_split`.)
                            let gates: Vec<&crate::model::Tensor> =
                                bank.iter().filter_map(|e| e.gate.as_ref()).collect();
                            let ups: Vec<&crate::model::Tensor> =
                                bank.iter().map(|e| &e.up).collect();
                            vec![
                                upload_as(&format!("{up_name}.gate"), &gates, ef)?,
                                upload_as(&format!("{up_name}.up"), &ups, ef)?,
                            ]
                        } else {
                            let parts: Vec<&crate::model::Tensor> =
                                bank.iter().flat_map(|e| ups(e)).collect();
                            vec![upload_as(&up_name, &parts, ef)?]
                        });
                        let parts: Vec<&crate::model::Tensor> =
                            bank.iter().map(|e| &e.down).collect();
                        let bank_name = name(&format!("experts.down.bank{b}"));
                        down.push(upload_as(&bank_name, &parts, ef)?);
                    }
                    let shared = match &m.shared {
                        Some(s) if slices.is_empty() => Some((
                            upload_parts(&name("shared.up"), &ups(s), up_labels(s))?,
                            upload(&name("shared.down"), &[&s.down])?,
                        )),
                        _ => None,
                    };
                    let latent_format = latent_format(format);
                    let latent = match &m.latent {
                        Some([fc1, fc2]) => Some((
                            upload_as(&name("fc1_latent_proj"), &[fc1], latent_format)?,
                            upload_as(&name("fc2_latent_proj"), &[fc2], latent_format)?,
                        )),
                        None => None,
                    };
                    DeviceMixer::Moe(Box::new(DeviceMoe {
                        router: upload_as(&name("router"), &[&m.router], WeightFormat::F32)?,
                        up,
                        down,
                        firsts,
                        shared,
                        bias_off,
                        d_model: mc.expert_width(c.d_model),
                        latent,
                    }))
                }
                MixerWeights::Mlp(m) => {
                    params.extend(finite_f32(&l.norm)?);
                    // Biases in the order of the up rows ([gate | up]), then down's.
                    let bias = match (&m.up_bias, &m.down_bias) {
                        (Some(ub), Some(db)) => {
                            let up_off = params.len();
                            if let Some(gb) = &m.gate_bias {
                                params.extend(finite_f32(gb)?);
                            }
                            params.extend(finite_f32(ub)?);
                            let down_off = params.len();
                            params.extend(finite_f32(db)?);
                            Some((up_off, down_off))
                        }
                        _ => None,
                    };
                    let up_name = if m.gate.is_some() {
                        "gate_up_proj"
                    } else {
                        "up_proj"
                    };
                    let up = upload_parts(&name(up_name), &ups(m), up_labels(m))?;
                    DeviceMixer::Mlp {
                        up,
                        down: upload(&name("down_proj"), &[&m.down])?,
                        bias,
                    }
                }
            }
            .with_block_ends_scaled(c.scales.residual as f32);
            bar.inc((params.len()) as u64);
            layers.push(DeviceLayer {
                kind: l.mixer.kind(),
                params: ctx.storage_with(&name("params"), bytemuck::cast_slice(&params))?,
                mixer,
            });
            // Flush staged uploads layer by layer so host memory stays bounded.
            ctx.queue.submit([]);
            ctx.wait()?;
        }
        bar.finish_and_clear();
        // Granite's logits scaling, folded into the final norm's weight.
        let logit_scale = c.scales.logits as f32;
        let final_params = ctx.storage_with(
            "final_norm",
            bytemuck::cast_slice(&map_finite(&w.final_norm, |v| v * logit_scale)?),
        )?;
        Ok(DeviceWeights {
            embedding,
            lm_head,
            layers,
            final_params,
        })
    }
}

/// The shared expert cut into `n` MLPs of width `width` (`MoeConfig::shared_slots`): up (and
/// gate) rows are views, down columns are copied — in the stored type where the slices
/// split at its block boundaries (a GGUF's blocks then go up as stored), else through f32.
fn shared_slices(
    s: &crate::model::MlpWeights,
    n: usize,
    width: usize,
) -> Result<Vec<crate::model::MlpWeights>> {
    let d = s.down.shape[0];
    let full = s.down.shape[1];
    let as_f32 = if width.is_multiple_of(s.down.dtype.block()) {
        None
    } else {
        Some(finite_f32(&s.down)?)
    };
    (0..n)
        .map(|j| {
            let (a, b) = (j * width, (j + 1) * width);
            let tag = format!(" (slice {j})");
            let down = match &as_f32 {
                None => s.down.cols(a..b, &tag).ok_or_else(|| {
                    Error::InvalidInput(format!(
                        "{}: columns {a}..{b} cut its {} blocks",
                        s.down.name,
                        s.down.dtype.name()
                    ))
                })?,
                Some(down) => {
                    let cols: Vec<f32> = (0..d)
                        .flat_map(|r| down[r * full + a..r * full + b].iter().copied())
                        .collect();
                    crate::model::Tensor::from_f32(
                        format!("{}{tag}", s.down.name),
                        vec![d, width],
                        &cols,
                    )
                }
            };
            Ok(crate::model::MlpWeights {
                up: s.up.rows(a..b, vec![width, s.up.shape[1]], &tag),
                gate: s
                    .gate
                    .as_ref()
                    .map(|g| g.rows(a..b, vec![width, g.shape[1]], &tag)),
                down,
                up_bias: None,
                gate_bias: None,
                down_bias: None,
            })
        })
        .collect()
}

fn gpu_unsupported(layer: usize, what: &str) -> Error {
    Error::Unsupported(format!(
        "layer {layer}: {what} are not implemented on the GPU yet (the CPU reference runs \
         them: --device cpu)"
    ))
}

/// `pack` split by rows over the machine's cores (quantizing 7B weights is otherwise
/// tens of seconds on one core). `Err(i)`: a value the format cannot store (see
/// `model::quant::pack_checked`; `unfit` words it).
pub fn pack_parallel(
    format: WeightFormat,
    values: &[f32],
    rows: usize,
    cols: usize,
) -> std::result::Result<Packed, usize> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads == 1 || rows * cols < 1 << 20 {
        return pack_checked(format, values, rows, cols);
    }
    let per = rows.div_ceil(threads);
    let parts: Vec<std::result::Result<Packed, usize>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..rows)
            .step_by(per)
            .map(|r0| {
                let r1 = (r0 + per).min(rows);
                s.spawn(move || {
                    pack_checked(format, &values[r0 * cols..r1 * cols], r1 - r0, cols)
                        .map_err(|i| r0 * cols + i)
                })
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
        let p = p?;
        out.data.extend(p.data);
        out.scales.extend(p.scales);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ggml::GgmlType;

    #[test]
    fn parts_of_different_block_types_go_up_in_runs_of_one_type() {
        let (q4k, q6k, q8) = (
            DType::Quant(GgmlType::Q4_K),
            DType::Quant(GgmlType::Q6_K),
            DType::Quant(GgmlType::Q8_0),
        );
        let q4 = WeightFormat::Q4_K;
        // A Q4_K_M file's q and k in Q4_K beside v in Q6_K: two parts, each as stored.
        assert_eq!(type_runs(&[q4k, q4k, q6k], q4), vec![0..2, 2..3]);
        assert_eq!(type_runs(&[q6k, q4k, q8], q4), vec![0..1, 1..2, 2..3]);
        assert_eq!(type_runs(&[q4k, q6k, q4k], q4), vec![0..1, 1..2, 2..3]);
        // Floats beside blocks: the floats are quantized at load, the blocks kept.
        assert_eq!(type_runs(&[DType::F16, q4k, q4k], q4), vec![0..1, 1..3]);
        // One type, floats only, or a float run (which dequantizes everything): one matrix.
        assert_eq!(type_runs(&[q4k, q4k, q4k], q4), vec![0..3]);
        assert_eq!(
            type_runs(&[DType::F16, DType::F32, DType::F16], q4),
            vec![0..3]
        );
        assert_eq!(type_runs(&[q4k, q4k, q6k], WeightFormat::F16), vec![0..3]);
    }

    #[test]
    fn mixed_stored_blocks_requantize_to_q8_0() {
        let (q4k, q6k) = (DType::Quant(GgmlType::Q4_K), DType::Quant(GgmlType::Q6_K));
        let q4 = WeightFormat::Q4_K;
        // A matrix joined from parts in Q4_K and Q6_K (an MLP's gate and up; attention's
        // q, k and v go up in parts instead, `type_runs`): q8_0, not a second 4-bit
        // rounding.
        assert_eq!(
            requantized_format(&[q4k, q4k, q6k], q4, 4096),
            WeightFormat::Q8_0
        );
        assert_eq!(
            requantized_format(&[DType::F16, q4k], q4, 4096),
            WeightFormat::Q8_0
        );
        // Floats of two kinds are not blocks to keep: they take the asked format.
        assert!(!mixed_blocks(&[DType::F16, DType::F32]));
        assert!(!mixed_blocks(&[q4k, q4k, q4k]));
        assert!(mixed_blocks(&[q4k, q4k, q6k]) && mixed_blocks(&[DType::F32, q6k]));
        assert_eq!(
            requantized_format(&[DType::F16, DType::F32], q4, 4096),
            q4.for_cols(4096)
        );
        // Stored blocks of one type keep their format (Granite's residual multiplier is an
        // output scale, not folded into them).
        assert_eq!(requantized_format(&[q4k], q4, 4096), q4);
        // Floats (safetensors, or a GGUF's f32 tensors) take the asked format for their
        // width, and f32/f16 runs dequantize whatever is stored.
        for (dtypes, format) in [
            (&[DType::F16, DType::F16][..], q4),
            (&[DType::F32][..], q4),
            (&[q4k, q6k][..], WeightFormat::F16),
            (&[q4k][..], WeightFormat::F32),
        ] {
            for cols in [4096, 2688] {
                assert_eq!(
                    requantized_format(dtypes, format, cols),
                    format.for_cols(cols),
                    "{dtypes:?} {format:?} {cols}"
                );
            }
        }
    }
}
