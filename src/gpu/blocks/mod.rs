//! The graph builder: a token's decode graph (fused or unfused) and a prefill block's
//! graph are built by walking the model's blocks and asking each for its dispatches —
//! pre-norm, then the mixer's recipe (`mamba2`, `attention`, `mlp`), each dispatch labelled
//! with its layer and block kind. Around the blocks: the embedding first; the final norm,
//! lm_head and the sampler (or `advance`, when a token only feeds the state) last.

pub mod attention;
pub mod mamba2;
pub mod mlp;
pub mod moe;
pub mod parts;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::gpu::device_weights::{DeviceMixer, DeviceWeights, ParamLayout};
use crate::gpu::graph::{Graph, Tail};
use crate::gpu::kernels::argmax::ArgmaxInput;
use crate::gpu::kernels::chunk::ChunkConsts;
use crate::gpu::kernels::gemm::{GemmOutput, gemm};
use crate::gpu::kernels::gemv::{self, GemvBuffers, GemvInput, GemvOutput};
use crate::gpu::kernels::mlp_act::MlpBias;
use crate::gpu::kernels::rmsnorm::{self, NormBuffers};
use crate::gpu::kernels::{Dispatch, Kernels, Lanes, advance, argmax, embed, sample};
use crate::gpu::prefill::Prefill;
use crate::gpu::scratch::Scratch;
use crate::gpu::state_store::{DeviceLayerState, DeviceState};
use crate::model::quant::WeightFormat;

/// What every block's recipe reads: kernels, shapes, the weight format, the Mamba2
/// parameter layout, the decode scratch and the state store.
pub struct BlockCtx<'a> {
    pub k: &'a Kernels,
    pub c: &'a ModelConfig,
    pub format: WeightFormat,
    pub layout: &'a ParamLayout,
    pub s: &'a Scratch,
    pub state: &'a DeviceState,
    /// Decode lanes (a batch's; `Lanes::ONE` for an engine's graphs and prefill).
    pub lanes: Lanes,
}

impl BlockCtx<'_> {
    /// The q8 activation blocks, when the matrices are quantized (their GEMVs take integer
    /// dot products).
    pub fn q8(&self) -> Option<(&wgpu::Buffer, &wgpu::Buffer)> {
        self.format.reads_q8().then_some((&self.s.xq, &self.s.xd))
    }

    /// A decode GEMV's buffers: `dst = W·src` (or the q8 blocks of src) over this
    /// context's lanes, no epilogue buffers.
    pub fn gemv_in<'b>(&'b self, src: &'b wgpu::Buffer, dst: &'b wgpu::Buffer) -> GemvBuffers<'b> {
        GemvBuffers {
            lanes: self.lanes,
            ..GemvBuffers::plain(src, self.q8(), dst)
        }
    }
}

/// The decode graph of one token: `fused` picks the Mamba2 recipe (shapes the fused
/// kernels cannot take run the unfused one), `tail` what ends it. Over several lanes (a
/// batch): fused Mamba2, attention, MLP and MoE blocks only, and the sampler tails.
pub fn decode_graph(b: &BlockCtx, w: &DeviceWeights, fused: bool, tail: Tail) -> Result<Graph> {
    let (k, c, s) = (b.k, b.c, b.s);
    let batch = b.lanes.cap > 1;
    if batch && !matches!(tail, Tail::Greedy | Tail::Sample | Tail::Mixed) {
        return Err(crate::Error::Gpu(format!("a batch has no {tail:?} tail")));
    }
    let scale = c.scales.embedding as f32;
    let mut d = vec![embed::embed(
        k,
        &w.embedding,
        scale,
        b.lanes,
        &s.ctrl,
        &s.resid,
    )?];
    // (A batch's MoE blocks make the next pre-norm as the one-token graph does: the
    // lanes' bits are those of each sequence alone.)
    let tails = norm_tails(b, w, fused)?;
    let mut moe_index = 0;
    for (i, (layer, st)) in w.layers.iter().zip(&b.state.layers).enumerate() {
        // Fused, an MoE block's router takes its pre-norm in its prologue, and so do a
        // Mamba2 block's quantized in_proj and an attention block's quantized qkv
        // projection where `gemv::folds_norm` allows; a Mamba2 block after an MoE block
        // may take it from the experts' last down pass instead (`norm_tails`).
        let norm_off = layer.norm_offset(b.layout);
        let tail_norm = tails[i];
        let fold_norm = fused
            && !batch
            && !tail_norm
            && match &layer.mixer {
                DeviceMixer::Moe(_) => true,
                DeviceMixer::Mamba2 { in_proj, .. } => {
                    mamba2::fusable(c, b.format) && gemv::folds_norm(k, in_proj, true)?
                }
                // (A projection in parts of different formats takes a norm dispatch.)
                DeviceMixer::Attention { qkv, .. } => match qkv.as_slice() {
                    [whole] => gemv::folds_norm(k, whole, false)?,
                    _ => false,
                },
                _ => false,
            };
        let mut ds = if fold_norm || tail_norm {
            Vec::new()
        } else {
            vec![pre_norm(
                b,
                &layer.params,
                norm_off,
                None,
                norm_wg(k, &layer.mixer)?,
            )?]
        };
        ds.extend(match (&layer.mixer, st) {
            (DeviceMixer::Mamba2 { in_proj, out_proj }, DeviceLayerState::Mamba2 { conv, ssm }) => {
                let l = mamba2::MambaLayer::new(in_proj, out_proj, &layer.params, conv, ssm);
                let fuse = fused && mamba2::fusable(c, b.format);
                if batch && !fuse {
                    return Err(crate::Error::Gpu(format!(
                        "batched decode needs the fused Mamba2 graph: groups of {} channels \
                         do not split into the {} the {} GEMV scales at once",
                        c.group_size(),
                        gemv::group_unit(b.format),
                        b.format.name()
                    )));
                }
                let pre_norm = if tail_norm {
                    mamba2::PreNorm::Tail
                } else if fold_norm {
                    mamba2::PreNorm::Fold(norm_off)
                } else {
                    mamba2::PreNorm::Made
                };
                mamba2::decode(b, &l, fuse, pre_norm)?
            }
            (DeviceMixer::Attention { qkv, o }, DeviceLayerState::Attention { k: kc, v: vc }) => {
                let pre_norm = fold_norm.then_some((&layer.params, norm_off));
                attention::decode(b, qkv, o, kc, vc, fused, pre_norm)?
            }
            (DeviceMixer::Mlp { up, down, bias }, DeviceLayerState::Stateless) => mlp::decode(
                b,
                mlp::shape(b)?,
                up,
                down,
                mlp_bias(b, &layer.params, *bias, &b.s.resid),
            )?,
            (DeviceMixer::Moe(m), DeviceLayerState::Stateless) => {
                moe_index += 1;
                moe::decode(
                    b,
                    m,
                    &layer.params,
                    moe_index - 1,
                    fused,
                    (fused && !batch).then_some(norm_off),
                    tails.get(i + 1).is_some_and(|&t| t).then(|| {
                        let next = &w.layers[i + 1];
                        moe::NextNorm {
                            params: &next.params,
                            nw_off: next.norm_offset(b.layout),
                        }
                    }),
                )?
            }
            _ => unreachable!("the state store is built from the same blocks"),
        });
        d.extend(ds.into_iter().map(|x| x.at(i, layer.kind)));
    }
    if tail != Tail::Feed {
        d.push(rmsnorm::rmsnorm_lanes(
            k,
            "final_norm",
            c.d_model,
            c.norm_eps,
            0,
            b.lanes,
            rmsnorm::CHUNK,
            NormBuffers {
                src: &s.resid,
                params: &w.final_params,
                dst: &s.h,
                q8: b.q8(),
            },
        )?);
    }
    // One greedy token: the lm_head leaves each workgroup's winner, and the argmax reduces
    // those instead of every logit.
    let parts = !batch && tail == Tail::Greedy;
    let mut argmax_in = ArgmaxInput::Logits(&s.logits);
    if tail != Tail::Feed {
        let head = gemv::gemv(
            k,
            "lm_head",
            w.head(),
            GemvInput::Plain,
            GemvOutput::Store,
            GemvBuffers {
                argmax_part: parts.then_some(&s.argmax_part),
                ..b.gemv_in(&s.h, &s.logits)
            },
        )?;
        if parts {
            let (x, y, z) = head.workgroups;
            argmax_in = ArgmaxInput::Parts(&s.argmax_part, x * y * z);
        }
        d.push(head);
    }
    let v = c.vocab_size;
    let mixed = tail == Tail::Mixed;
    if matches!(tail, Tail::Greedy | Tail::Mixed) {
        d.push(argmax::argmax(k, v, b.lanes, mixed, argmax_in, &s.ctrl)?);
    }
    if matches!(tail, Tail::Sample | Tail::Mixed) {
        d.push(sample::sample(
            k, v, b.lanes, mixed, &s.logits, &s.ctrl, &s.probs,
        )?);
    }
    if matches!(tail, Tail::Feed | Tail::FeedLogits) {
        d.push(advance::advance(k, &s.prompt, &s.ctrl)?);
    }
    Ok(Graph { dispatches: d })
}

/// The graph of a prefill block of up to `cc.max_tokens` tokens; with `logits`, the final
/// norm and lm_head of every position into `p.logits`.
pub fn prefill_graph(
    b: &BlockCtx,
    w: &DeviceWeights,
    p: &Prefill,
    cc: ChunkConsts,
    logits: bool,
) -> Result<Graph> {
    let (k, c, s) = (b.k, b.c, b.s);
    let t = cc.max_tokens;
    let mut moe_index = 0;
    let mut d = vec![
        embed::embed_prompt(
            k,
            &w.embedding,
            c.scales.embedding as f32,
            t,
            &p.prompt,
            &p.resid,
            &s.ctrl,
        )?
        .per_token(1, 1, 1),
    ];
    for (i, (layer, st)) in w.layers.iter().zip(&b.state.layers).enumerate() {
        let mut ds = vec![pre_norm(
            b,
            &layer.params,
            layer.norm_offset(b.layout),
            Some((p, t)),
            rmsnorm::CHUNK,
        )?];
        ds.extend(match (&layer.mixer, st) {
            (DeviceMixer::Mamba2 { in_proj, out_proj }, DeviceLayerState::Mamba2 { conv, ssm }) => {
                let l = mamba2::MambaLayer::new(in_proj, out_proj, &layer.params, conv, ssm);
                mamba2::prefill(b, p, cc, &l)?
            }
            (DeviceMixer::Attention { qkv, o }, DeviceLayerState::Attention { k: kc, v: vc }) => {
                attention::prefill(b, p, t, qkv, o, kc, vc)?
            }
            (DeviceMixer::Mlp { up, down, bias }, DeviceLayerState::Stateless) => mlp::prefill(
                b,
                p,
                t,
                mlp::shape(b)?,
                up,
                down,
                mlp_bias(b, &layer.params, *bias, &p.resid),
            )?,
            (DeviceMixer::Moe(m), DeviceLayerState::Stateless) => {
                moe_index += 1;
                moe::prefill(b, p, t, m, &layer.params, moe_index - 1)?
            }
            _ => unreachable!("the state store is built from the same blocks"),
        });
        d.extend(ds.into_iter().map(|x| x.at(i, layer.kind)));
    }
    if logits {
        let out = p
            .logits
            .as_ref()
            .expect("logits buffer allocated before the logits graph");
        let norm = NormBuffers {
            src: &p.resid,
            params: &w.final_params,
            dst: &p.h,
            q8: None,
        };
        d.push(
            rmsnorm::rmsnorm_block(k, "final_norm", c.d_model, c.norm_eps, 0, t, norm)?
                .per_token(1, 1, 1),
        );
        d.push(gemm(
            k,
            "lm_head",
            w.head(),
            t,
            &p.h,
            out,
            c.vocab_size,
            0,
            GemmOutput::Store,
            &s.ctrl,
        )?);
    }
    Ok(Graph { dispatches: d })
}

/// Which blocks of a one-token fused decode graph (`fused`) take their pre-norm from the
/// MoE block before them (`moe::tail_takes_next_norm`): Mamba2 blocks whose in_proj reads
/// q8 blocks, over whole q8 blocks of d_model (Nemotron 3 Nano: 22 of its 23). The norm's
/// dispatch goes: on an H100 (run 191) about 3.1 µs a block, of which the down pass's
/// counts and tail take back about 2.2 (Nano 2.044 → 2.036 ms/token; the Granite-4.0-H
/// presets, whose in_proj folded the norm before, gain as much).
fn norm_tails(b: &BlockCtx, w: &DeviceWeights, fused: bool) -> Result<Vec<bool>> {
    let mut tails = vec![false; w.layers.len()];
    if !fused || !b.c.d_model.is_multiple_of(32) {
        return Ok(tails);
    }
    for (i, pair) in w.layers.windows(2).enumerate() {
        let (DeviceMixer::Moe(m), DeviceMixer::Mamba2 { in_proj, .. }) =
            (&pair[0].mixer, &pair[1].mixer)
        else {
            continue;
        };
        tails[i + 1] = in_proj.format.reads_q8()
            && mamba2::fusable(b.c, b.format)
            && moe::tail_takes_next_norm(b, m)?;
    }
    Ok(tails)
}

/// An MLP layer's biases as its activation kernel takes them.
fn mlp_bias<'a>(
    b: &BlockCtx,
    params: &'a wgpu::Buffer,
    offsets: Option<(usize, usize)>,
    resid: &'a wgpu::Buffer,
) -> Option<MlpBias<'a>> {
    offsets.map(|(up_off, down_off)| MlpBias {
        params,
        up_off,
        down_off,
        resid,
        d: b.c.d_model,
    })
}

/// The decode pre-norm's workgroup size for a block: `gemv::norm_wg_for` its one-token
/// GEMV that may fold the norm in (Mamba2's in_proj, attention's qkv; a batch's norm kernel
/// must sum in the same order as the runs alone), the norm's default elsewhere (the MoE
/// router folds its pre-norm with that size).
fn norm_wg(k: &Kernels, mixer: &DeviceMixer) -> Result<usize> {
    match mixer {
        DeviceMixer::Mamba2 { in_proj, .. } => gemv::norm_wg_for(k, in_proj, true),
        DeviceMixer::Attention { qkv, .. } => gemv::norm_wg_for(k, &qkv[0], false),
        _ => Ok(rmsnorm::CHUNK),
    }
}

/// The pre-norm of any block: decode writes `h` (and its q8 blocks) with workgroups of `wg`,
/// prefill `p.h` rows.
fn pre_norm(
    b: &BlockCtx,
    params: &wgpu::Buffer,
    offset: usize,
    prefill: Option<(&Prefill, usize)>,
    wg: usize,
) -> Result<Dispatch> {
    let c = b.c;
    Ok(match prefill {
        None => rmsnorm::rmsnorm_lanes(
            b.k,
            "norm",
            c.d_model,
            c.norm_eps,
            offset,
            b.lanes,
            wg,
            NormBuffers {
                src: &b.s.resid,
                params,
                dst: &b.s.h,
                q8: b.q8(),
            },
        )?,
        Some((p, t)) => rmsnorm::rmsnorm_block(
            b.k,
            "norm",
            c.d_model,
            c.norm_eps,
            offset,
            t,
            NormBuffers {
                src: &p.resid,
                params,
                dst: &p.h,
                q8: None,
            },
        )?
        .per_token(1, 1, 1),
    })
}
