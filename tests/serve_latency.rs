//! A request that comes in while another reply decodes does not wait for that reply's whole
//! round of tokens: with a slot free, the round ends at the steps already in flight and the
//! newcomer's prompt is read next. Both engine loops:
//! - the GPU batch (rounds of 16 steps, up to 3 in flight), over HTTP: three newcomers in a
//!   row each get their first token within 8 of the running stream's (without the early end
//!   a newcomer waits for the rest of the round, up to 15);
//! - sequences taking turns on one state (the CPU reference; turns of 64 tokens when a
//!   reply runs alone), driven directly: a newcomer sent at a known token ends that turn
//!   there, and a long prompt is read a chunk per turn with the running reply decoding
//!   between its chunks.

mod serve_common;

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};

use mamba2_wgpu::assets;
use mamba2_wgpu::config::ModelConfig;
use mamba2_wgpu::sampling::Sampling;
use mamba2_wgpu::server::ServerConfig;
use mamba2_wgpu::server::engine::{Engine, Event, Job, PREFILL_CHUNK};
use mamba2_wgpu::state::State;
use mamba2_wgpu::{Backend, CpuBackend, Result, Tokenizer};
use serve_common::{
    Running, Spec, completion_body, cpu_backend, gpu_backend, no_cache, start_on,
    tokenizer_without_eos,
};
use tokio::sync::mpsc::UnboundedReceiver;

/// Starts an endless stream and returns how many of its events have come so far (a
/// counter the reading task keeps up to date) and the task.
async fn running_stream(srv: &Running) -> (Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let url = format!("{}/v1/completions", srv.base);
    let mut r = srv
        .client
        .post(&url)
        .json(&completion_body("A long story:", 4096, None, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    let task = tokio::spawn(async move {
        let mut text = String::new();
        while let Ok(Some(c)) = r.chunk().await {
            text.push_str(&String::from_utf8_lossy(&c));
            count.store(text.matches("data: ").count(), Ordering::SeqCst);
        }
    });
    (seen, task)
}

/// For three newcomers in a row: the running stream's events between a newcomer's request
/// and its first event; each must be at most `bound`. (The running stream is stopped before
/// any assertion: a server whose client still reads would outlive a failing test.)
async fn newcomers_get_in_within(srv: &Running, bound: usize) {
    let (seen, task) = running_stream(srv).await;
    while seen.load(Ordering::SeqCst) < 4 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let url = format!("{}/v1/completions", srv.base);
    let mut waits = Vec::new();
    for i in 0..3 {
        let before = seen.load(Ordering::SeqCst);
        let mut r = srv
            .client
            .post(&url)
            .json(&completion_body(&format!("Newcomer {i}:"), 2, None, true))
            .send()
            .await
            .unwrap();
        let first = r.status() == 200 && r.chunk().await.ok().flatten().is_some();
        waits.push((first, seen.load(Ordering::SeqCst) - before));
        while let Ok(Some(_)) = r.chunk().await {}
    }
    task.abort();
    let _ = task.await;
    for (i, &(first, waited)) in waits.iter().enumerate() {
        assert!(first, "newcomer {i}: no first event");
        assert!(
            waited <= bound,
            "newcomer {i} waited for {waited} tokens of the running reply (at most {bound}): \
             {waits:?}"
        );
    }
}

/// The GPU batch: rounds of 16 steps, up to 3 in flight when the round ends early.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_newcomer_ends_the_batchs_round_early() {
    let (model, _) = assets::embedded().unwrap();
    let Some(backend) = gpu_backend(&model) else {
        return;
    };
    let config = ServerConfig {
        slots: 2,
        ..Default::default()
    };
    let srv = start_on(backend, &model, &tokenizer_without_eos(), config, None);
    newcomers_get_in_within(&srv, 8).await;
    tokio::task::block_in_place(|| srv.stop());
}

/// The CPU reference behind a running reply, sending a newcomer into the engine's queue at
/// its `at`-th decoded token (an arrival at a known point: no timing in the test) and
/// keeping how many tokens each decode call sampled.
struct Arrival {
    inner: CpuBackend,
    newcomer: Option<(Job, mpsc::Sender<Job>)>,
    at: usize,
    calls: Arc<Mutex<Vec<Call>>>,
}

/// A backend call the engine made, in order: a prompt piece fed (its tokens) or a decode
/// (the tokens it sampled).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Call {
    Prefill(usize),
    Decode(usize),
}

impl Backend for Arrival {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn reset(&mut self) -> Result<()> {
        self.inner.reset()
    }
    fn prefill_sample(&mut self, tokens: &[u32], sampling: &Sampling, pos: u64) -> Result<u32> {
        self.calls.lock().unwrap().push(Call::Prefill(tokens.len()));
        self.inner.prefill_sample(tokens, sampling, pos)
    }
    fn prefill_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.calls.lock().unwrap().push(Call::Prefill(tokens.len()));
        self.inner.prefill_logits(tokens)
    }
    fn decode(
        &mut self,
        first: u32,
        pos: u64,
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        let (at, newcomer) = (self.at, &mut self.newcomer);
        let mut seen = 0;
        let n = self
            .inner
            .decode(first, pos, max_new, sampling, stop, &mut |t| {
                seen += 1;
                if seen == at
                    && let Some((job, queue)) = newcomer.take()
                {
                    queue.send(job).unwrap();
                }
                on_token(t)
            })?;
        self.calls.lock().unwrap().push(Call::Decode(n));
        Ok(n)
    }
    fn snapshot(&self) -> Result<Box<dyn Any + Send>> {
        self.inner.snapshot()
    }
    fn restore(&mut self, snapshot: &(dyn Any + Send)) -> Result<()> {
        self.inner.restore(snapshot)
    }
    fn state(&self) -> Result<State<f32>> {
        Backend::state(&self.inner)
    }
}

/// A greedy request of `max_new` tokens with no stop token.
fn job(tok: &Tokenizer, prompt: &str, max_new: usize) -> (Job, UnboundedReceiver<Event>) {
    Spec {
        prompt: tok.encode(prompt).unwrap(),
        max_new,
        sampling: Sampling::greedy(),
        stop_ids: Vec::new(),
    }
    .job()
}

/// Sequences taking turns on one state (the CPU reference) with prompts read `chunk`
/// tokens a turn: a runner of `runner_max` greedy tokens, and a newcomer (`prompt`,
/// `newcomer_max` tokens) that arrives at the runner's `at`-th decoded token. Both must run
/// to their length; returns the backend calls in order.
fn runner_and_newcomer(
    runner_max: usize,
    prompt: &str,
    newcomer_max: usize,
    at: usize,
    chunk: usize,
) -> Vec<Call> {
    let (model, tok) = assets::embedded().unwrap();
    let (tx, rx) = mpsc::channel();
    let (runner, mut runner_heard) = job(&tok, "A long story:", runner_max);
    let (newcomer, mut newcomer_heard) = job(&tok, prompt, newcomer_max);
    let calls = Arc::new(Mutex::new(Vec::new()));
    let backend = Arrival {
        inner: cpu_backend(&model),
        newcomer: Some((newcomer, tx.clone())),
        at,
        calls: calls.clone(),
    };
    let engine = Engine {
        backend: Box::new(backend),
        tokenizer: Arc::new(tokenizer_without_eos()),
        cache: no_cache(&model),
        metrics: Default::default(),
        slots: 2,
        prefill_chunk: chunk,
    };
    let thread = std::thread::spawn(move || engine.run(rx));
    tx.send(runner).unwrap();
    drop(tx);
    let done = |heard: &mut UnboundedReceiver<Event>| loop {
        match heard.blocking_recv() {
            Some(Event::Done { usage, .. }) => break usage.completion_tokens,
            Some(Event::Error(e)) => panic!("{e}"),
            Some(Event::Text(_)) => {}
            None => panic!("no end"),
        }
    };
    assert_eq!(done(&mut newcomer_heard), newcomer_max);
    assert_eq!(done(&mut runner_heard), runner_max);
    thread.join().unwrap();
    calls.lock().unwrap().clone()
}

/// A reply running alone decodes turns of 64 tokens, and a newcomer that comes in at its
/// 5th token of a turn ends that turn at once: the running reply's decode call samples 5
/// tokens, the newcomer's prompt is read next, and both replies still run to their length.
#[test]
fn a_newcomer_ends_a_turn_early() {
    let calls = runner_and_newcomer(100, "A newcomer:", 3, 5, PREFILL_CHUNK);
    // The running reply's first decode call gave way at the newcomer's arrival.
    let first = calls.iter().find(|c| matches!(c, Call::Decode(_)));
    assert_eq!(first, Some(&Call::Decode(5)), "calls: {calls:?}");
}

/// A long prompt that comes in while a reply runs is read a chunk per turn, the running
/// reply decoding between its chunks: it does not stall for the whole prompt.
#[test]
fn a_long_prompt_is_read_between_the_running_replys_turns() {
    let (_, tok) = assets::embedded().unwrap();
    let long = "one two three four five six seven eight nine ten ".repeat(6);
    let prompt_len = tok.encode(&long).unwrap().len();
    let chunk = 8;
    let chunks = prompt_len.div_ceil(chunk);
    assert!(chunks >= 6, "{prompt_len} tokens");
    // The reply outlasts the prompt's reading (16 tokens a turn beside the newcomer).
    let calls = runner_and_newcomer(300, &long, 3, 5, chunk);
    // The newcomer's pieces: the prompt feeds after the runner's first decode.
    let start = calls
        .iter()
        .position(|c| matches!(c, Call::Decode(_)))
        .expect("a decode");
    let pieces: Vec<usize> = (start..calls.len())
        .filter(|&i| matches!(calls[i], Call::Prefill(_)))
        .collect();
    assert_eq!(pieces.len(), chunks, "calls: {calls:?}");
    let fed: usize = pieces
        .iter()
        .map(|&i| match calls[i] {
            Call::Prefill(n) => {
                assert!(n <= chunk, "a piece of {n} tokens: {calls:?}");
                n
            }
            Call::Decode(_) => unreachable!(),
        })
        .sum();
    assert_eq!(fed, prompt_len);
    // Between every two pieces, the running reply decoded.
    for w in pieces.windows(2) {
        assert!(
            calls[w[0]..w[1]]
                .iter()
                .any(|c| matches!(c, Call::Decode(n) if *n > 0)),
            "no decode between calls {} and {}: {calls:?}",
            w[0],
            w[1]
        );
    }
}
