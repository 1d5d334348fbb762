//! Batched decode (lavapipe in CI): sequences in the slots of one batch, joining and
//! leaving mid-way, greedy and seeded sampling side by side, must give every sequence the
//! logits and tokens it gets alone — bitwise, at every step and lane count — on the pure
//! Mamba2 fixture in every weight format, the hybrid in f32 and q8_0 (and with its q, k
//! and v in three block types) and MoE hybrids (Nemotron-H, latent too, and Granite), with
//! more lanes than one workgroup sums (two rows of workgroups), and beside a lane whose
//! context needs a wider attention tile. A sequence that leaves hands back exactly the
//! state of the same tokens fed alone.

mod common;

use mamba2_wgpu::config::ModelConfig;
use mamba2_wgpu::gpu::GpuBackend;
use mamba2_wgpu::gpu::engine::{Engine, EngineOptions, PrefillMode};
use mamba2_wgpu::gpu::state_store::KvFormat;
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::quant::WeightFormat;
use mamba2_wgpu::model::synthetic::{tiny_config, tiny_hybrid, tiny_moe};
use mamba2_wgpu::sampling::{Sampling, uniform};
use mamba2_wgpu::session::Backend;

/// One case: a model and a weight format.
struct Case {
    name: &'static str,
    model: fn() -> Model,
    format: WeightFormat,
}

const CASES: &[Case] = &[
    Case {
        name: "mamba2 f32",
        model: || Model::synthetic(tiny_config(2, 16), 3),
        format: WeightFormat::F32,
    },
    Case {
        name: "mamba2 q8_0",
        model: || Model::synthetic(tiny_config(2, 16), 3),
        format: WeightFormat::Q8_0,
    },
    Case {
        name: "mamba2 f16",
        model: || Model::synthetic(tiny_config(2, 16), 4),
        format: WeightFormat::F16,
    },
    Case {
        name: "mamba2 bf16",
        model: || Model::synthetic(tiny_config(2, 16), 5),
        format: WeightFormat::BF16,
    },
    Case {
        name: "mamba2 q4_0",
        model: || Model::synthetic(tiny_config(2, 16), 6),
        format: WeightFormat::Q4_0,
    },
    Case {
        name: "mamba2 q5_0",
        model: || Model::synthetic(tiny_config(2, 16), 10),
        format: WeightFormat::Q5_0,
    },
    Case {
        name: "mamba2 q4_1",
        model: || Model::synthetic(tiny_config(2, 16), 13),
        format: WeightFormat::Q4_1,
    },
    Case {
        name: "mamba2 q5_1",
        model: || Model::synthetic(tiny_config(2, 16), 14),
        format: WeightFormat::Q5_1,
    },
    Case {
        name: "mamba2 q4_k",
        model: || Model::synthetic(tiny_config(2, 16), 7),
        format: WeightFormat::Q4_K,
    },
    Case {
        name: "mamba2 q5_k",
        model: || Model::synthetic(tiny_config(2, 16), 8),
        format: WeightFormat::Q5_K,
    },
    Case {
        name: "mamba2 q6_k",
        model: || Model::synthetic(tiny_config(2, 16), 9),
        format: WeightFormat::Q6_K,
    },
    // State rows wider than the batched SSD step's team of lanes (the released models'
    // N = 128, and N = 48, whose last vectors leave lanes idle): the batch replays the
    // one-token team's butterfly.
    Case {
        name: "mamba2 q8_0, N = 128",
        model: || Model::synthetic(wide_state(128), 10),
        format: WeightFormat::Q8_0,
    },
    Case {
        name: "mamba2 f32, N = 48",
        model: || Model::synthetic(wide_state(48), 11),
        format: WeightFormat::F32,
    },
    Case {
        name: "hybrid f32",
        model: || Model::synthetic(tiny_hybrid("M*-M*-", 2), 8),
        format: WeightFormat::F32,
    },
    Case {
        name: "hybrid q8_0",
        model: || Model::synthetic(tiny_hybrid("*M-*M", 1), 9),
        format: WeightFormat::Q8_0,
    },
    // q, k and v stored in three block types (a GGUF's mixed quantization): one GEMV per
    // part into its rows of each lane's projection.
    Case {
        name: "hybrid q8_0, q/k/v in q5_1/q4_0/q8_0 blocks",
        model: || {
            let m = Model::synthetic(tiny_hybrid("*M-*M", 1), 12);
            let types = [WeightFormat::Q5_1, WeightFormat::Q4_0, WeightFormat::Q8_0];
            common::qkv_in_blocks(&m, types, None)
        },
        format: WeightFormat::Q8_0,
    },
    // MoE blocks: the lanes go through the routing and the expert passes as tokens; in
    // q8_0 the one-token graph folds the routing and relu² into the up pass and makes the
    // next Mamba2 block's pre-norm in the down pass, which the batch must match bit for bit.
    Case {
        name: "nemotron-h moe f32",
        model: || Model::synthetic(tiny_moe("ME*EM-", false), 15),
        format: WeightFormat::F32,
    },
    Case {
        name: "nemotron-h moe q8_0",
        model: || Model::synthetic(tiny_moe("MEME*E", false), 16),
        format: WeightFormat::Q8_0,
    },
    Case {
        name: "granite moe q8_0",
        model: || Model::synthetic(tiny_moe("MEM*E", true), 17),
        format: WeightFormat::Q8_0,
    },
    // f16, the default for a safetensors checkpoint: the experts read the f32 pre-norm.
    Case {
        name: "granite moe f16",
        model: || Model::synthetic(tiny_moe("MEM*E", true), 18),
        format: WeightFormat::F16,
    },
    // d_model 640: expert rows of 40 q8_0 vectors (80 f16 ones), wide enough that the up
    // pass's team depends on whether it folds relu² (the one-token graph does), and a norm
    // tail of 20 q8 blocks.
    Case {
        name: "nemotron-h moe q8_0, d 640",
        model: || Model::synthetic(wide_moe("MEM*E", false), 20),
        format: WeightFormat::Q8_0,
    },
    Case {
        name: "nemotron-h moe f16, d 640",
        model: || Model::synthetic(wide_moe("ME*EM", false), 21),
        format: WeightFormat::F16,
    },
    Case {
        name: "granite moe q8_0, d 640",
        model: || Model::synthetic(wide_moe("MEM*E", true), 22),
        format: WeightFormat::Q8_0,
    },
    // Latent MoE (the nemotron_h_latent fixture, L = 32; and L = 20, rows padded to 32):
    // fc1 and fc2 over the lanes, the experts over latent rows a lane width apart.
    Case {
        name: "nemotron-h latent moe fixture f32",
        model: || Model::load(&common::fixture("nemotron_h_latent")).unwrap(),
        format: WeightFormat::F32,
    },
    Case {
        name: "nemotron-h latent moe f16, L = 20",
        model: || Model::synthetic(latent_moe(20), 23),
        format: WeightFormat::F16,
    },
    Case {
        name: "nemotron-h latent moe q8_0, L = 20",
        model: || Model::synthetic(latent_moe(20), 24),
        format: WeightFormat::Q8_0,
    },
    // The Nemotron-H MoE fixture: an MLP layer wider than the shared expert, so a lane's
    // rows of the up projection's output lie further apart than the shared expert's width.
    Case {
        name: "nemotron-h moe fixture f16",
        model: || Model::load(&common::fixture("nemotron_h_moe")).unwrap(),
        format: WeightFormat::F16,
    },
    Case {
        name: "nemotron-h moe f16",
        model: || Model::synthetic(tiny_moe("ME*EM-", false), 19),
        format: WeightFormat::F16,
    },
];

/// The tiny Nemotron-H MoE with a latent of `l` values around its routed experts.
fn latent_moe(l: usize) -> ModelConfig {
    let mut c = tiny_moe("MEM*E", false);
    c.moe.as_mut().unwrap().latent = Some(l);
    c
}

/// `tiny_moe(pattern, granite)` at d_model 640 (Mamba2 heads of 160 channels).
fn wide_moe(pattern: &str, granite: bool) -> ModelConfig {
    let mut c = tiny_moe(pattern, granite);
    c.head_dim = 160;
    c.d_inner = c.n_heads * c.head_dim;
    c.d_model = c.d_inner / 2;
    c
}

/// The tiny Mamba2 config with `d_state` state columns.
fn wide_state(d_state: usize) -> ModelConfig {
    ModelConfig {
        d_state,
        ..tiny_config(2, 16)
    }
}

/// A request: prompt length, tokens to sample, how, and the step it joins at.
struct Req {
    prompt: usize,
    new: usize,
    sampling: Sampling,
    joins: usize,
}

fn sampled(seed: u64, temperature: f32, top_k: usize, top_p: f32) -> Sampling {
    Sampling {
        temperature,
        top_k,
        top_p,
        seed,
    }
}

/// The requests of the batched table. With `SLOTS` slots they take every lane count from 1
/// to 8 and back: one joins per step up to 8 live lanes, the next two wait for free slots
/// (the first takes the one request 1 frees, below live ones), and they leave in turn.
fn requests() -> Vec<Req> {
    let r = |prompt, new, sampling, joins| Req {
        prompt,
        new,
        sampling,
        joins,
    };
    vec![
        r(5, 16, Sampling::greedy(), 0),
        r(23, 8, sampled(7, 0.8, 0, 1.0), 1),
        r(1, 12, sampled(11, 1.2, 5, 0.9), 2),
        r(40, 7, Sampling::greedy(), 3),
        r(3, 11, sampled(5, 1.0, 3, 1.0), 4),
        r(31, 10, sampled(13, 0.9, 0, 0.95), 5),
        r(12, 4, Sampling::greedy(), 6),
        r(2, 9, sampled(17, 1.1, 8, 0.85), 7),
        r(17, 6, sampled(3, 0.7, 0, 0.8), 7),
        r(9, 3, Sampling::greedy(), 8),
    ]
}

/// Slots of the batched table.
const SLOTS: usize = 8;

fn prompt(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (uniform(seed, i) * vocab as f32) as u32)
        .collect()
}

fn backend(model: &Model, format: WeightFormat) -> Option<GpuBackend> {
    backend_banks(model, format, None)
}

/// `backend` with MoE expert banks of at most `bank_bytes` bytes.
fn backend_banks(
    model: &Model,
    format: WeightFormat,
    bank_bytes: Option<u64>,
) -> Option<GpuBackend> {
    let ctx = common::gpu(&Engine::needs(&model.config, format))?;
    let opts = EngineOptions {
        format,
        fused: true,
        chunk_size: Some(16),
        prefill: PrefillMode::Chunked,
        context: Some(256),
        kv: KvFormat::F16,
        expert_bank_bytes: bank_bytes,
    };
    Some(GpuBackend::new(Engine::new(ctx, model, opts).unwrap()).unwrap())
}

/// A request alone: its tokens and the logits of every decode step.
fn solo(be: &mut GpuBackend, p: &[u32], req: &Req) -> (Vec<u32>, Vec<Vec<f32>>) {
    be.reset().unwrap();
    let mut t = be.prefill_sample(p, &req.sampling, p.len() as u64).unwrap();
    let (mut tokens, mut logits) = (vec![t], Vec::new());
    for i in 0..req.new {
        let pos = (p.len() + 1 + i) as u64;
        let mut next = None;
        be.decode(t, pos, 1, &req.sampling, &[], &mut |x| {
            next = Some(x);
            true
        })
        .unwrap();
        logits.push(be.engine.read_logits().unwrap());
        t = next.unwrap();
        tokens.push(t);
    }
    (tokens, logits)
}

#[test]
fn batched_decode_equals_each_sequence_alone() {
    for case in CASES {
        let model = (case.model)();
        let vocab = model.config.vocab_size;
        let Some(mut be) = backend(&model, case.format) else {
            return;
        };
        let reqs = requests();
        let prompts: Vec<Vec<u32>> = (0..reqs.len())
            .map(|i| prompt(reqs[i].prompt, 100 + i as u64, vocab))
            .collect();
        let want: Vec<_> = reqs
            .iter()
            .zip(&prompts)
            .map(|(r, p)| solo(&mut be, p, r))
            .collect();
        be.enable_batch(SLOTS).unwrap();
        // slot → (request, steps done); tokens per request.
        let mut slots: Vec<Option<(usize, usize)>> = vec![None; SLOTS];
        let mut lane_counts = std::collections::BTreeSet::new();
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); reqs.len()];
        let mut step = 0;
        let mut next = 0;
        while next < reqs.len() || slots.iter().any(Option::is_some) {
            // Join whoever is due (a free slot each).
            while next < reqs.len() && reqs[next].joins <= step {
                let Some(slot) = slots.iter().position(Option::is_none) else {
                    break;
                };
                let (r, p) = (&reqs[next], &prompts[next]);
                be.reset().unwrap();
                let first = be.prefill_sample(p, &r.sampling, p.len() as u64).unwrap();
                got[next].push(first);
                let batch = be.batch.as_mut().unwrap();
                batch
                    .join(
                        &be.engine,
                        slot,
                        first,
                        p.len() as u64 + 1,
                        &r.sampling,
                        &[],
                    )
                    .unwrap();
                slots[slot] = Some((next, 0));
                next += 1;
            }
            let lanes = slots.iter().filter(|s| s.is_some()).count();
            let batch = be.batch.as_mut().unwrap();
            lane_counts.insert(lanes);
            let mut seen = [None; SLOTS];
            batch
                .step(&be.engine, 1, &mut |slot, c| {
                    assert_eq!(c.nonfinite, 0, "{}: non-finite logits", case.name);
                    seen[slot] = Some(c.token);
                    true
                })
                .unwrap();
            for slot in 0..SLOTS {
                let Some((r, done)) = slots[slot] else {
                    assert!(seen[slot].is_none(), "a free slot sampled");
                    continue;
                };
                let token = seen[slot].expect("every live lane samples once per step");
                let logits = batch.logits(&be.engine, slot).unwrap();
                assert!(
                    common::bits(&logits) == common::bits(&want[r].1[done]),
                    "{}: request {r} step {done} (slot {slot}, {lanes} live lanes): logits \
                     differ from its run alone",
                    case.name
                );
                got[r].push(token);
                slots[slot] = Some((r, done + 1));
                if done + 1 == reqs[r].new {
                    batch.leave(&mut be.engine, slot, false).unwrap();
                    slots[slot] = None;
                }
            }
            step += 1;
        }
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, &w.0, "{}: request {r}'s tokens", case.name);
        }
        assert!(
            lane_counts.iter().copied().eq(1..=SLOTS),
            "{}: lane counts {lane_counts:?}, not every one of 1..={SLOTS}",
            case.name
        );
    }
}

#[test]
fn pipelined_steps_and_a_lane_stopped_early_hand_back_the_exact_state() {
    let model = Model::synthetic(tiny_hybrid("M*-M*-", 2), 8);
    let vocab = model.config.vocab_size;
    let Some(mut be) = backend(&model, WeightFormat::F32) else {
        return;
    };
    let reqs: Vec<Req> = requests().into_iter().take(3).collect();
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| prompt(reqs[i].prompt, 200 + i as u64, vocab))
        .collect();
    be.enable_batch(3).unwrap();
    let mut firsts = Vec::new();
    for (slot, (r, p)) in reqs.iter().zip(&prompts).enumerate() {
        be.reset().unwrap();
        let first = be.prefill_sample(p, &r.sampling, p.len() as u64).unwrap();
        firsts.push(first);
        let batch = be.batch.as_mut().unwrap();
        batch
            .join(
                &be.engine,
                slot,
                first,
                p.len() as u64 + 1,
                &r.sampling,
                &[],
            )
            .unwrap();
    }
    // Lane 1 is stopped by the host after 2 tokens; the steps in flight still feed it.
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let batch = be.batch.as_mut().unwrap();
    batch
        .step(&be.engine, 10, &mut |slot, c| {
            got[slot].push(c.token);
            !(slot == 1 && got[slot].len() >= 2)
        })
        .unwrap();
    assert!(got[1].len() >= 2, "lane 1 sampled {} tokens", got[1].len());
    assert_eq!(got[0].len(), 10);
    // Each lane's tokens equal its run alone; lane 1's state holds every token it fed.
    for slot in 0..3 {
        let (r, p) = (&reqs[slot], &prompts[slot]);
        be.reset().unwrap();
        let first = be.prefill_sample(p, &r.sampling, p.len() as u64).unwrap();
        assert_eq!(first, firsts[slot]);
        let mut alone = Vec::new();
        let n = got[slot].len();
        be.decode(first, p.len() as u64 + 1, n, &r.sampling, &[], &mut |t| {
            alone.push(t);
            true
        })
        .unwrap();
        assert_eq!(alone, got[slot], "lane {slot}'s tokens");
        let solo_state = be.engine.read_state().unwrap();
        let batch = be.batch.as_mut().unwrap();
        batch.leave(&mut be.engine, slot, true).unwrap();
        let state = be.engine.read_state().unwrap();
        assert_eq!(state.len, solo_state.len, "lane {slot}'s length");
        assert!(
            state == solo_state,
            "lane {slot}'s state handed back differs from the same tokens fed alone"
        );
    }
}

#[test]
fn more_lanes_than_a_workgroup_sums_stay_exact() {
    // 19 lanes: two lane groups of 16, one after the other; 40: three, side by side
    // (`gemv::side_by_side`).
    for lanes in [19, 40] {
        more_lanes_exact(Model::synthetic(tiny_config(2, 16), 12), lanes);
    }
    // MoE blocks over more lanes than the KV rows in use (prompts of 1…5 tokens): every
    // lane is routed and goes through the experts.
    more_lanes_exact(Model::synthetic(tiny_moe("MEM*E", true), 13), 19);
}

/// A latent MoE whose experts sit in banks of 4 (of 12): the first bank stores each lane's
/// latent sum at the lane stride, the others add to it.
#[test]
fn latent_experts_in_several_banks_stay_exact() {
    use mamba2_wgpu::gpu::device_weights::DeviceMixer;
    let model = Model::synthetic(latent_moe(20), 25);
    let vocab = model.config.vocab_size;
    // (Sized for q8_0: an expert's up [24, 20] and down [20, 24], a 32-value block a row.)
    let per_expert = WeightFormat::Q8_0.data_bytes(24, 20) as u64;
    let Some(mut be) = backend_banks(&model, WeightFormat::Q8_0, Some(4 * per_expert)) else {
        return;
    };
    let banks: Vec<usize> = be
        .engine
        .weights
        .layers
        .iter()
        .filter_map(|l| match &l.mixer {
            DeviceMixer::Moe(m) => Some(m.banks().count()),
            _ => None,
        })
        .collect();
    assert!(
        banks.iter().all(|&n| n == 3),
        "banks per MoE layer: {banks:?}"
    );
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|lane| prompt(2 + 3 * lane, 400 + lane as u64, vocab))
        .collect();
    greedy_lanes_equal_alone(&mut be, &prompts, 6);
}

fn more_lanes_exact(model: Model, lanes: usize) {
    let vocab = model.config.vocab_size;
    let Some(mut be) = backend(&model, WeightFormat::Q8_0) else {
        return;
    };
    let prompts: Vec<Vec<u32>> = (0..lanes)
        .map(|lane| prompt(1 + lane % 5, 300 + lane as u64, vocab))
        .collect();
    greedy_lanes_equal_alone(&mut be, &prompts, 3);
}

/// Each prompt alone (greedy, `new` tokens), then all of them as the lanes of one batch:
/// every lane's logits at every step and its tokens equal its run alone's.
fn greedy_lanes_equal_alone(be: &mut GpuBackend, prompts: &[Vec<u32>], new: usize) {
    let greedy = Sampling::greedy();
    let alone: Vec<_> = prompts
        .iter()
        .map(|p| {
            let req = Req {
                prompt: p.len(),
                new,
                sampling: greedy,
                joins: 0,
            };
            solo(be, p, &req)
        })
        .collect();
    be.enable_batch(prompts.len()).unwrap();
    let mut got: Vec<Vec<u32>> = Vec::new();
    for (lane, p) in prompts.iter().enumerate() {
        be.reset().unwrap();
        let first = be.prefill_sample(p, &greedy, p.len() as u64).unwrap();
        got.push(vec![first]);
        let batch = be.batch.as_mut().unwrap();
        batch
            .join(&be.engine, lane, first, p.len() as u64 + 1, &greedy, &[])
            .unwrap();
    }
    let batch = be.batch.as_mut().unwrap();
    for step in 0..new {
        batch
            .step(&be.engine, 1, &mut |lane, c| {
                got[lane].push(c.token);
                true
            })
            .unwrap();
        for (lane, (_, logits)) in alone.iter().enumerate() {
            let l = batch.logits(&be.engine, lane).unwrap();
            assert!(
                common::bits(&l) == common::bits(&logits[step]),
                "lane {lane} ({} prompt tokens) step {step}: logits differ from its run alone",
                prompts[lane].len()
            );
        }
    }
    for (lane, (tokens, _)) in alone.iter().enumerate() {
        assert_eq!(&got[lane], tokens, "lane {lane}");
    }
}

/// A lane batched with a lane whose context needs a wider attention tile runs that tile
/// (a batch records the one its longest lane needs) and must still equal its run alone: a
/// hybrid whose kv head serves 8 query heads (the narrowest tile takes 4 of them, the wider
/// ones 8) with room for 16384 rows, one lane past 8192 rows (the narrowest tile's most at
/// that capacity), one of 100 (segments of 32 keys: more than the 16 partial sums a row
/// of the wide tiles takes, so a per-tile share of those sums would add them in another
/// order: with a share per tile this test failed on lavapipe).
#[test]
fn a_short_lane_beside_a_long_one_keeps_its_bits() {
    let mut config = tiny_hybrid("M*M", 1);
    if let Some(a) = config.attention.as_mut() {
        a.heads = 8;
    }
    let model = Model::synthetic(config, 21);
    let vocab = model.config.vocab_size;
    let Some(ctx) = common::gpu(&Engine::needs(&model.config, WeightFormat::F32)) else {
        return;
    };
    let opts = EngineOptions {
        format: WeightFormat::F32,
        fused: true,
        chunk_size: Some(64),
        prefill: PrefillMode::Chunked,
        context: Some(16384),
        kv: KvFormat::F16,
        expert_bank_bytes: None,
    };
    let mut be = GpuBackend::new(Engine::new(ctx, &model, opts).unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = [8300, 100]
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(n, 500 + i as u64, vocab))
        .collect();
    greedy_lanes_equal_alone(&mut be, &prompts, 3);
}

#[test]
fn models_a_batch_cannot_run_are_refused_by_name() {
    // Groups of 48 channels: q8_0's fused graph scales groups of 32 at once.
    let model = Model::synthetic(tiny_config(2, 12), 3);
    let Some(mut be) = backend(&model, WeightFormat::Q8_0) else {
        return;
    };
    let e = be.enable_batch(4).unwrap_err().to_string();
    assert!(e.contains("fused Mamba2 graph") && e.contains("48"), "{e}");
    // An engine running the unfused graph: a batch (the fused graph) would not equal it.
    let model = Model::synthetic(tiny_config(2, 16), 3);
    let Some(ctx) = common::gpu(&Engine::needs(&model.config, WeightFormat::F32)) else {
        return;
    };
    let opts = EngineOptions {
        format: WeightFormat::F32,
        fused: false,
        ..Default::default()
    };
    let mut be = GpuBackend::new(Engine::new(ctx, &model, opts).unwrap()).unwrap();
    let e = be.enable_batch(4).unwrap_err().to_string();
    assert!(e.contains("unfused") && e.contains("--no-fuse"), "{e}");
    let model = Model::synthetic(tiny_config(2, 16), 3);
    let Some(mut be) = backend(&model, WeightFormat::F32) else {
        return;
    };
    let e = be.enable_batch(1).unwrap_err().to_string();
    assert!(e.contains("2…256"), "{e}");
}
