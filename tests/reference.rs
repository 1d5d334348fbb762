//! The CPU reference against itself: the chunked SSD equals the sequential scan (kernel
//! level and whole model, pure Mamba2 and hybrids with attention and MLP blocks), and
//! prefill followed by decode equals token-by-token decode.

use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::synthetic::{tiny_config, tiny_hybrid};
use mamba2_wgpu::reference::{
    CpuModel, Logits, Real, Scan, ScanDims, ScanInputs, scan_chunked, scan_sequential,
};
use mamba2_wgpu::sampling::uniform;

/// max |a − b| / max |b|
fn rel_err<A: Real, B: Real>(a: &[A], b: &[B]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x.f64() - y.f64()).abs())
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.f64().abs()).fold(0.0, f64::max);
    diff / scale.max(1e-30)
}

fn rand_vec<T: Real>(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<T> {
    (0..n as u64)
        .map(|i| T::of(lo + (hi - lo) * uniform(seed, i) as f64))
        .collect()
}

struct ScanCase<T> {
    dims: ScanDims,
    x: Vec<T>,
    dt: Vec<T>,
    a: Vec<T>,
    b: Vec<T>,
    c: Vec<T>,
    d: Vec<T>,
    state: Vec<T>,
}

impl<T: Real> ScanCase<T> {
    fn new(len: usize, dims: ScanDims, seed: u64) -> Self {
        let ScanDims {
            heads,
            head_dim,
            groups,
            d_state,
        } = dims;
        ScanCase {
            dims,
            x: rand_vec(seed, len * heads * head_dim, -1.0, 1.0),
            dt: rand_vec(seed + 1, len * heads, 0.001, 0.3),
            a: rand_vec(seed + 2, heads, -4.0, -0.5),
            b: rand_vec(seed + 3, len * groups * d_state, -1.0, 1.0),
            c: rand_vec(seed + 4, len * groups * d_state, -1.0, 1.0),
            d: rand_vec(seed + 5, heads, 0.5, 1.5),
            state: rand_vec(seed + 6, dims.state_len(), -2.0, 2.0),
        }
    }

    fn inputs(&self) -> ScanInputs<'_, T> {
        ScanInputs {
            dims: self.dims,
            x: &self.x,
            dt: &self.dt,
            a: &self.a,
            b: &self.b,
            c: &self.c,
            d: &self.d,
        }
    }
}

fn check_chunked_equals_sequential<T: Real>(tol: f64) {
    // G = 2 groups of 2 heads, a head dim that is not a power of two, N = 16.
    let dims = ScanDims {
        heads: 4,
        head_dim: 6,
        groups: 2,
        d_state: 16,
    };
    for q in [8usize, 16, 32, 64, 128, 256] {
        for len in [1, q - 1, q, q + 1, 3 * q + 5] {
            let case = ScanCase::<T>::new(len, dims, (q * 1000 + len) as u64);
            let mut s_seq = case.state.clone();
            let y_seq = scan_sequential(&case.inputs(), &mut s_seq);
            let mut s_chk = case.state.clone();
            let y_chk = scan_chunked(&case.inputs(), &mut s_chk, q);
            let (ey, es) = (rel_err(&y_chk, &y_seq), rel_err(&s_chk, &s_seq));
            assert!(
                ey <= tol && es <= tol,
                "Q={q} L={len}: y rel err {ey:e}, state rel err {es:e} > {tol:e}"
            );
        }
    }
}

#[test]
fn chunked_scan_equals_sequential_f64() {
    check_chunked_equals_sequential::<f64>(1e-10);
}

#[test]
fn chunked_scan_equals_sequential_f32() {
    check_chunked_equals_sequential::<f32>(1e-5);
}

#[test]
fn zero_initial_state_and_strong_decay_are_stable() {
    // Large δ·A gives exp(Λ) far below f64's range inside a chunk: the min(·, 0) guard and
    // the masked tail must not produce NaN or Inf.
    let dims = ScanDims {
        heads: 2,
        head_dim: 3,
        groups: 1,
        d_state: 4,
    };
    let mut case = ScanCase::<f64>::new(300, dims, 9);
    case.dt.iter_mut().for_each(|v| *v *= 400.0);
    case.state.iter_mut().for_each(|v| *v = 0.0);
    let mut s_seq = case.state.clone();
    let y_seq = scan_sequential(&case.inputs(), &mut s_seq);
    let mut s_chk = case.state.clone();
    let y_chk = scan_chunked(&case.inputs(), &mut s_chk, 256);
    assert!(y_chk.iter().all(|v| v.is_finite()));
    assert!(rel_err(&y_chk, &y_seq) <= 1e-10);
}

fn models<T: Real>(groups: usize, head_dim: usize) -> CpuModel<T> {
    let model = Model::synthetic(tiny_config(groups, head_dim), 5);
    CpuModel::new(&model.config, &model.weights).unwrap()
}

/// Tiny Nemotron-H-style hybrids: every block kind, GQA (2 of 4 heads) and MQA (1).
fn hybrids<T: Real>() -> Vec<CpuModel<T>> {
    [("M*-M*-", 2), ("*M-*M", 1)]
        .into_iter()
        .map(|(pattern, kv)| {
            let model = Model::synthetic(tiny_hybrid(pattern, kv), 9);
            CpuModel::new(&model.config, &model.weights).unwrap()
        })
        .collect()
}

fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (uniform(seed, i) * vocab as f32) as u32)
        .collect()
}

fn flat<T: Clone>(v: &[Vec<T>]) -> Vec<T> {
    v.concat()
}

/// From the same non-zero state (a previous turn of 11 tokens), `len` tokens through the
/// chunked SSD with chunks of `q` give the sequential scan's logits and state to 1e-10.
fn model_chunked_equals_sequential(m: &CpuModel<f64>, what: &str, q: usize, len: usize) {
    let vocab = m.config.vocab_size;
    let toks = tokens(len, len as u64, vocab);
    let mut warm = m.new_state();
    m.forward(
        &mut warm,
        &tokens(11, 99, vocab),
        Scan::Sequential,
        Logits::None,
    )
    .unwrap();
    let mut s_seq = warm.clone();
    let l_seq = m
        .forward(&mut s_seq, &toks, Scan::Sequential, Logits::All)
        .unwrap();
    let mut s_chk = warm.clone();
    let l_chk = m
        .forward(&mut s_chk, &toks, Scan::Chunked(q), Logits::All)
        .unwrap();
    let e = rel_err(&flat(&l_chk), &flat(&l_seq));
    assert!(e <= 1e-10, "{what} Q={q} L={len}: logits rel err {e:e}");
    assert_eq!(s_chk.len, 11 + len, "{what}: tokens in the state");
    let e = rel_err(&s_chk.values(), &s_seq.values());
    assert!(e <= 1e-10, "{what} Q={q} L={len}: state rel err {e:e}");
}

#[test]
fn model_chunked_prefill_equals_sequential() {
    for (groups, head_dim) in [(1, 8), (2, 6)] {
        let m = models::<f64>(groups, head_dim);
        for q in [8, 16, 32] {
            for len in [1, q - 1, q, q + 1, 3 * q + 5] {
                model_chunked_equals_sequential(&m, &format!("G={groups}"), q, len);
            }
        }
    }
}

#[test]
fn hybrid_chunked_prefill_equals_sequential() {
    for m in hybrids::<f64>() {
        for q in [8, 16, 64] {
            for len in [1, q - 1, q + 1, 2 * q + 3] {
                model_chunked_equals_sequential(&m, &m.config.pattern(), q, len);
            }
        }
    }
}

#[test]
fn hybrid_prompt_split_over_calls_equals_one_call() {
    for m in hybrids::<f64>() {
        let toks = tokens(41, 17, m.config.vocab_size);
        let mut whole = m.new_state();
        let l_whole = m
            .forward(&mut whole, &toks, Scan::Chunked(16), Logits::All)
            .unwrap();
        let mut parts = m.new_state();
        let mut l_parts = Vec::new();
        for piece in [&toks[..5], &toks[5..22], &toks[22..23], &toks[23..]] {
            l_parts.extend(
                m.forward(&mut parts, piece, Scan::Chunked(16), Logits::All)
                    .unwrap(),
            );
        }
        let e = rel_err(&flat(&l_parts), &flat(&l_whole));
        assert!(e <= 1e-10, "{}: logits rel err {e:e}", m.config.pattern());
        assert_eq!(parts.values().len(), whole.values().len());
    }
}

#[test]
fn hybrid_f32_tracks_f64_and_the_context_is_enforced() {
    let m64 = hybrids::<f64>().remove(0);
    let m32 = hybrids::<f32>().remove(0);
    let toks = tokens(40, 8, m64.config.vocab_size);
    let l64 = m64
        .forward(&mut m64.new_state(), &toks, Scan::Chunked(16), Logits::All)
        .unwrap();
    let l32 = m32
        .forward(&mut m32.new_state(), &toks, Scan::Chunked(16), Logits::All)
        .unwrap();
    let e = rel_err(&flat(&l32), &flat(&l64));
    assert!(e <= 1e-5, "f32 vs f64 logits rel err {e:e}");
    let small = hybrids::<f32>().remove(0).with_context(40);
    let mut st = small.new_state();
    small
        .forward(&mut st, &toks[..39], Scan::Chunked(16), Logits::None)
        .unwrap();
    let err = small
        .forward(&mut st, &toks[..2], Scan::Sequential, Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the context is full: 39 tokens so far + 2 new exceed the 40-token context"),
        "{err}"
    );
    assert_eq!(st.len, 39, "a refused step leaves the state alone");
}

#[test]
fn prefill_then_decode_equals_token_by_token() {
    let m = models::<f32>(2, 6);
    let vocab = m.config.vocab_size;
    let all = tokens(45, 3, vocab);
    let (prompt, rest) = all.split_at(37);
    // Token by token from zero.
    let mut s1 = m.new_state();
    let mut one_by_one = Vec::new();
    for &t in &all {
        one_by_one.extend(
            m.forward(&mut s1, &[t], Scan::Sequential, Logits::Last)
                .unwrap(),
        );
    }
    // Chunked prefill of the prompt, then decode the rest (teacher forced).
    let mut s2 = m.new_state();
    let mut prefilled = m
        .forward(&mut s2, prompt, Scan::Chunked(16), Logits::All)
        .unwrap();
    for &t in rest {
        prefilled.extend(
            m.forward(&mut s2, &[t], Scan::Sequential, Logits::Last)
                .unwrap(),
        );
    }
    let e = rel_err(&flat(&prefilled), &flat(&one_by_one));
    assert!(e <= 1e-5, "logits rel err {e:e}");
    let e = rel_err(&s2.values(), &s1.values());
    assert!(e <= 1e-5, "state rel err {e:e}");
}

#[test]
fn f32_reference_tracks_f64() {
    let m64 = models::<f64>(2, 6);
    let m32 = models::<f32>(2, 6);
    let toks = tokens(40, 8, m64.config.vocab_size);
    let l64 = m64
        .forward(&mut m64.new_state(), &toks, Scan::Chunked(16), Logits::All)
        .unwrap();
    let l32 = m32
        .forward(&mut m32.new_state(), &toks, Scan::Chunked(16), Logits::All)
        .unwrap();
    let e = rel_err(&flat(&l32), &flat(&l64));
    assert!(e <= 1e-5, "f32 vs f64 logits rel err {e:e}");
}

#[test]
fn bad_token_id_is_an_error() {
    let m = models::<f32>(1, 8);
    let err = m
        .forward(
            &mut m.new_state(),
            &[3, 500],
            Scan::Sequential,
            Logits::Last,
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid input: token id 500 is outside the vocabulary (size 77)"
    );
}

/// The CPU device feeds a long prompt in blocks (its activations stay bounded): the state
/// and the first token are those of one call over the whole prompt, and a prompt refused
/// for a bad id in its last block leaves the state as it was.
#[test]
fn cpu_backend_prefills_long_prompts_in_blocks_like_one_call() {
    use mamba2_wgpu::{Backend, CpuBackend, Sampling};
    for (m, copy) in hybrids::<f32>().into_iter().zip(hybrids::<f32>()) {
        let vocab = m.config.vocab_size;
        // Three blocks of 1024 tokens or more (the last one short).
        let prompt = tokens(2 * 1024 + 37, 21, vocab);
        let mut whole = m.new_state();
        let last = m
            .forward(
                &mut whole,
                &prompt,
                Scan::Chunked(m.config.chunk_size),
                Logits::Last,
            )
            .unwrap();
        let argmax = (0..vocab)
            .max_by(|&a, &b| last[0][a].total_cmp(&last[0][b]))
            .unwrap() as u32;
        let pattern = m.config.pattern();
        let mut cpu = CpuBackend::new(copy);
        let greedy = Sampling::default();
        assert_eq!(
            cpu.prefill_sample(&prompt, &greedy, 0).unwrap(),
            argmax,
            "{pattern}"
        );
        let blocks = Backend::state(&cpu).unwrap();
        assert_eq!(blocks.len, prompt.len());
        let e = rel_err(&blocks.values(), &whole.values());
        assert!(e <= 1e-5, "{pattern}: state rel err {e:e}");
        // A bad id past the first blocks: refused before anything is fed.
        let mut bad = prompt.clone();
        *bad.last_mut().unwrap() = vocab as u32;
        let mut fresh = CpuBackend::new(m);
        let err = fresh
            .prefill_sample(&bad, &greedy, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("outside the vocabulary"), "{err}");
        assert_eq!(Backend::state(&fresh).unwrap().len, 0);
    }
}

/// `max_new_tokens: 0` only feeds the prompt: the next call goes on from it as one call
/// over both prompts would.
#[test]
fn generating_zero_tokens_only_feeds_the_prompt() {
    use mamba2_wgpu::{CpuBackend, Finish, GenerateOptions, Session};
    for (m, copy) in hybrids::<f32>().into_iter().zip(hybrids::<f32>()) {
        let vocab = m.config.vocab_size;
        let (a, b) = (tokens(30, 5, vocab), tokens(7, 6, vocab));
        let opts = |n| GenerateOptions {
            max_new_tokens: n,
            ..Default::default()
        };
        let mut s = Session::new(Box::new(CpuBackend::new(m)));
        let (ids, finish) = s.generate(&a, &opts(0), |_| true).unwrap();
        assert_eq!((ids.len(), finish, s.position()), (0, Finish::Length, 30));
        let (next, _) = s.generate(&b, &opts(3), |_| true).unwrap();
        let mut fresh = Session::new(Box::new(CpuBackend::new(copy)));
        let both: Vec<u32> = a.iter().chain(&b).copied().collect();
        let (want, _) = fresh.generate(&both, &opts(3), |_| true).unwrap();
        assert_eq!(next, want, "{}", s.config().pattern());
    }
}
