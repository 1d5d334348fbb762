//! Mixture-of-experts blocks on the GPU (lavapipe in CI): the routing kernel against the CPU
//! router (the same ids, bit for bit) and transformers' own choices, and the decode up pass
//! that routes in its prologue against the routing kernel (ids and weights bit for bit); whole MoE models —
//! Nemotron-H's grouped sigmoid router with relu² experts, Granite's softmax top-k with gated
//! experts and µP multipliers — decode and prefill against the CPU reference, with the
//! experts split over several banks; the expert-load counters against the oracle's routing.

mod common;

use std::collections::BTreeMap;

use mamba2_wgpu::config::{MlpAct, MlpConfig, MoeConfig, Router};
use mamba2_wgpu::gpu::GpuBackend;
use mamba2_wgpu::gpu::engine::{Engine, EngineOptions, PrefillMode};
use mamba2_wgpu::gpu::graph::Ctrl;
use mamba2_wgpu::gpu::kernels::Kernels;
use mamba2_wgpu::gpu::kernels::expert_gemv::{
    Bank, ExpertBuffers, ExpertPass, RouteFold, expert_gemv,
};
use mamba2_wgpu::gpu::kernels::moe_route::{RouteBuffers, moe_route};
use mamba2_wgpu::gpu::kernels::moe_sort::sorted_rows;
use mamba2_wgpu::gpu::prefill::Prefill;
use mamba2_wgpu::gpu::state_store::KvFormat;
use mamba2_wgpu::gpu::weights::DeviceMatrix;
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::quant::{WeightFormat, pack};
use mamba2_wgpu::model::synthetic::{tiny_latent_moe, tiny_moe};
use mamba2_wgpu::reference::model::route;
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};
use mamba2_wgpu::sampling::uniform;
use mamba2_wgpu::session::Backend;
use safetensors::SafeTensors;

fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (uniform(seed, i) * vocab as f32) as u32)
        .collect()
}

/// A router of `experts` experts choosing `top_k`: grouped (Nemotron-H) or softmax (Granite).
fn router(experts: usize, top_k: usize, groups: Option<(usize, usize)>) -> MoeConfig {
    MoeConfig {
        experts,
        top_k,
        intermediate: 8,
        act: MlpAct::Relu2,
        router: match groups {
            Some((n_group, topk_group)) => Router::Grouped {
                n_group,
                topk_group,
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
            },
            None => Router::SoftmaxTopK,
        },
        shared: None,
        latent: None,
    }
}

/// `router`'s grouped router with the weights left unnormalised (`norm_topk_prob: false`).
fn unnormalised(mut m: MoeConfig) -> MoeConfig {
    if let Router::Grouped { norm_topk_prob, .. } = &mut m.router {
        *norm_topk_prob = false;
    }
    m
}

/// `router` with a shared expert `slices` times the routed experts' width: that many
/// always-chosen slots after the routed ones (id `experts + s`, weight 1).
fn with_shared(mut m: MoeConfig, slices: usize) -> MoeConfig {
    m.shared = Some(MlpConfig {
        intermediate: slices * m.intermediate,
        act: m.act,
        bias: false,
    });
    assert_eq!(m.shared_slots(), slices);
    m
}

/// Runs the routing kernel over `logits` (`T` rows of `E`) — as a prefill block of `T` tokens
/// and, for the first row, as the decode dispatch — and returns `(ids, weights)` per token.
fn gpu_route(
    m: &MoeConfig,
    logits: &[Vec<f32>],
    bias: &[f32],
) -> Option<Vec<(Vec<u32>, Vec<f32>)>> {
    let k = common::kernels(1 << 20)?;
    let ctx = k.ctx.clone();
    let t = logits.len();
    let buf = |v: &[f32]| ctx.storage_with("test", bytemuck::cast_slice(v)).unwrap();
    let flat: Vec<f32> = logits.concat();
    let (l, p) = (buf(&flat), buf(bias));
    let zeros = |n: usize| ctx.storage_zeroed("test", 4 * n as u64).unwrap();
    // Rows of K chosen experts, then the shared expert's slices.
    let slots = m.slots();
    let run = |tokens: usize, ctrl: Option<&wgpu::Buffer>| {
        let (ids, w) = (zeros(tokens * slots), zeros(tokens * slots));
        let d = moe_route(
            &k,
            "route",
            m,
            tokens,
            RouteBuffers {
                logits: &l,
                params: m.has_correction_bias().then_some((&p, 0)),
                ids: &ids,
                weights: &w,
                counts: None,
                ctrl,
            },
        )
        .unwrap();
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            d.record_tokens(&mut pass, Some(tokens as u32));
        }
        ctx.queue.submit([enc.finish()]);
        ctx.wait().unwrap();
        let raw = ctx.read(&ids, (4 * tokens * slots) as u64).unwrap();
        let ids: Vec<u32> = raw
            .chunks_exact(4)
            .take(tokens * slots)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let w = ctx.read_f32(&w, tokens * slots).unwrap();
        ids.chunks(slots)
            .zip(w.chunks(slots))
            .map(|(i, w)| {
                for s in m.top_k..slots {
                    let id = (m.experts + s - m.top_k) as u32;
                    assert_eq!((i[s], w[s]), (id, 1.0), "shared slice {s}");
                }
                (i[..m.top_k].to_vec(), w[..m.top_k].to_vec())
            })
            .collect::<Vec<_>>()
    };
    let ctrl = Ctrl {
        prompt_len: t as u32,
        ..Default::default()
    };
    let ctrl = ctx.storage_with("ctrl", bytemuck::bytes_of(&ctrl)).unwrap();
    let block = run(t.max(2), Some(&ctrl));
    let single = run(1, None);
    assert_eq!(single[0], block[0], "the decode and prefill routers agree");
    let (ids, w) = up_pass_routing(&k, m, &l, &p);
    assert_eq!(
        (&ids, common::bits(&w)),
        (&single[0].0, common::bits(&single[0].1)),
        "the up pass routing in its prologue writes the routing kernel's ids and weights"
    );
    Some(block.into_iter().take(t).collect())
}

/// The decode up pass that routes its token (the first row of `logits`) in its prologue
/// over a bank of random f32 experts: checks its outputs are the chosen experts' rows times
/// the input and its expert-load counts one per choice; returns the ids and weights it wrote
/// (the `K` chosen; the shared slices are checked here).
fn up_pass_routing(
    k: &Kernels,
    m: &MoeConfig,
    logits: &wgpu::Buffer,
    bias: &wgpu::Buffer,
) -> (Vec<u32>, Vec<f32>) {
    let ctx = k.ctx.clone();
    let (rows, cols, slots) = (5, 40, m.slots());
    let stored = m.stored_experts();
    let w: Vec<f32> = (0..stored * rows * cols)
        .map(|i| uniform(11, i as u64) - 0.5)
        .collect();
    let bank = DeviceMatrix::upload(
        &ctx,
        "bank",
        &pack(WeightFormat::F32, &w, stored * rows, cols),
    )
    .unwrap();
    let mut x: Vec<f32> = (0..cols).map(|i| uniform(12, i as u64) - 0.5).collect();
    x.resize(cols.next_multiple_of(32), 0.0);
    let src = ctx.storage_with("x", bytemuck::cast_slice(&x)).unwrap();
    let zeros = |n: usize| ctx.storage_zeroed("test", 4 * n as u64).unwrap();
    let (ids, wts, dst, counts) = (
        zeros(slots),
        zeros(slots),
        zeros(slots * rows),
        zeros(m.experts),
    );
    let d = expert_gemv(
        k,
        "route+up",
        &bank,
        Bank {
            first: 0,
            count: stored,
            rows_per_expert: rows,
        },
        ExpertPass::Up,
        1,
        slots,
        ExpertBuffers {
            src: &src,
            q8: None,
            dst: &dst,
            dst_at: None,
            ids: &ids,
            weights: Some(&wts),
            store: false,
            act: None,
            route: Some(RouteFold {
                moe: m,
                logits,
                params: m.has_correction_bias().then_some((bias, 0)),
                counts: Some((&counts, 0)),
            }),
            norm_tail: None,
            lane_width: None,
        },
    )
    .unwrap();
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        d.record_tokens(&mut pass, Some(1));
    }
    ctx.queue.submit([enc.finish()]);
    ctx.wait().unwrap();
    let u32s = |b: &wgpu::Buffer, n: usize| -> Vec<u32> {
        bytemuck::cast_slice(&ctx.read(b, 4 * n as u64).unwrap()[..4 * n]).to_vec()
    };
    let got_ids = u32s(&ids, slots);
    let got_w = ctx.read_f32(&wts, slots).unwrap();
    let out = ctx.read_f32(&dst, slots * rows).unwrap();
    for (s, &id) in got_ids.iter().enumerate() {
        if s >= m.top_k {
            let want = (m.experts + s - m.top_k) as u32;
            assert_eq!((id, got_w[s]), (want, 1.0), "shared slice {s}");
        }
        for r in 0..rows {
            let row = &w[(id as usize * rows + r) * cols..][..cols];
            let want: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
            let got = out[s * rows + r];
            assert!(
                (got - want).abs() <= 1e-5,
                "slot {s} (expert {id}) row {r}: {got} vs {want}"
            );
        }
    }
    let mut want_counts = vec![0u32; m.experts];
    for &id in &got_ids[..m.top_k] {
        want_counts[id as usize] += 1;
    }
    assert_eq!(u32s(&counts, m.experts), want_counts, "expert load");
    (got_ids[..m.top_k].to_vec(), got_w[..m.top_k].to_vec())
}

/// The GPU router's choices equal the CPU router's exactly, in order; weights to f32 rounding.
fn check_route(what: &str, m: &MoeConfig, logits: &[Vec<f32>], bias: &[f32]) -> Option<()> {
    let got = gpu_route(m, logits, bias)?;
    for (t, (l, (ids, w))) in logits.iter().zip(&got).enumerate() {
        let want = route(m, l, m.has_correction_bias().then_some(bias));
        let want_ids: Vec<u32> = want.ids.iter().map(|&i| i as u32).collect();
        assert_eq!(ids, &want_ids, "{what}: token {t}: chosen experts");
        for (g, c) in w.iter().zip(&want.weights) {
            assert!(
                (g - c).abs() <= 1e-6 * c.abs().max(1.0),
                "{what}: token {t}: {w:?} vs {:?}",
                want.weights
            );
        }
    }
    Some(())
}

fn rand_rows(seed: u64, rows: usize, cols: usize, lo: f32, hi: f32) -> Vec<Vec<f32>> {
    (0..rows)
        .map(|r| {
            (0..cols)
                .map(|c| lo + (hi - lo) * uniform(seed, (r * cols + c) as u64))
                .collect()
        })
        .collect()
}

#[test]
fn router_kernel_picks_the_cpu_routers_experts() {
    // (what, experts, top_k, groups, logits): random, with ties, with the best experts all in
    // one group, negative corrected scores (the masked groups must never win), weights left
    // unnormalised, shared-expert slots after the routed ones.
    let mut ties = rand_rows(3, 40, 16, -2.0, 2.0);
    for row in &mut ties {
        let v = row[5];
        row[9] = v;
        row[13] = v;
        row[2] = row[7];
    }
    let mut one_group = rand_rows(4, 40, 16, -3.0, -1.0);
    for row in &mut one_group {
        for x in &mut row[8..12] {
            *x += 6.0;
        }
    }
    type Case = (&'static str, MoeConfig, Vec<Vec<f32>>, Vec<f32>);
    let cases: Vec<Case> = vec![
        (
            "grouped 16/4/2 top-2",
            router(16, 2, Some((4, 2))),
            rand_rows(1, 70, 16, -3.0, 3.0),
            vec![0.0; 16],
        ),
        (
            "grouped with correction bias",
            router(16, 3, Some((4, 2))),
            rand_rows(2, 70, 16, -3.0, 3.0),
            rand_rows(9, 1, 16, -0.2, 0.2).remove(0),
        ),
        (
            "grouped, ties",
            router(16, 4, Some((4, 3))),
            ties.clone(),
            vec![0.0; 16],
        ),
        (
            "grouped, one strong group",
            router(16, 6, Some((4, 2))),
            one_group,
            vec![0.0; 16],
        ),
        (
            "grouped, negative corrected scores",
            router(16, 3, Some((4, 1))),
            rand_rows(5, 40, 16, -4.0, 4.0),
            vec![-0.9; 16],
        ),
        (
            "grouped, one group of 128, top-6",
            router(128, 6, Some((1, 1))),
            rand_rows(6, 20, 128, -3.0, 3.0),
            rand_rows(10, 1, 128, -0.1, 0.1).remove(0),
        ),
        (
            "grouped, weights not normalised",
            unnormalised(router(16, 3, Some((4, 2)))),
            rand_rows(11, 40, 16, -3.0, 3.0),
            rand_rows(12, 1, 16, -0.2, 0.2).remove(0),
        ),
        (
            "grouped with a shared expert of two slices",
            with_shared(router(16, 2, Some((4, 2))), 2),
            rand_rows(13, 40, 16, -3.0, 3.0),
            vec![0.0; 16],
        ),
        (
            "softmax top-3 of 10 with a shared expert",
            with_shared(router(10, 3, None), 1),
            rand_rows(14, 40, 10, -3.0, 3.0),
            vec![],
        ),
        (
            "softmax top-3 of 10",
            router(10, 3, None),
            rand_rows(7, 70, 10, -3.0, 3.0),
            vec![],
        ),
        ("softmax, ties", router(16, 4, None), ties, vec![]),
        (
            "softmax top-10 of 72",
            router(72, 10, None),
            rand_rows(8, 20, 72, -3.0, 3.0),
            vec![],
        ),
    ];
    for (what, m, logits, bias) in &cases {
        check_route(what, m, logits, bias).unwrap_or(());
    }
}

/// One MoE layer's routing as the oracle recorded it: `(layer, router logits [T][E], ids [T][K])`.
type Routing = (usize, Vec<Vec<f32>>, Vec<Vec<u32>>);

/// The oracle's per-MoE-layer records of a fixture.
fn oracle_routing(name: &str) -> Vec<Routing> {
    let bytes = std::fs::read(common::fixture(name).join("oracle.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ints = |n: &str| -> (Vec<usize>, Vec<u32>) {
        let t = st.tensor(n).unwrap();
        let v = t
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect();
        (t.shape().to_vec(), v)
    };
    let (_, layers) = ints("moe_layers");
    layers
        .iter()
        .map(|&l| {
            let t = st.tensor(&format!("moe.{l}.router_logits")).unwrap();
            let e = t.shape()[1];
            let logits: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let (shape, ids) = ints(&format!("moe.{l}.expert_ids"));
            (
                l as usize,
                logits.chunks(e).map(<[f32]>::to_vec).collect(),
                ids.chunks(shape[1]).map(<[u32]>::to_vec).collect(),
            )
        })
        .collect()
}

#[test]
fn router_kernel_chooses_what_transformers_chose() {
    for name in ["nemotron_h_moe", "granite_moe_hybrid", "granite_rope"] {
        let model = Model::load(&common::fixture(name)).unwrap();
        let m = model.config.moe.clone().unwrap();
        for (layer, logits, want) in oracle_routing(name) {
            // Granite's layer N is this engine's blocks 2N (mixer) and 2N + 1 (MoE).
            let block = if name.starts_with("granite") {
                2 * layer + 1
            } else {
                layer
            };
            let bias: Vec<f32> = match &model.weights.layers[block].mixer {
                mamba2_wgpu::model::MixerWeights::Moe(w) => {
                    w.correction_bias.as_ref().map_or(vec![], |b| b.to_f32())
                }
                _ => panic!("{name}: layer {layer} is not an MoE layer"),
            };
            let what = format!("{name} layer {layer}");
            if check_route(&what, &m, &logits, &bias).is_none() {
                return;
            }
            let got = gpu_route(&m, &logits, &bias).unwrap();
            for (t, ((ids, _), want)) in got.iter().zip(&want).enumerate() {
                // transformers' order within the chosen set is unspecified (topk sorted=False).
                let (mut a, mut b) = (ids.clone(), want.clone());
                a.sort_unstable();
                b.sort_unstable();
                assert_eq!(a, b, "{what}: token {t}: the experts transformers chose");
            }
        }
    }
}

/// A GPU backend for `model` with experts in banks of at most `bank_bytes`.
fn backend(
    model: &Model,
    format: WeightFormat,
    fused: bool,
    prefill: PrefillMode,
    bank_bytes: Option<u64>,
) -> Option<GpuBackend> {
    let ctx = common::gpu(&Engine::needs(&model.config, format))?;
    let opts = EngineOptions {
        format,
        fused,
        chunk_size: Some(16),
        prefill,
        context: Some(1024),
        kv: KvFormat::F32,
        expert_bank_bytes: bank_bytes,
    };
    Some(GpuBackend::new(Engine::new(ctx, model, opts).unwrap()).unwrap())
}

/// Nemotron-H's router and relu² experts (separate shared expert), Granite's softmax router
/// and gated experts (the shared expert stored as expert slices), and latent projections.
fn models() -> Vec<(&'static str, mamba2_wgpu::config::ModelConfig)> {
    vec![
        ("nemotron ME*E-M", tiny_moe("ME*E-M", false)),
        ("granite MEME*E", tiny_moe("MEME*E", true)),
        ("latent ME*E-M", tiny_latent_moe("ME*E-M")),
    ]
}

#[test]
fn moe_models_match_the_cpu_reference() {
    for (pattern, config) in models() {
        let model = Model::synthetic(config, 21);
        let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
        let toks = tokens(150, 3, model.config.vocab_size);
        let mut cpu_state = cpu.new_state();
        let want = cpu
            .forward(&mut cpu_state, &toks, Scan::Sequential, Logits::All)
            .unwrap();
        // One bank of all experts, and banks of a few experts (up to 4 dispatches per pass).
        for bank in [None, Some(3 * 1024)] {
            for fused in [true, false] {
                for prefill in [PrefillMode::Decode, PrefillMode::Chunked] {
                    let what = format!("{pattern} bank={bank:?} fused={fused} {prefill:?}");
                    let Some(mut gpu) = backend(&model, WeightFormat::F32, fused, prefill, bank)
                    else {
                        return;
                    };
                    let banks = match &gpu.engine.weights.layers[1].mixer {
                        mamba2_wgpu::gpu::device_weights::DeviceMixer::Moe(m) => m.up.len(),
                        _ => panic!("layer 1 is an MoE layer"),
                    };
                    assert_eq!(banks > 1, bank.is_some(), "{what}: {banks} banks");
                    let got = gpu.prefill_logits(&toks).unwrap();
                    let e = common::nmse(&got.concat(), &want.concat());
                    assert!(e <= 1e-8, "{what}: logits NMSE {e:e}");
                    let e = common::nmse(&gpu.state().unwrap().values(), &cpu_state.values());
                    assert!(e <= 1e-8, "{what}: state NMSE {e:e}");
                }
            }
        }
    }
}

/// A shared expert whose f32 projections (one row tile each: 64 and 128 rows) split their K
/// loop in every prefill graph, the perplexity one included: the partials buffer is sized for
/// them too (it once held only the routers' and the other layers' needs, and the 128-wide
/// shared down projection's split did not fit).
#[test]
fn moe_shared_expert_split_k_prefill_matches_the_cpu() {
    let mut config = tiny_moe("ME", false);
    if let Some(m) = config.moe.as_mut() {
        m.shared.as_mut().unwrap().intermediate = 128;
    }
    let model = Model::synthetic(config, 8);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let toks = tokens(300, 4, model.config.vocab_size);
    let want = cpu
        .forward(&mut cpu.new_state(), &toks, Scan::Sequential, Logits::All)
        .unwrap();
    let Some(mut gpu) = backend(&model, WeightFormat::F32, true, PrefillMode::Chunked, None) else {
        return;
    };
    let got = gpu.prefill_logits(&toks).unwrap();
    let e = common::nmse(&got.concat(), &want.concat());
    assert!(e <= 1e-8, "logits NMSE {e:e}");
}

#[test]
fn moe_chunked_prefill_equals_decode_across_blocks() {
    for (pattern, config) in models() {
        let model = Model::synthetic(config, 5);
        let vocab = model.config.vocab_size;
        let dec = backend(
            &model,
            WeightFormat::F32,
            true,
            PrefillMode::Decode,
            Some(2048),
        );
        let chk = backend(
            &model,
            WeightFormat::F32,
            true,
            PrefillMode::Chunked,
            Some(2048),
        );
        let (Some(mut dec), Some(mut chk)) = (dec, chk) else {
            return;
        };
        let warm = tokens(19, 5, vocab);
        // Q = 8: blocks of 256 tokens, so 300 tokens take two.
        chk.engine.chunk = 8;
        for len in [1, 11, 300] {
            let toks = tokens(len, len as u64, vocab);
            for b in [&mut dec, &mut chk] {
                b.reset().unwrap();
                b.prefill_logits(&warm).unwrap();
            }
            let want = dec.prefill_logits(&toks).unwrap();
            let got = chk.prefill_logits(&toks).unwrap();
            let e = common::nmse(&got.concat(), &want.concat());
            assert!(e <= 1e-8, "{pattern} L={len}: logits NMSE {e:e}");
        }
    }
}

/// The median and 80th percentile of the per-position logits NMSE. A rounding can flip a
/// near-tie routing choice, which changes that token's output wholesale (as between any two
/// implementations) and, through the recurrent state, perturbs a few tokens after it:
/// tests judge the typical position and allow a fifth of the positions as outliers (a
/// wrong formula would put every position off).
fn typical_nmse(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f64, f64) {
    let mut per: Vec<f64> = got
        .iter()
        .zip(want)
        .map(|(g, w)| common::nmse(g, w))
        .collect();
    per.sort_by(f64::total_cmp);
    (per[per.len() / 2], per[per.len() * 80 / 100])
}

#[test]
fn moe_f16_and_q8_weights_stay_close() {
    for (pattern, config) in models() {
        let model = Model::synthetic(config, 13);
        let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
        let toks = tokens(90, 4, model.config.vocab_size);
        let want = cpu
            .forward(&mut cpu.new_state(), &toks, Scan::Chunked(16), Logits::All)
            .unwrap();
        // q8_0: 1e-4 … 1e-3 per position where the routing agrees (both weights and
        // activations quantized), near-tie flips on top.
        for (format, tol) in [(WeightFormat::F16, 1e-5), (WeightFormat::Q8_0, 3e-3)] {
            for prefill in [PrefillMode::Decode, PrefillMode::Chunked] {
                let Some(mut gpu) = backend(&model, format, true, prefill, Some(4096)) else {
                    return;
                };
                let got = gpu.prefill_logits(&toks).unwrap();
                let (median, p80) = typical_nmse(&got, &want);
                let what = format!("{pattern} {format:?} {prefill:?}");
                assert!(median <= tol, "{what}: median logits NMSE {median:e}");
                assert!(p80 <= 10.0 * tol, "{what}: 80th percentile NMSE {p80:e}");
            }
        }
    }
}

/// The tiny MoE models at widths of 256 (d_model, the experts and the shared expert), so
/// that every block format can hold their expert matrices.
fn wide_moe(pattern: &str, granite: bool) -> mamba2_wgpu::config::ModelConfig {
    let mut c = tiny_moe(pattern, granite);
    c.head_dim = 64;
    c.d_inner = c.n_heads * c.head_dim;
    c.d_model = c.d_inner / 2;
    let m = c.moe.as_mut().unwrap();
    m.intermediate = 256;
    m.shared.as_mut().unwrap().intermediate = 256;
    // (Granite's residual multiplier, 0.5 here, stays: on the GPU it is the down banks'
    // output scale, so the CPU's rounded weights are the GPU's.)
    assert_eq!(c.scales.residual != 1.0, granite, "tiny_moe's multipliers");
    c
}

/// `wide_moe`'s Nemotron-H flavour with latent projections of 256: the experts read and
/// write 256 latent values, in every block format. (Without its shared expert: with one,
/// this random model's near-flat router flips at some positions of the 8-bit decode in
/// q5_0 and q8_0 — the decode's expert counts differ from the prefill's, which match the
/// CPU — and the flips' positions move the median past the bound. The shared expert is
/// the dense MLP path, tested elsewhere.)
fn wide_latent_moe(pattern: &str) -> mamba2_wgpu::config::ModelConfig {
    let mut c = wide_moe(pattern, false);
    let m = c.moe.as_mut().unwrap();
    m.latent = Some(256);
    m.shared = None;
    c
}

/// `model` with its latent projections rounded through f16, as the GPU holds them under the
/// quantized formats (`device_weights::latent_format`).
fn latent_in_f16(model: &Model) -> Model {
    use mamba2_wgpu::model::MixerWeights;
    use mamba2_wgpu::model::quant::unpack;
    use mamba2_wgpu::model::safetensors::Tensor;
    let mut m = model.clone();
    for l in &mut m.weights.layers {
        if let MixerWeights::Moe(w) = &mut l.mixer
            && let Some(latent) = &mut w.latent
        {
            for t in latent.iter_mut() {
                let (rows, cols) = (t.shape[0], t.shape[1]);
                let v = unpack(&pack(WeightFormat::F16, &t.to_f32(), rows, cols));
                *t = Tensor::from_f32(t.name.clone(), t.shape.clone(), &v);
            }
        }
    }
    m
}

/// Expert banks in the 4-, 5- and 6-bit block formats (multiplied as stored against the q8
/// activations in decode, dequantized in the prefill GEMMs) against the CPU reference on
/// the same weights rounded through the format: Nemotron-H's experts, Granite's (with its
/// residual multiplier as the down banks' output scale) and a latent MoE's (whose experts
/// read the latent vector's q8 blocks in decode, `q8_rows`).
#[test]
fn moe_block_format_experts_match_the_rounded_cpu_reference() {
    use mamba2_wgpu::gpu::device_weights::DeviceMixer;
    for (pattern, config) in [
        ("nemotron ME*E", wide_moe("ME*E", false)),
        ("granite MEME*E", wide_moe("MEME*E", true)),
        ("latent ME*E", wide_latent_moe("ME*E")),
    ] {
        let model = Model::synthetic(config, 17);
        let toks = tokens(40, 6, model.config.vocab_size);
        for format in [
            WeightFormat::Q4_0,
            WeightFormat::Q4_1,
            WeightFormat::Q5_0,
            WeightFormat::Q5_1,
            WeightFormat::Q4_K,
            WeightFormat::Q5_K,
            WeightFormat::Q6_K,
        ] {
            let rounded = latent_in_f16(&common::rounded(&model, |k| format.for_cols(k)));
            let cpu = CpuModel::<f32>::new(&rounded.config, &rounded.weights).unwrap();
            let want = cpu
                .forward(&mut cpu.new_state(), &toks, Scan::Chunked(16), Logits::All)
                .unwrap();
            // Prefill multiplies the same dequantized weights in f32; decode rounds the
            // activations to 8 bits (near-tie routing flips judged as in the q8_0 test).
            for (prefill, tol) in [(PrefillMode::Chunked, 1e-8), (PrefillMode::Decode, 3e-3)] {
                let what = format!("{pattern} {format:?} {prefill:?}");
                let Some(mut gpu) = backend(&model, format, true, prefill, None) else {
                    return;
                };
                let moe = model
                    .config
                    .blocks
                    .iter()
                    .position(|b| *b == mamba2_wgpu::config::BlockKind::Moe);
                let DeviceMixer::Moe(m) = &gpu.engine.weights.layers[moe.unwrap()].mixer else {
                    panic!("{what}: not an MoE layer");
                };
                for bank in m.up.iter().flatten().chain(&m.down) {
                    assert_eq!(bank.format, format, "{what}: {}", bank.name);
                }
                let got = gpu.prefill_logits(&toks).unwrap();
                let (median, p80) = typical_nmse(&got, &want);
                eprintln!("{what}: median logits NMSE {median:e}, 80th percentile {p80:e}");
                assert!(median <= tol, "{what}: median logits NMSE {median:e}");
                assert!(p80 <= 10.0 * tol, "{what}: 80th percentile NMSE {p80:e}");
            }
        }
    }
}

#[test]
fn expert_load_counts_what_transformers_routed() {
    // The oracle routed the prompt and the greedy continuation but the last token: feed the
    // same 60 tokens and count the choices of each MoE layer.
    for name in ["nemotron_h_moe", "granite_moe_hybrid"] {
        let dir = common::fixture(name);
        let model = Model::load(&dir).unwrap();
        let bytes = std::fs::read(dir.join("oracle.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let fed: Vec<u32> = st
            .tensor("moe_tokens")
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect();
        for prefill in [PrefillMode::Chunked, PrefillMode::Decode] {
            let Some(mut gpu) = backend(&model, WeightFormat::F32, true, prefill, None) else {
                return;
            };
            gpu.prefill_logits(&fed).unwrap();
            let counts = gpu.engine.expert_counts().unwrap();
            let routing = oracle_routing(name);
            assert_eq!(counts.len(), routing.len());
            for (got, (layer, _, ids)) in counts.iter().zip(&routing) {
                let mut want: BTreeMap<u32, u32> = BTreeMap::new();
                for &id in ids.iter().flatten() {
                    *want.entry(id).or_default() += 1;
                }
                let want: Vec<u32> = (0..got.len() as u32)
                    .map(|e| want.get(&e).copied().unwrap_or(0))
                    .collect();
                assert_eq!(got, &want, "{name} {prefill:?}: layer {layer} expert load");
            }
            gpu.engine.reset_expert_counts();
            let zero = gpu.engine.expert_counts().unwrap();
            assert!(
                zero.iter().flatten().all(|&c| c == 0),
                "reset clears the counters"
            );
        }
    }
}

#[test]
fn moe_chat_turns_and_snapshots_match_the_cpu() {
    use mamba2_wgpu::{CpuBackend, GenerateOptions, Session};
    for (pattern, config) in models() {
        let model = Model::synthetic(config, 8);
        let vocab = model.config.vocab_size;
        let greedy = |n| GenerateOptions {
            max_new_tokens: n,
            ..Default::default()
        };
        let (a, b) = (tokens(40, 1, vocab), tokens(23, 2, vocab));
        let mut cpu = Session::new(Box::new(CpuBackend::new(
            CpuModel::<f32>::new(&model.config, &model.weights).unwrap(),
        )));
        let Some(be) = backend(
            &model,
            WeightFormat::F32,
            true,
            PrefillMode::Chunked,
            Some(2048),
        ) else {
            return;
        };
        let mut gpu = Session::new(Box::new(be));
        // Two turns: state and KV carried, only the new tokens fed.
        for turn in [&a, &b] {
            let (c, _) = cpu.generate(turn, &greedy(10), |_| true).unwrap();
            let (g, _) = gpu.generate(turn, &greedy(10), |_| true).unwrap();
            assert_eq!(g, c, "{pattern}: greedy ids of a turn");
        }
        // Snapshot, go on, restore, go on again: the same tokens.
        let snap = gpu.snapshot().unwrap();
        let (x1, _) = gpu.generate(&a[..5], &greedy(8), |_| true).unwrap();
        gpu.restore(&snap).unwrap();
        let (x2, _) = gpu.generate(&a[..5], &greedy(8), |_| true).unwrap();
        assert_eq!(
            x1, x2,
            "{pattern}: a restored snapshot continues as the original"
        );
    }
}

/// Fused q8_0 decode in which every Mamba2 block after an MoE block takes its pre-norm from
/// the experts' last down pass (`expert_gemv::NormTail`: no norm dispatch; in_proj applies
/// the 1/rms from the per-block sums), Nemotron-H's router and relu² experts with the
/// shared expert as expert slices (as Nemotron 3 Nano's), in one bank and in several:
/// against the CPU reference as the other q8_0 tests judge it.
#[test]
fn moe_down_pass_makes_the_next_mamba2_pre_norm() {
    let mut config = tiny_moe("MEMEM*EM", false);
    if let Some(m) = config.moe.as_mut() {
        m.shared.as_mut().unwrap().intermediate = 2 * m.intermediate;
    }
    let model = Model::synthetic(config, 29);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let toks = tokens(90, 7, model.config.vocab_size);
    let want = cpu
        .forward(&mut cpu.new_state(), &toks, Scan::Chunked(16), Logits::All)
        .unwrap();
    for bank in [None, Some(4096)] {
        let what = format!("bank={bank:?}");
        let Some(mut gpu) = backend(&model, WeightFormat::Q8_0, true, PrefillMode::Decode, bank)
        else {
            return;
        };
        let graph = gpu.engine.graph(mamba2_wgpu::gpu::graph::Tail::Greedy);
        let names: Vec<&str> = graph.dispatches.iter().map(|d| d.kernel()).collect();
        let tails = names.iter().filter(|n| n.ends_with("+next_norm")).count();
        let takers = names
            .iter()
            .filter(|n| n.starts_with("rms+in_proj"))
            .count();
        assert_eq!((tails, takers), (3, 3), "{what}: {names:?}");
        let got = gpu.prefill_logits(&toks).unwrap();
        let (median, p80) = typical_nmse(&got, &want);
        assert!(median <= 3e-3, "{what}: median logits NMSE {median:e}");
        assert!(p80 <= 3e-2, "{what}: 80th percentile NMSE {p80:e}");
    }
}

/// A prefill block whose expert rows need more than the adapter binds: 64 experts of 2048
/// rows, 8 chosen per token, make a 2048-token block's up-projection rows ~168 MB (lavapipe
/// binds 128 MiB), though the weights fit. The block shrinks until every buffer fits; the
/// logits still match the CPU reference. (It once failed binding the oversized buffer.)
#[test]
fn moe_prefill_block_fits_the_binding_limit() {
    let mut config = tiny_moe("ME", false);
    if let Some(m) = config.moe.as_mut() {
        m.experts = 64;
        m.top_k = 8;
        m.intermediate = 2048;
    }
    let model = Model::synthetic(config, 12);
    let toks = tokens(40, 6, model.config.vocab_size);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let want = cpu
        .forward(&mut cpu.new_state(), &toks, Scan::Sequential, Logits::All)
        .unwrap();
    let Some(mut gpu) = backend(&model, WeightFormat::F32, true, PrefillMode::Chunked, None) else {
        return;
    };
    // Chunks of 64: a block of 32 chunks, the 2048-token MoE block's whole size.
    gpu.engine.chunk = 64;
    let max_binding = gpu.engine.ctx().limits.max_storage_buffer_binding_size;
    let block = Prefill::new(&gpu.engine, 64, false).unwrap().max_tokens;
    let up_rows_bytes = 4 * 2048 * sorted_rows(2048, 8, 64) as u64;
    if max_binding < up_rows_bytes {
        assert!(
            block < 2048,
            "a block of {block} tokens under a {max_binding}-byte limit"
        );
    } else {
        eprintln!("the adapter binds {max_binding} bytes: the 2048-token block fits as it is");
    }
    let got = gpu.prefill_logits(&toks).unwrap();
    let e = common::nmse(&got.concat(), &want.concat());
    assert!(e <= 1e-8, "logits NMSE {e:e} (binding limit {max_binding})");
}
