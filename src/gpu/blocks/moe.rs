//! The MoE block's dispatches, all static (the host never sees the routing):
//! router GEMV (f32) → `moe_route` (ids, weights, expert load; fused, over any format but
//! f16, in the first up pass's prologue instead) → per bank the chosen experts'
//! up projections → the activation over the `K` choices (with their q8 blocks; fused, in
//! the up pass's epilogue instead, gated experts where every bank's `[gate; up]` is one
//! matrix) → per bank the weighted down
//! projections added into the residual → the shared expert as an MLP (as expert slices
//! where it has the routed experts' shape).
//! Prefill: the router as a GEMM, the same routing kernel over the block's tokens, then the
//! (token, choice) pairs sorted by expert (`moe_sort`), grouped GEMMs per bank over whole
//! tiles of one expert's rows, the activation, and `moe_combine` back into the residual.

use super::{BlockCtx, mlp};
use crate::config::{MlpAct, MlpConfig, MoeConfig};
use crate::error::{Error, Result};
use crate::gpu::device_weights::DeviceMoe;
use crate::gpu::kernels::expert_gemv::{
    ActFold, Bank, ExpertBuffers, ExpertPass, NormTail, RouteFold, RowsAt, expert_gemv,
    takes_norm_tail,
};
use crate::gpu::kernels::gemm::{GemmOutput, SortedRows, TILE, expert_gemm, gemm, projection};
use crate::gpu::kernels::gemv::{self, GemvBuffers, GemvInput, GemvOutput, NormOut};
use crate::gpu::kernels::mlp_act::{ActBuffers, mlp_act};
use crate::gpu::kernels::moe_combine::{CombineBuffers, moe_combine};
use crate::gpu::kernels::moe_route::{RouteBuffers, moe_route};
use crate::gpu::kernels::moe_sort::{SortBuffers, moe_sort, sorted_rows};
use crate::gpu::kernels::q8_rows::q8_rows;
use crate::gpu::kernels::rmsnorm;
use crate::gpu::kernels::{Dispatch, Section};
use crate::gpu::prefill::Prefill;
use crate::gpu::weights::DeviceMatrix;
use crate::model::quant::WeightFormat;

fn moe_section(d: Dispatch) -> Dispatch {
    Dispatch {
        section: Section::Moe,
        ..d
    }
}

/// The model's MoE shape.
fn shape<'a>(b: &BlockCtx<'a>) -> Result<&'a MoeConfig> {
    b.c.moe
        .as_ref()
        .ok_or_else(|| Error::Gpu("an MoE layer in a config without MoE".into()))
}

/// The shape of one routed expert as an MLP.
fn expert_shape(m: &MoeConfig) -> MlpConfig {
    MlpConfig {
        intermediate: m.intermediate,
        act: m.act,
        bias: false,
    }
}

/// The next block's pre-norm weights (`params [nw_off..nw_off + d_model]`), for the down
/// pass that makes that norm (`tail_takes_next_norm`).
#[derive(Clone, Copy)]
pub struct NextNorm<'a> {
    pub params: &'a wgpu::Buffer,
    pub nw_off: usize,
}

/// Whether a fused one-token MoE block can make the next block's pre-norm in its last down
/// pass (`expert_gemv::NormTail`): its experts' down passes are the last to write the
/// residual (no latent projection after them, no shared expert of its own shape after
/// them), the activations are q8 blocks and the last bank's workgroups tile the q8 blocks.
/// MAMBA2_NORM_TAIL=0 keeps the norm's own dispatch (for measuring).
pub fn tail_takes_next_norm(b: &BlockCtx, w: &DeviceMoe) -> Result<bool> {
    if !norm_tail_enabled()? || w.latent.is_some() || w.shared.is_some() || b.q8().is_none() {
        return Ok(false);
    }
    let m = shape(b)?;
    match w.down.last() {
        Some(down) => takes_norm_tail(b.k, down, w.d_model, m.slots(), true),
        None => Ok(false),
    }
}

/// MAMBA2_NORM_TAIL: 0 keeps every decode pre-norm a dispatch of its own (or folded), 1
/// (the default) lets the experts' down pass make the next one.
fn norm_tail_enabled() -> Result<bool> {
    Ok(crate::gpu::kernels::env_switch(
        "MAMBA2_NORM_TAIL",
        "the pre-norm's own dispatch",
        "made by the experts' down pass",
    )?
    .unwrap_or(true))
}

/// One decode token through an MoE block; `index` counts the MoE layers before this one
/// (its row of the expert-load counters). Unfused, after the pre-norm into `h` and its q8
/// blocks. `fused` (the fused graph): the experts take their activation in the up pass
/// (one dispatch fewer; its workgroups hold whole q8 blocks of rows, so its team differs
/// from the unfolded pass's: a batch folds it too), and with `pre_norm` (the norm weights'
/// offset in `params`) the router GEMV makes the pre-norm in its prologue and writes `h`
/// for the experts, and the first up pass routes. With `next_norm` (where
/// `tail_takes_next_norm`), the last down pass also makes the next block's pre-norm: its
/// q8 blocks without the 1/rms into `xq`/`xd`, the sums into `norm_part`.
/// Over a batch's lanes (the pre-norm made before) the lanes go through
/// the routing and the expert passes as that many tokens, each lane's arithmetic the
/// one-token graph's (the norm kernel and the routing dispatch are the same bits as their
/// folds).
pub fn decode(
    b: &BlockCtx,
    w: &DeviceMoe,
    params: &wgpu::Buffer,
    index: usize,
    fused: bool,
    pre_norm: Option<usize>,
    next_norm: Option<NextNorm>,
) -> Result<Vec<Dispatch>> {
    let (k, s) = (b.k, b.s);
    let m = shape(b)?;
    let q8 = b.q8();
    let folds_norm = fused && pre_norm.is_some();
    let tokens = b.lanes.n;
    let batch = b.lanes.cap > 1;
    if batch && pre_norm.is_some() {
        return Err(Error::Gpu(
            "a batch makes its MoE blocks' pre-norm before them".into(),
        ));
    }
    let router = match pre_norm {
        None => gemv::gemv(
            k,
            "router",
            &w.router,
            GemvInput::Plain,
            GemvOutput::Store,
            GemvBuffers {
                lanes: b.lanes,
                ..GemvBuffers::plain(&s.h, None, &s.router_logits)
            },
        )?,
        Some(nw_off) => gemv::gemv(
            k,
            "norm+router",
            &w.router,
            GemvInput::Norm {
                d: b.c.d_model,
                eps: b.c.norm_eps,
                nw_off,
                wg: rmsnorm::CHUNK,
            },
            GemvOutput::Store,
            GemvBuffers {
                params: Some(params),
                norm_out: Some(NormOut { h: &s.h, q8 }),
                ..GemvBuffers::plain(&s.resid, None, &s.router_logits)
            },
        )?,
    };
    let mut d = vec![moe_section(router)];
    let route = RouteFold {
        moe: m,
        logits: &s.router_logits,
        params: w.bias_off.map(|o| (params, o)),
        // (A batch's steps leave the expert load alone: the inspector's view is of one
        // sequence, and a batch's free lanes route too.)
        counts: (!batch).then_some((&s.expert_counts, index * m.experts)),
    };
    // Fused, the first up pass routes in its prologue where that pays (one dispatch fewer
    // per layer). A batch keeps the dispatch: with every up-pass workgroup routing its lane,
    // Nemotron 3 Nano's 16-lane step went 8.32 → 8.75 ms on an H100 (run 231; Granite-Tiny
    // 5.92 → 5.84 at 16 lanes, but 17.05 → 17.24 at 64).
    let route = if folds_norm && routes_in_prologue(b, w, m)? {
        Some(route)
    } else {
        d.push(moe_route(
            k,
            "route",
            m,
            tokens,
            RouteBuffers {
                logits: route.logits,
                params: route.params,
                ids: &s.moe_ids,
                weights: &s.moe_weights,
                counts: route.counts,
                ctrl: None,
            },
        )?);
        None
    };
    let mid_q8 = q8.map(|_| (&s.moe_xq, &s.moe_xd));
    let stage = Stage {
        h: &s.h,
        h_q8: q8,
        ids: &s.moe_ids,
        weights: &s.moe_weights,
        up: &s.moe_up,
        mid: &s.moe_mid,
        mid_q8,
        resid: &s.resid,
        store: false,
        lane_width: batch.then_some(s.lane_width),
        sum_at: None,
        route,
        norm_tail: next_norm.map(|n| NormTail {
            params: n.params,
            nw_off: n.nw_off,
            xq: &s.xq,
            xd: &s.xd,
            part: &s.norm_part,
            counts: &s.norm_count,
        }),
    };
    match &w.latent {
        None => d.extend(experts(b, w, stage, fused)?),
        // Latent MoE: the experts read fc1·h (f32; in a quantized run its q8 blocks, which
        // the expert GEMVs multiply the stored blocks with) and their sum goes through fc2.
        Some((fc1, fc2)) => {
            // (A batch's lanes of the latent vectors, their q8 blocks and their sums lie a
            // lane width apart, as every GEMV's input and output lanes.)
            let l = fc1.rows;
            let ds = match batch {
                true => s.lane_width,
                false => l.next_multiple_of(32),
            };
            d.push(moe_section(gemv::gemv(
                k,
                "fc1_latent_proj",
                fc1,
                GemvInput::Plain,
                GemvOutput::Store,
                GemvBuffers {
                    lanes: b.lanes,
                    ..GemvBuffers::plain(&s.h, None, &s.latent)
                },
            )?));
            let latent_q8 = q8.map(|_| (&s.latent_xq, &s.latent_xd));
            if let Some(q) = latent_q8 {
                d.push(q8_rows(k, "latent_q8", l, tokens, &s.latent, ds, q, ds)?);
            }
            d.extend(experts(
                b,
                w,
                Stage {
                    h: &s.latent,
                    h_q8: latent_q8,
                    resid: &s.latent_sum,
                    store: true,
                    sum_at: batch.then_some(RowsAt {
                        stride: ds,
                        offset: 0,
                    }),
                    norm_tail: None,
                    ..stage
                },
                fused,
            )?);
            d.push(moe_section(gemv::gemv(
                k,
                "fc2_latent_proj+residual",
                fc2,
                GemvInput::Plain,
                GemvOutput::Add,
                GemvBuffers {
                    lanes: b.lanes,
                    ..GemvBuffers::plain(&s.latent_sum, None, &s.resid)
                },
            )?));
        }
    }
    if let (Some(sm), Some((up, down))) = (&m.shared, &w.shared) {
        d.extend(
            mlp::decode(b, sm, up, down, None)?
                .into_iter()
                .map(|x| shared_named(moe_section(x))),
        );
    }
    Ok(d)
}

/// A prefill block through an MoE block (after the pre-norm into `p.h`); `index` as in
/// `decode`. The block's (token, choice) pairs are sorted by expert on the device, each
/// expert's rows go through grouped GEMMs (tiles of one expert each), and the weighted
/// outputs are gathered back into the residual.
pub fn prefill(
    b: &BlockCtx,
    p: &Prefill,
    tokens: usize,
    w: &DeviceMoe,
    params: &wgpu::Buffer,
    index: usize,
) -> Result<Vec<Dispatch>> {
    let (k, s) = (b.k, b.s);
    let m = shape(b)?;
    let (slots, stored) = (m.slots(), m.stored_experts());
    let rows = sorted_rows(tokens, slots, stored);
    // (A short block splits the router's K loop too: its few rows make one row tile, one
    // workgroup per token tile — 7.9 ms of Nemotron 3 Nano's 5-token block on the H200,
    // run 95.)
    let mut d: Vec<Dispatch> = projection(
        k,
        "router",
        &w.router,
        tokens,
        &p.h,
        &p.part,
        &p.router_logits,
        m.experts,
        GemmOutput::Store,
        &s.ctrl,
    )?
    .into_iter()
    .map(moe_section)
    .collect();
    d.push(moe_route(
        k,
        "route",
        m,
        tokens,
        RouteBuffers {
            logits: &p.router_logits,
            params: w.bias_off.map(|o| (params, o)),
            ids: &p.moe_ids,
            weights: &p.moe_weights,
            counts: Some((&s.expert_counts, index * m.experts)),
            ctrl: Some(&s.ctrl),
        },
    )?);
    d.push(moe_sort(
        k,
        "sort",
        stored,
        slots,
        tokens,
        SortBuffers {
            ids: &p.moe_ids,
            ctrl: &s.ctrl,
            pairs: &p.moe_pairs,
            pos: &p.moe_pos,
            tile_expert: &p.tile_expert,
        },
    )?);
    // Latent MoE: the experts read fc1·h, their sums go through fc2 (rows ceil32(L) apart).
    let (x_in, x_stride) = match &w.latent {
        Some((fc1, _)) => {
            let stride = fc1.rows.next_multiple_of(32);
            d.push(moe_section(
                gemm(
                    k,
                    "fc1_latent_proj",
                    fc1,
                    tokens,
                    &p.h,
                    &p.moe_latent,
                    stride,
                    0,
                    GemmOutput::Store,
                    &s.ctrl,
                )?
                .per_token(1, TILE.1, 1),
            ));
            (&p.moe_latent, stride)
        }
        None => (&p.h, b.c.d_model),
    };
    for (first, count, up, _) in w.banks() {
        for part in up_parts(first, count, up, m.up_rows())? {
            d.push(expert_gemm(
                k,
                &part.name,
                part.w,
                part.bank,
                SortedRows {
                    rows,
                    tile_expert: &p.tile_expert,
                    gather: Some((&p.moe_pairs, slots)),
                },
                x_in,
                &p.moe_up,
                m.up_rows(),
                part.at.offset,
            )?);
        }
    }
    let e = expert_shape(m);
    d.push(moe_section(mlp_act(
        k,
        "experts.act",
        e.act,
        e.intermediate,
        m.up_rows(),
        rows,
        ActBuffers {
            src: &p.moe_up,
            dst: &p.moe_mid,
            q8: None,
        },
        None,
    )?));
    for (first, count, _, down) in w.banks() {
        d.push(expert_gemm(
            k,
            &format!("experts.down[{first}..{}]", first + count),
            down,
            Bank {
                first,
                count,
                rows_per_expert: w.d_model,
            },
            SortedRows {
                rows,
                tile_expert: &p.tile_expert,
                gather: None,
            },
            &p.moe_mid,
            &p.moe_down,
            w.d_model,
            0,
        )?);
    }
    let latent = w.latent.as_ref();
    d.push(moe_combine(
        k,
        if latent.is_some() {
            "combine"
        } else {
            "combine+residual"
        },
        w.d_model,
        slots,
        tokens,
        rows,
        CombineBuffers {
            y: &p.moe_down,
            pos: &p.moe_pos,
            weights: &p.moe_weights,
            resid: if latent.is_some() {
                &p.moe_latent_sum
            } else {
                &p.resid
            },
            ctrl: &s.ctrl,
            scale: w.down.first().map_or(1.0, |d| d.out_scale),
            out_stride: if latent.is_some() {
                x_stride
            } else {
                b.c.d_model
            },
            store: latent.is_some(),
        },
    )?);
    if let Some((_, fc2)) = latent {
        d.push(moe_section(
            gemm(
                k,
                "fc2_latent_proj+residual",
                fc2,
                tokens,
                &p.moe_latent_sum,
                &p.resid,
                b.c.d_model,
                0,
                GemmOutput::Add,
                &s.ctrl,
            )?
            .per_token(1, TILE.1, 1),
        ));
    }
    if let (Some(sm), Some((up, down))) = (&m.shared, &w.shared) {
        d.extend(
            mlp::prefill(b, p, tokens, sm, up, down, None)?
                .into_iter()
                .map(|x| shared_named(moe_section(x))),
        );
    }
    Ok(d)
}

/// Whether the decode up pass routes its token: not over f16 experts (on the H200 the
/// prologue cost Nemotron 3 Nano's f16 up pass more than the routing dispatch it replaced:
/// 2.896 → 2.93 ms/token, while q8_0 went 1.887 → 1.80, run 156); where its workgroup (at
/// least the expert GEMVs' size) holds a writer invocation per slot, and the device binds
/// the 12 storage buffers it may take (weights and scales, the q8 input, the activation's
/// output and q8 blocks, the ids, and the routing's weights, logits, correction bias and
/// counters).
fn routes_in_prologue(b: &BlockCtx, w: &DeviceMoe, m: &MoeConfig) -> Result<bool> {
    let buffers = b.k.ctx.device.limits().max_storage_buffers_per_shader_stage;
    let f16 = w.up.iter().flatten().any(|u| u.format == WeightFormat::F16);
    Ok(!f16
        && buffers >= 12
        && m.slots() <= gemv::one_token_wg(b.k, gemv::WgKind::Expert)? as usize)
}

/// Whether gated experts fold `silu(g)·u` into the up pass (MAMBA2_GATED_FOLD=0 keeps the
/// activation's own dispatch, for measuring).
fn gated_fold() -> Result<bool> {
    Ok(crate::gpu::kernels::env_switch(
        "MAMBA2_GATED_FOLD",
        "the gated activation's own dispatch",
        "silu(g)·u in the up pass",
    )?
    .unwrap_or(true))
}

/// The buffers the routed experts read and write.
struct Stage<'a> {
    h: &'a wgpu::Buffer,
    h_q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
    ids: &'a wgpu::Buffer,
    weights: &'a wgpu::Buffer,
    up: &'a wgpu::Buffer,
    mid: &'a wgpu::Buffer,
    mid_q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
    /// Where the weighted sum goes: added into the residual, or stored (a latent sum).
    resid: &'a wgpu::Buffer,
    store: bool,
    /// A batch's lane stride of `h` (or the latent vector) and its q8 blocks, and of the
    /// norm tail's q8 blocks (`Scratch::lane_width`); None: one token.
    lane_width: Option<usize>,
    /// A batch's rows of the weighted sum (a latent sum's lanes, the fc2 GEMV's stride).
    sum_at: Option<RowsAt>,
    /// The routing, when the first up pass does it.
    route: Option<RouteFold<'a>>,
    /// The next block's pre-norm, made by the last down pass.
    norm_tail: Option<NormTail<'a>>,
}

/// The routed experts of one decode token: up per bank, the activation of every choice,
/// down per bank into the residual. Fused, the up pass's epilogue makes the activation
/// (one dispatch fewer per layer): `relu(u)²`, or `silu(g)·u` where every bank's
/// `[gate; up]` is one matrix (`gated_fold`).
fn experts(b: &BlockCtx, w: &DeviceMoe, st: Stage, fused: bool) -> Result<Vec<Dispatch>> {
    let k = b.k;
    let m = shape(b)?;
    // A batch's lanes are the passes' tokens (their inputs a lane width apart).
    let tokens = b.lanes.n;
    let lane_width = st.lane_width;
    let gated = m.act == MlpAct::SiluGated;
    let fold = fused
        && match gated {
            false => true,
            true => gated_fold()? && w.banks().all(|(_, _, up, _)| up.len() == 1),
        };
    // The chosen experts and the shared expert's slices alike.
    let top_k = m.slots();
    let mut d = Vec::new();
    let mut route = st.route;
    for (first, count, up, _) in w.banks() {
        let parts = up_parts(first, count, up, m.up_rows())?;
        let whole = parts.len() == 1;
        for part in parts {
            let route = route.take();
            let name = part.name;
            d.push(expert_gemv(
                k,
                &if route.is_some() {
                    format!("route+{name}")
                } else {
                    name
                },
                part.w,
                part.bank,
                ExpertPass::Up,
                tokens,
                top_k,
                ExpertBuffers {
                    src: st.h,
                    q8: st.h_q8,
                    dst: st.up,
                    dst_at: (!whole).then_some(part.at),
                    ids: st.ids,
                    store: false,
                    // (Folded, every bank's up is one part.)
                    act: fold.then_some(ActFold {
                        mid: st.mid,
                        q8: st.mid_q8,
                        gated,
                    }),
                    weights: route.as_ref().map(|_| st.weights),
                    route,
                    norm_tail: None,
                    lane_width,
                },
            )?);
        }
    }
    let e = expert_shape(m);
    if !fold {
        let act = mlp_act(
            k,
            "experts.act",
            e.act,
            e.intermediate,
            m.up_rows(),
            top_k * tokens,
            ActBuffers {
                src: st.up,
                dst: st.mid,
                q8: st.mid_q8,
            },
            None,
        )?;
        d.push(moe_section(act));
    }
    let banks = w.banks().count();
    let mut norm_tail = st.norm_tail;
    for (i, (first, count, _, down)) in w.banks().enumerate() {
        let tail = if i + 1 == banks {
            norm_tail.take()
        } else {
            None
        };
        let name = format!("experts.down[{first}..{}]+residual", first + count);
        d.push(expert_gemv(
            k,
            &if tail.is_some() {
                format!("{name}+next_norm")
            } else {
                name
            },
            down,
            Bank {
                first,
                count,
                rows_per_expert: w.d_model,
            },
            ExpertPass::Down,
            tokens,
            top_k,
            ExpertBuffers {
                src: st.mid,
                q8: st.mid_q8,
                dst: st.resid,
                dst_at: st.sum_at,
                ids: st.ids,
                weights: Some(st.weights),
                // The first bank writes a latent sum, the others add to it.
                store: st.store && first == 0,
                act: None,
                route: None,
                norm_tail: tail,
                lane_width,
            },
        )?);
    }
    Ok(d)
}

/// One matrix of an expert bank's up projection: its dispatch name, the bank of its rows
/// and where they go in each choice's `[gate; up]` row.
struct UpPart<'a> {
    name: String,
    w: &'a DeviceMatrix,
    bank: Bank,
    at: RowsAt,
}

/// The up projection of the bank of `count` experts from `first` as the matrices it is
/// stored in (`DeviceMoe::up`): one of `up_rows` rows per expert, or gate and up of half
/// as many each, into their halves of the rows (`parts::named_per`: an error unless the
/// parts make up exactly `up_rows` rows of every expert).
fn up_parts(
    first: usize,
    count: usize,
    parts: &[DeviceMatrix],
    up_rows: usize,
) -> Result<Vec<UpPart<'_>>> {
    let name = format!("experts.up[{first}..{}]", first + count);
    let named = super::parts::named_per(&name, parts, up_rows, count)?;
    Ok(named
        .into_iter()
        .map(|(name, offset, w)| UpPart {
            name,
            w,
            bank: Bank {
                first,
                count,
                rows_per_expert: w.rows / count.max(1),
            },
            at: RowsAt {
                stride: up_rows,
                offset,
            },
        })
        .collect())
}

/// The shared expert's dispatches are named as such.
fn shared_named(d: Dispatch) -> Dispatch {
    let name = format!("shared.{}", d.name);
    Dispatch { name, ..d }
}
