//! The server's engine and HTTP front: interleaved sequences give each request exactly the
//! tokens of its solo `generate`, the prefix cache feeds only what is new (and survives a
//! restart, refusing another model's files), and the HTTP routes answer every bad request
//! with a clear OpenAI-style error. GPU tests run on lavapipe in CI.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use mamba2_wgpu::gpu::context::{DeviceChoice, pick_adapter};
use mamba2_wgpu::model::Model;
use mamba2_wgpu::prefix_cache::{CacheConfig, PrefixCache};
use mamba2_wgpu::sampling::Sampling;
use mamba2_wgpu::server::engine::{Engine, Event, FinishReason, Job, PREFILL_CHUNK};
use mamba2_wgpu::server::{Server, ServerConfig};
use mamba2_wgpu::state_file::{self, SavedState, StateDtype, StateKey};
use mamba2_wgpu::{Backend, EngineOptions, GenerateOptions, Session, Tokenizer, assets};
use serde_json::{Value, json};

/// A GPU backend for `model`, or None (the test is skipped, loudly) without an adapter;
/// with MAMBA2_REQUIRE_GPU set (CI) a missing adapter fails instead.
fn gpu_backend(model: &Model) -> Option<Box<dyn Backend>> {
    match pick_adapter(&DeviceChoice::Gpu(None)) {
        Ok(Some(_)) => Some(
            mamba2_wgpu::open_backend(
                model,
                &DeviceChoice::Gpu(None),
                EngineOptions {
                    context: model.config.attention.as_ref().map(|_| 256),
                    ..Default::default()
                },
                &mut |_| {},
            )
            .expect("backend"),
        ),
        _ => {
            assert!(
                std::env::var_os("MAMBA2_REQUIRE_GPU").is_none(),
                "MAMBA2_REQUIRE_GPU is set but no GPU adapter was found"
            );
            eprintln!(
                "\n!!!!!!!! SKIPPED: no GPU adapter (install mesa-vulkan-drivers) !!!!!!!!\n"
            );
            None
        }
    }
}

fn key(model: &Model) -> StateKey {
    StateKey {
        model: model.fingerprint(),
        format: "test".into(),
        blocks: model.config.pattern(),
    }
}

/// A cache that keeps nothing.
fn no_cache(model: &Model) -> PrefixCache {
    let cfg = CacheConfig {
        device_bytes: 0,
        host_bytes: 0,
        dir: None,
        ..Default::default()
    };
    PrefixCache::open(key(model), &model.config, cfg, &mut |_| {}).unwrap()
}

/// The reply text of a solo `generate` from a fresh state, decoded as the server streams it.
fn solo(backend: &mut Session, tok: &Tokenizer, prompt: &[u32], job: &Spec) -> (String, usize) {
    backend.reset().unwrap();
    let opts = GenerateOptions {
        max_new_tokens: job.max_new,
        sampling: job.sampling,
        stop: job.stop_ids.clone(),
    };
    let (ids, _) = backend.generate(prompt, &opts, |_| true).unwrap();
    let mut dec = tok.stream();
    let text: String = ids
        .iter()
        .filter_map(|&t| dec.step(tok, t).unwrap())
        .collect();
    (text, ids.len())
}

#[derive(Clone)]
struct Spec {
    prompt: Vec<u32>,
    max_new: usize,
    sampling: Sampling,
    stop_ids: Vec<u32>,
}

/// What one job heard: its text, finish and usage.
#[derive(Debug, Clone, PartialEq)]
struct Heard {
    text: String,
    finish: Option<FinishReason>,
    completion: usize,
    cached: usize,
}

/// Runs `specs` through an engine with `slots` slots (all sent at once, so they
/// interleave), returning what each heard, in order.
fn run_engine(
    backend: Box<dyn Backend>,
    tok: &Tokenizer,
    cache: PrefixCache,
    slots: usize,
    specs: &[Spec],
) -> Vec<Heard> {
    let engine = Engine {
        backend,
        tokenizer: std::sync::Arc::new(tok.clone()),
        cache,
        metrics: Default::default(),
        slots,
        prefill_chunk: PREFILL_CHUNK,
    };
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::spawn(move || engine.run(rx));
    let mut outs = Vec::new();
    for s in specs {
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(Job {
            prompt: s.prompt.clone(),
            max_new: s.max_new,
            sampling: s.sampling,
            stop_ids: s.stop_ids.clone(),
            stop_text: Vec::new(),
            events: etx,
        })
        .unwrap();
        outs.push(erx);
    }
    let heard = outs
        .into_iter()
        .map(|mut rx| {
            let mut h = Heard {
                text: String::new(),
                finish: None,
                completion: 0,
                cached: 0,
            };
            while let Some(ev) = rx.blocking_recv() {
                match ev {
                    Event::Text(t) => h.text.push_str(&t),
                    Event::Done { finish, usage } => {
                        h.finish = Some(finish);
                        h.completion = usage.completion_tokens;
                        h.cached = usage.cached_tokens;
                        break;
                    }
                    Event::Error(e) => panic!("engine error: {e}"),
                }
            }
            h
        })
        .collect();
    drop(tx);
    thread.join().unwrap();
    heard
}

/// Eight requests of different prompt lengths and reply lengths, greedy and sampled.
fn specs(vocab: u32, eos: Option<u32>) -> Vec<Spec> {
    (0..8u32)
        .map(|i| Spec {
            prompt: (0..(3 + 7 * i))
                .map(|j| (j * 31 + i * 17 + 5) % vocab)
                .collect(),
            max_new: 6 + 5 * (i as usize % 4),
            sampling: if i % 2 == 0 {
                Sampling::greedy()
            } else {
                Sampling {
                    temperature: 0.9,
                    top_k: 20,
                    top_p: 0.95,
                    seed: 1000 + i as u64,
                }
            },
            stop_ids: eos.into_iter().collect(),
        })
        .collect()
}

/// Interleaved == solo, for a model and a tokenizer: every slot count from 1 (one after
/// another) to 8 (all at once: replies decoded together in the GPU batch, prompts read in
/// chunks between its steps).
fn interleaved_equals_solo(model: &Model, tok: &Tokenizer, eos: Option<u32>) {
    let Some(b) = gpu_backend(model) else { return };
    let mut solo_session = Session::new(b);
    let vocab = model.config.vocab_size as u32;
    let specs = specs(vocab, eos);
    let want: Vec<(String, usize)> = specs
        .iter()
        .map(|s| solo(&mut solo_session, tok, &s.prompt, s))
        .collect();
    for slots in [1, 3, 8] {
        let backend = gpu_backend(model).unwrap();
        let heard = run_engine(backend, tok, no_cache(model), slots, &specs);
        for (i, (h, w)) in heard.iter().zip(&want).enumerate() {
            assert_eq!(h.text, w.0, "request {i} with {slots} slots");
            assert_eq!(h.completion, w.1, "request {i} with {slots} slots");
        }
    }
}

#[test]
fn interleaved_sequences_equal_their_solo_runs_mamba2() {
    let (model, tok) = assets::embedded().unwrap();
    interleaved_equals_solo(&model, &tok, tok.eos);
}

#[test]
fn interleaved_sequences_equal_their_solo_runs_hybrid() {
    let model = Model::load(&common::fixture("nemotron_h_hybrid")).unwrap();
    // The fixture has no tokenizer; its 101 ids decode through the embedded one (the
    // texts compared are then just a readable form of the ids).
    let (_, tok) = assets::embedded().unwrap();
    interleaved_equals_solo(&model, &tok, None);
}

/// A follow-up that extends a cached prompt feeds only the new tokens and produces what a
/// fresh run produces.
#[test]
fn prefix_cache_feeds_only_new_tokens_and_changes_nothing() {
    let (model, tok) = assets::embedded().unwrap();
    let Some(b) = gpu_backend(&model) else { return };
    let mut solo_session = Session::new(b);
    let base: Vec<u32> = tok
        .encode("The quick brown fox jumps over the lazy dog.")
        .unwrap();
    let mut longer = base.clone();
    longer.extend(tok.encode_with(" Then it sat down and", false).unwrap());
    let spec = |prompt: &[u32]| Spec {
        prompt: prompt.to_vec(),
        max_new: 12,
        sampling: Sampling::greedy(),
        stop_ids: Vec::new(),
    };
    let want = solo(&mut solo_session, &tok, &longer, &spec(&longer));
    for cfg in [
        // Device snapshots.
        CacheConfig::default(),
        // Host memory only (f32).
        CacheConfig {
            device_bytes: 0,
            ..Default::default()
        },
    ] {
        let cache = PrefixCache::open(key(&model), &model.config, cfg, &mut |_| {}).unwrap();
        let backend = gpu_backend(&model).unwrap();
        let heard = run_engine(backend, &tok, cache, 1, &[spec(&base), spec(&longer)]);
        assert_eq!(heard[0].cached, 0);
        assert_eq!(
            heard[1].cached,
            base.len(),
            "the second request resumes at the first's end"
        );
        assert_eq!(heard[1].text, want.0);
    }
}

/// `--cache-every N` leaves an entry every N prompt tokens, N a multiple of the prompt
/// chunk or not: a prompt that shares 150 tokens with an earlier 250-token one resumes at
/// 100 with entries every 100 (the chunks used to end only at multiples of 512).
#[test]
fn prefix_cache_keeps_a_state_every_n_prompt_tokens() {
    let (model, tok) = assets::embedded().unwrap();
    let Some(backend) = gpu_backend(&model) else {
        return;
    };
    let words: Vec<u32> = tok
        .encode("one two three four five six seven eight nine ten ")
        .unwrap();
    let long: Vec<u32> = words.iter().copied().cycle().take(250).collect();
    let mut other = long[..150].to_vec();
    other.extend(
        tok.encode_with(" and then something else entirely", false)
            .unwrap(),
    );
    let spec = |prompt: &[u32]| Spec {
        prompt: prompt.to_vec(),
        max_new: 2,
        sampling: Sampling::greedy(),
        stop_ids: Vec::new(),
    };
    let cfg = CacheConfig {
        device_bytes: 0,
        every: 100,
        ..Default::default()
    };
    let cache = PrefixCache::open(key(&model), &model.config, cfg, &mut |_| {}).unwrap();
    let heard = run_engine(backend, &tok, cache, 1, &[spec(&long), spec(&other)]);
    assert_eq!(heard[1].cached, 100, "{heard:?}");
}

/// Cache files: written at shutdown, found again by a new cache, refused when they belong
/// to another model.
#[test]
fn prefix_cache_files_survive_a_restart_and_refuse_another_model() {
    let (model, tok) = assets::embedded().unwrap();
    let Some(backend) = gpu_backend(&model) else {
        return;
    };
    let dir = tempdir("cache-files");
    let cfg = CacheConfig {
        dir: Some(dir.clone()),
        ..Default::default()
    };
    let prompt: Vec<u32> = tok.encode("A stitch in time saves nine, and").unwrap();
    let spec = Spec {
        prompt: prompt.clone(),
        max_new: 4,
        sampling: Sampling::greedy(),
        stop_ids: Vec::new(),
    };
    let cache = PrefixCache::open(key(&model), &model.config, cfg.clone(), &mut |_| {}).unwrap();
    // While it is open, no other cache takes the directory.
    let err = PrefixCache::open(key(&model), &model.config, cfg.clone(), &mut |_| {})
        .err()
        .expect("a second cache on a directory in use")
        .to_string();
    assert!(
        err.contains("in use by another mamba2 process") && err.contains(dir.to_str().unwrap()),
        "{err}"
    );
    run_engine(backend, &tok, cache, 1, std::slice::from_ref(&spec));
    let state_files = || {
        std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect::<Vec<_>>()
    };
    let files = state_files().len();
    assert!(
        files >= 2,
        "the prompt's and the reply's states were written ({files})"
    );
    // A file half written when a process stopped is removed when a cache opens.
    let partial = dir.join("x.safetensors.123.0.partial");
    std::fs::write(&partial, b"half").unwrap();
    // A new process finds them.
    let cache = PrefixCache::open(key(&model), &model.config, cfg.clone(), &mut |_| {}).unwrap();
    assert_eq!(cache.stats().entries[2], files);
    assert!(!partial.exists());
    let mut longer = prompt.clone();
    longer.extend(tok.encode_with(" more", false).unwrap());
    let backend = gpu_backend(&model).unwrap();
    let heard = run_engine(
        backend,
        &tok,
        cache,
        1,
        &[Spec {
            prompt: longer,
            ..spec.clone()
        }],
    );
    assert!(heard[0].cached >= prompt.len());
    // The same files under another model's key are refused, each with a note naming the
    // file and the field.
    let mut other = key(&model);
    other.model = "0123456789abcdef0123456789abcdef".into();
    let mut notes = Vec::new();
    let cache =
        PrefixCache::open(other.clone(), &model.config, cfg, &mut |n| notes.push(n)).unwrap();
    assert_eq!(cache.stats().entries[2], 0);
    assert!(cache.stats().refused_files >= files);
    assert!(notes[0].contains("mamba2.model"), "{}", notes[0]);
    // And loading one directly says why.
    let file = state_files().remove(0);
    let err = state_file::load(&file, &other, &model.config)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("mamba2.model") && err.contains(file.to_str().unwrap()),
        "{err}"
    );
}

/// Saved states round-trip exactly in f32, and a damaged or foreign file is refused with
/// its name and the field at fault.
#[test]
fn state_files_round_trip_and_refuse_bad_headers() {
    let model = Model::load(&common::fixture("nemotron_h_hybrid")).unwrap();
    let c = &model.config;
    let mut state = mamba2_wgpu::state::State::<f32>::new(c);
    state.len = 3;
    let kv = c.attention.as_ref().unwrap().kv_width();
    for (i, l) in state.layers.iter_mut().enumerate() {
        match l {
            mamba2_wgpu::state::LayerState::Mamba2 { conv, ssm } => {
                conv.iter_mut()
                    .enumerate()
                    .for_each(|(j, v)| *v = (i + j) as f32 * 0.1);
                ssm.iter_mut()
                    .enumerate()
                    .for_each(|(j, v)| *v = -(j as f32) * 0.01);
            }
            mamba2_wgpu::state::LayerState::Attention { k, v } => {
                *k = (0..3 * kv).map(|j| j as f32 * 0.5).collect();
                *v = (0..3 * kv).map(|j| 1.0 / (1.0 + j as f32)).collect();
            }
            _ => {}
        }
    }
    let dir = tempdir("state-files");
    let path = dir.join("s.safetensors");
    let saved = SavedState {
        state: state.clone(),
        tokens: vec![4, 5, 6],
        extra: Some("{\"x\":1}".into()),
    };
    let k = key(&model);
    state_file::save(&path, &k, &saved, StateDtype::F32, c).unwrap();
    let back = state_file::load(&path, &k, c).unwrap();
    assert_eq!(back.state, state);
    assert_eq!(back.tokens, vec![4, 5, 6]);
    assert_eq!(back.extra.as_deref(), Some("{\"x\":1}"));
    // f16: every value within f16 rounding.
    state_file::save(&path, &k, &saved, StateDtype::F16, c).unwrap();
    let half = state_file::load(&path, &k, c).unwrap();
    for (a, b) in half.state.values().iter().zip(state.values()) {
        assert!((a - b).abs() <= b.abs() * 1e-3 + 1e-7, "{a} vs {b}");
    }
    // Another format, another block pattern.
    for (field, mut other) in [("mamba2.format", k.clone()), ("mamba2.blocks", k.clone())] {
        if field == "mamba2.format" {
            other.format = "q8_0".into();
        } else {
            other.blocks = "MMMM".into();
        }
        let err = state_file::load(&path, &other, c).unwrap_err().to_string();
        assert!(
            err.contains(field) && err.contains("s.safetensors"),
            "{err}"
        );
    }
    // Not a state file at all; a truncated one.
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, b"hello").unwrap();
    let err = state_file::load(&junk, &k, c).unwrap_err().to_string();
    assert!(err.contains("junk.safetensors"), "{err}");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&junk, &bytes[..bytes.len() - 7]).unwrap();
    let err = state_file::load(&junk, &k, c).unwrap_err().to_string();
    assert!(err.contains("junk.safetensors"), "{err}");
    // The model's own weights file is not a state.
    let err = state_file::load(
        &common::fixture("nemotron_h_hybrid").join("model.safetensors"),
        &k,
        c,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("mamba2.kind"), "{err}");
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mamba2-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

// ---------------------------------------------------------------------------------------
// HTTP

struct Running {
    server: Option<Server>,
    base: String,
    client: reqwest::Client,
    key: Option<String>,
}

impl Running {
    fn stop(mut self) {
        self.server.take().unwrap().stop().unwrap();
    }
    /// POSTs `body` as JSON (with the server's API key, if it has one).
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let mut req = self.client.post(format!("{}{path}", self.base)).json(&body);
        if let Some(k) = &self.key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }
    async fn raw(&self, path: &str, body: &'static str) -> (u16, Value) {
        let r = self
            .client
            .post(format!("{}{path}", self.base))
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }
    async fn metric(&self, name: &str) -> f64 {
        let mut get = self.client.get(format!("{}/metrics", self.base));
        if let Some(k) = &self.key {
            get = get.bearer_auth(k);
        }
        let text = get.send().await.unwrap().text().await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("mamba2_{name} ")))
            .unwrap_or_else(|| panic!("{name} not in /metrics"))
            .parse()
            .unwrap()
    }
}

fn start(
    model: &Model,
    tok: &Tokenizer,
    config: ServerConfig,
    cache: Option<CacheConfig>,
) -> Option<Running> {
    let backend = gpu_backend(model)?;
    let api_key = config.api_key.clone();
    let cache = match cache {
        Some(cfg) => PrefixCache::open(key(model), &model.config, cfg, &mut |_| {}).unwrap(),
        None => no_cache(model),
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let server = Server::start(listener, config, backend, tok.clone(), cache).unwrap();
    let base = format!("http://{}", server.addr);
    Some(Running {
        server: Some(server),
        base,
        client: reqwest::Client::new(),
        key: api_key,
    })
}

/// An OpenAI error body: JSON, with the message, the type, the parameter and the code.
async fn error_body(r: reqwest::Response) -> Value {
    let json = r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json");
    let text = r.text().await.unwrap();
    assert!(json, "not JSON: {text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let e = &v["error"];
    assert!(e["message"].is_string(), "{v}");
    assert_eq!(e["type"], "invalid_request_error", "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    v
}

/// Reads a server-sent-event stream to its end: the `data:` payloads in order.
async fn sse(r: reqwest::Response) -> Vec<String> {
    sse_data(&r.text().await.unwrap())
}

fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// Sends a streamed completion and reads it to its end in a task: `started` fires with its
/// first event (the first token), the task gives the reply's text.
fn streamed(
    srv: &Running,
    body: Value,
) -> (
    tokio::sync::oneshot::Receiver<()>,
    tokio::task::JoinHandle<String>,
) {
    let (started, rx) = tokio::sync::oneshot::channel();
    let req = srv
        .client
        .post(format!("{}/v1/completions", srv.base))
        .json(&body);
    let task = tokio::spawn(async move {
        let mut r = req.send().await.unwrap();
        assert_eq!(r.status(), 200);
        let mut started = Some(started);
        let mut bytes = Vec::new();
        while let Some(c) = r.chunk().await.unwrap() {
            bytes.extend_from_slice(&c);
            if let Some(s) = started.take() {
                let _ = s.send(());
            }
        }
        streamed_text(&sse_data(&String::from_utf8(bytes).unwrap()))
    });
    (rx, task)
}

/// Polls `/metrics` until `name` is `value` (10 s at most).
async fn wait_metric(srv: &Running, name: &str, value: f64) {
    for _ in 0..400 {
        if srv.metric(name).await == value {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "{name} is {}, not {value}, after 10 s",
        srv.metric(name).await
    );
}

/// The solo reply (text) of what `completion_body(prompt, max, seed, _)` asks the server.
fn solo_completion(
    session: &mut Session,
    tok: &Tokenizer,
    prompt: &str,
    max: usize,
    seed: Option<u64>,
) -> String {
    let spec = Spec {
        prompt: tok.encode(prompt).unwrap(),
        max_new: max,
        sampling: match seed {
            Some(s) => Sampling {
                temperature: 0.8,
                top_k: 30,
                top_p: 1.0,
                seed: s,
            },
            None => Sampling::greedy(),
        },
        stop_ids: mamba2_wgpu::chat::stop_ids(tok),
    };
    solo(session, tok, &spec.prompt, &spec).0
}

/// The embedded model's tokenizer without its end-of-sequence token: replies run to their
/// `max_tokens` (a stream meant to outlast the test must not end on its own).
fn tokenizer_without_eos() -> Tokenizer {
    let (_, mut tok) = assets::embedded().unwrap();
    tok.eos = None;
    tok.eos_token = None;
    tok
}

/// The text of a streamed completion: its chunks' `choices[0].text`, which must end with
/// `[DONE]`.
fn streamed_text(events: &[String]) -> String {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    events[..events.len() - 1]
        .iter()
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect()
}

fn completion_body(prompt: &str, max: usize, seed: Option<u64>, stream: bool) -> Value {
    let mut b = json!({"prompt": prompt, "max_tokens": max, "stream": stream});
    match seed {
        Some(s) => {
            b["seed"] = json!(s);
            b["temperature"] = json!(0.8);
            b["top_k"] = json!(30);
        }
        None => b["temperature"] = json!(0),
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_replies_equal_solo_generate_streamed_or_not_and_concurrently() {
    let (model, tok) = assets::embedded().unwrap();
    let Some(srv) = start(
        &model,
        &tok,
        ServerConfig {
            slots: 4,
            ..Default::default()
        },
        None,
    ) else {
        return;
    };
    let prompts: Vec<String> = (0..32)
        .map(|i| {
            format!(
                "Fortune number {i}: the {}",
                ["wise", "old", "quick", "happy"][i % 4]
            )
        })
        .collect();
    // Solo runs, on a backend of their own.
    let mut session = Session::new(gpu_backend(&model).unwrap());
    let want: Vec<String> = tokio::task::block_in_place(|| {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let seed = (i % 2 == 1).then_some(i as u64);
                let spec = Spec {
                    prompt: tok.encode(p).unwrap(),
                    max_new: 10,
                    sampling: match seed {
                        Some(s) => Sampling {
                            temperature: 0.8,
                            top_k: 30,
                            top_p: 1.0,
                            seed: s,
                        },
                        None => Sampling::greedy(),
                    },
                    stop_ids: tok.eos.into_iter().collect(),
                };
                solo(&mut session, &tok, &spec.prompt, &spec).0
            })
            .collect()
    });
    // One non-streamed and one streamed request.
    let (status, body) = srv
        .post(
            "/v1/completions",
            completion_body(&prompts[0], 10, None, false),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], want[0]);
    assert_eq!(body["object"], "text_completion");
    assert_eq!(
        body["usage"]["prompt_tokens"],
        tok.encode(&prompts[0]).unwrap().len()
    );
    let r = srv
        .client
        .post(format!("{}/v1/completions", srv.base))
        .json(&completion_body(&prompts[1], 10, Some(1), true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert_eq!(streamed_text(&sse(r).await), want[1]);
    // 32 at once, streamed and not, on 4 slots (28 wait in the queue).
    let mut tasks = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let client = srv.client.clone();
        let url = format!("{}/v1/completions", srv.base);
        let body = completion_body(p, 10, (i % 2 == 1).then_some(i as u64), i % 3 == 0);
        tasks.push(tokio::spawn(async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            if body["stream"] == true {
                streamed_text(&sse(r).await)
            } else {
                let v: Value = r.json().await.unwrap();
                v["choices"][0]["text"].as_str().unwrap().to_string()
            }
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), want[i], "request {i}");
    }
    // Chat completions stream a role first and end with a finish reason.
    let r = srv
        .client
        .post(format!("{}/v1/chat/completions", srv.base))
        .json(
            &json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                      "stream": true, "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    let ev = sse(r).await;
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let usage: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() <= 4);
    let models = srv
        .client
        .get(format!("{}/v1/models", srv.base))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["object"], "model");
    tokio::task::block_in_place(|| srv.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_refuses_bad_requests_and_survives_a_vanishing_client() {
    let (model, tok) = assets::embedded().unwrap();
    let Some(srv) = start(
        &model,
        &tok,
        ServerConfig {
            slots: 1,
            queue: 0,
            max_prompt: 64,
            body_limit: 4096,
            ..Default::default()
        },
        None,
    ) else {
        return;
    };
    let cases: [(&str, &str, &str); 9] = [
        ("/v1/chat/completions", "{not json", "not valid JSON"),
        ("/v1/chat/completions", "[1, 2]", "JSON object"),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#,
            "message list is empty",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": "hi"}"#,
            "messages: expected an array",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}"#,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}"#,
            "temperature",
        ),
        (
            "/v1/completions",
            r#"{"prompt": 7}"#,
            "prompt: expected a string",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "stream": "yes"}"#,
            "stream",
        ),
        ("/v1/completions", r#"{"prompt": "x", "seed": 1.5}"#, "seed"),
    ];
    for (path, body, says) in cases {
        let (status, v) = srv.raw(path, body).await;
        assert_eq!(status, 400, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{body}: {msg}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // Over the prompt limit.
    let long = "word ".repeat(200);
    let (status, v) = srv.post("/v1/completions", json!({"prompt": long})).await;
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("more than the 64"),
        "{v}"
    );
    // More than --max-completion is refused, naming the field.
    let (status, v) = srv
        .post(
            "/v1/completions",
            completion_body("Once upon a time", 65_537, None, true),
        )
        .await;
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens: 65537 tokens: this server gives at most 65536"),
        "{v}"
    );
    // A long stream holds the only slot; the next request finds the queue full.
    let r = srv
        .client
        .post(format!("{}/v1/completions", srv.base))
        .json(&completion_body("Once upon a time", 65_536, None, true))
        .send()
        .await
        .unwrap();
    let mut r = r;
    let chunk = r.chunk().await.unwrap().unwrap();
    assert!(chunk.starts_with(b"data: "));
    let busy = srv
        .client
        .post(format!("{}/v1/completions", srv.base))
        .json(&completion_body("hello", 2, None, false))
        .send()
        .await
        .unwrap();
    assert_eq!(busy.status(), 503);
    assert_eq!(busy.headers()["retry-after"], "1");
    // The client goes away mid-stream: its slot is freed and the server goes on.
    drop(r);
    let mut freed = false;
    for _ in 0..200 {
        if srv.metric("active_slots").await == 0.0 {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(freed, "the vanished client's slot was freed");
    assert!(srv.metric("requests_cancelled_total").await >= 1.0);
    let (status, v) = srv
        .post("/v1/completions", completion_body("hello", 2, None, false))
        .await;
    assert_eq!(status, 200, "{v}");
    assert!(srv.metric("requests_rejected_total").await >= 1.0);
    // Unknown routes.
    let r = srv
        .client
        .get(format!("{}/v2/nothing", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // A body over the limit and a route asked with the wrong method get OpenAI error
    // bodies too, not axum's plain text.
    let big = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(8192));
    let r = srv
        .client
        .post(format!("{}/v1/completions", srv.base))
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let v = error_body(r).await;
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("larger than this server takes (4096 bytes)"),
        "{v}"
    );
    for (method, path, allowed) in [
        (reqwest::Method::GET, "/v1/chat/completions", "POST"),
        (reqwest::Method::DELETE, "/v1/completions", "POST"),
        (reqwest::Method::POST, "/v1/models", "GET"),
        (reqwest::Method::PUT, "/health", "GET"),
    ] {
        let r = srv
            .client
            .request(method.clone(), format!("{}{path}", srv.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 405, "{method} {path}");
        let allow = r.headers()["allow"].to_str().unwrap().to_string();
        assert!(allow.contains(allowed), "{method} {path}: Allow {allow}");
        let v = error_body(r).await;
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&format!("does not take {method}")),
            "{v}"
        );
    }
    tokio::task::block_in_place(|| srv.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_api_key_and_cached_prefix_in_usage_across_a_restart() {
    let (model, tok) = assets::embedded().unwrap();
    let dir = tempdir("http-cache");
    let config = ServerConfig {
        api_key: Some("sekrit".into()),
        ..Default::default()
    };
    let cache = CacheConfig {
        dir: Some(dir.clone()),
        ..Default::default()
    };
    let Some(srv) = start(&model, &tok, config.clone(), Some(cache.clone())) else {
        return;
    };
    let r = srv
        .client
        .get(format!("{}/v1/models", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = srv
        .client
        .get(format!("{}/health", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "health needs no key");
    // A request without the key, with a wrong one (one byte off, a prefix of it, longer)
    // or in another scheme: a 401 with an OpenAI error body.
    let hello = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    for auth in [
        None,
        Some("Bearer sekrix"),
        Some("Bearer sekri"),
        Some("Bearer sekrit2"),
        Some("Basic sekrit"),
    ] {
        let mut req = srv
            .client
            .post(format!("{}/v1/chat/completions", srv.base))
            .json(&hello);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "authentication_error", "{auth:?}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Authorization: Bearer"),
            "{v}"
        );
    }
    let (status, v) = srv.post("/v1/chat/completions", hello).await;
    assert_eq!(status, 200, "the right key: {v}");
    let (status, first) = srv
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Tell me a fortune"}],
                   "max_tokens": 6, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply = first["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    // The follow-up turn carries the whole conversation.
    let follow = json!({"messages": [
        {"role": "user", "content": "Tell me a fortune"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Another"}],
        "max_tokens": 6, "temperature": 0});
    let (_, second) = srv.post("/v1/chat/completions", follow.clone()).await;
    let prompt1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached2 = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached2 >= prompt1,
        "the follow-up resumed at least at the first prompt's end"
    );
    assert!(srv.metric("prefix_cache_hits_total").await >= 1.0);
    tokio::task::block_in_place(|| srv.stop());
    // Restarted on the same directory: the hit survives.
    let srv = start(&model, &tok, config, Some(cache)).unwrap();
    let (_, again) = srv.post("/v1/chat/completions", follow).await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"], cached2,
        "{again}"
    );
    assert_eq!(again["choices"], second["choices"]);
    tokio::task::block_in_place(|| srv.stop());
}

/// `stop` over HTTP: the reply ends right before the first stop string (a string that
/// straddles two tokens of the greedy reply here, held back while it might still be one),
/// with `finish_reason: "stop"`, streamed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_stop_strings_end_the_reply_before_them_streamed_or_not() {
    let (model, tok) = assets::embedded().unwrap();
    let Some(srv) = start(&model, &tok, ServerConfig::default(), None) else {
        return;
    };
    let url = format!("{}/v1/completions", srv.base);
    let prompt = "The secret of a happy life is";
    // The greedy reply without a stop string: one piece per token.
    let r = srv
        .client
        .post(&url)
        .json(&completion_body(prompt, 24, None, true))
        .send()
        .await
        .unwrap();
    let events = sse(r).await;
    let pieces: Vec<String> = events[..events.len() - 1]
        .iter()
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .filter(|t| !t.is_empty())
        .collect();
    let full = pieces.concat();
    // The last two characters of one piece and the first two of the next, from the third
    // piece on: the reply ends where that string first appears.
    let (stop, at) = (2..pieces.len() - 1)
        .find_map(|k| {
            let tail: String = {
                let c: Vec<char> = pieces[k].chars().collect();
                c[c.len().saturating_sub(2)..].iter().collect()
            };
            let head: String = pieces[k + 1].chars().take(2).collect();
            let stop = format!("{tail}{head}");
            let at = full.find(&stop)?;
            (at > 0 && !stop.trim().is_empty()).then_some((stop, at))
        })
        .unwrap_or_else(|| panic!("no stop string to cut {pieces:?} at"));
    let want = &full[..at];
    assert!(want.len() < full.len());
    // Not streamed, with a list of stop strings (one that never comes).
    let mut body = completion_body(prompt, 24, None, false);
    body["stop"] = json!(["a stop string that never comes", stop]);
    let (status, v) = srv.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want, "stop {stop:?} in {full:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    // Streamed, with one stop string: no chunk carries a piece of it.
    let mut body = completion_body(prompt, 24, None, true);
    body["stop"] = json!(stop);
    let r = srv.client.post(&url).json(&body).send().await.unwrap();
    let events = sse(r).await;
    assert_eq!(streamed_text(&events), want, "stop {stop:?} in {full:?}");
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop", "{last}");
    tokio::task::block_in_place(|| srv.stop());
}

/// With more than one slot the replies decode together in the GPU batch. Clients that
/// leave mid-stream, and one that leaves while its request waits in the queue, free their
/// places and count in `requests_cancelled_total`; the streams beside them run on to
/// exactly their solo replies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_batched_clients_that_leave_are_counted_and_change_no_other_reply() {
    let (model, _) = assets::embedded().unwrap();
    let tok = tokenizer_without_eos();
    let config = ServerConfig {
        slots: 3,
        queue: 4,
        ..Default::default()
    };
    let Some(srv) = start(&model, &tok, config, None) else {
        return;
    };
    let finite = [
        ("A fortune for the patient:", 40, None),
        ("A fortune for the bold:", 56, Some(7)),
    ];
    let mut session = Session::new(gpu_backend(&model).unwrap());
    let want: Vec<String> = tokio::task::block_in_place(|| {
        finite
            .iter()
            .map(|&(p, n, seed)| solo_completion(&mut session, &tok, p, n, seed))
            .collect()
    });
    let url = format!("{}/v1/completions", srv.base);
    // Three endless streams fill the batch.
    let mut endless = Vec::new();
    for i in 0..3 {
        let body = completion_body(&format!("Story number {i}:"), 65_536, None, true);
        let mut r = srv.client.post(&url).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.chunk().await.unwrap().is_some());
        endless.push(r);
    }
    assert_eq!(srv.metric("active_slots").await, 3.0);
    // A fourth request waits for a slot; its client leaves before its turn.
    let queued = srv
        .client
        .post(&url)
        .json(&completion_body("Never read", 8, None, true))
        .send()
        .await
        .unwrap();
    wait_metric(&srv, "queue_depth", 1.0).await;
    drop(queued);
    wait_metric(&srv, "requests_cancelled_total", 1.0).await;
    wait_metric(&srv, "queue_depth", 0.0).await;
    assert_eq!(srv.metric("active_slots").await, 3.0);
    // Two finite requests wait; two endless clients leave mid-stream, and the finite
    // requests take their slots beside the third, which decodes on.
    let (started, tasks): (Vec<_>, Vec<_>) = finite
        .iter()
        .map(|&(p, n, seed)| streamed(&srv, completion_body(p, n, seed, true)))
        .unzip();
    wait_metric(&srv, "queue_depth", 2.0).await;
    let last = endless.pop().unwrap();
    endless.clear();
    wait_metric(&srv, "requests_cancelled_total", 3.0).await;
    // Once both have their first token, the last endless client leaves in the middle of
    // their replies.
    for s in started {
        s.await.unwrap();
    }
    drop(last);
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), want[i], "finite request {i}");
    }
    wait_metric(&srv, "requests_cancelled_total", 4.0).await;
    wait_metric(&srv, "active_slots", 0.0).await;
    assert_eq!(srv.metric("requests_completed_total").await, 2.0);
    tokio::task::block_in_place(|| srv.stop());
}

/// A prompt several prefill chunks long (chunks of 16 tokens here), sent while other
/// streams decode in the batch, is read a chunk per engine round between their tokens:
/// every reply is still its solo run's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_long_prompts_read_in_chunks_between_decoding_streams_change_no_reply() {
    let (model, _) = assets::embedded().unwrap();
    let tok = tokenizer_without_eos();
    let chunk = 16;
    let config = ServerConfig {
        slots: 4,
        prefill_chunk: chunk,
        ..Default::default()
    };
    let Some(srv) = start(&model, &tok, config, None) else {
        return;
    };
    let tale = "Once upon a time, in a land far away, there lived a wise old king. ";
    let long = |title: &str| format!("{title} {}", tale.repeat(6));
    let decoding = [
        ("Fortune for the patient:".to_string(), 160, None),
        ("Fortune for the bold:".to_string(), 160, Some(3)),
    ];
    let reading = [
        (long("The first tale."), 12, None),
        (long("The second tale."), 12, Some(5)),
    ];
    for (p, _, _) in &reading {
        let n = tok.encode(p).unwrap().len();
        assert!(n > 4 * chunk, "a prompt of {n} tokens");
    }
    let mut session = Session::new(gpu_backend(&model).unwrap());
    let want: Vec<String> = tokio::task::block_in_place(|| {
        decoding
            .iter()
            .chain(&reading)
            .map(|(p, n, seed)| solo_completion(&mut session, &tok, p, *n, *seed))
            .collect()
    });
    // Two streams decode...
    let (started, decode_tasks): (Vec<_>, Vec<_>) = decoding
        .iter()
        .map(|(p, n, seed)| streamed(&srv, completion_body(p, *n, *seed, true)))
        .unzip();
    for s in started {
        s.await.unwrap();
    }
    // ... when the long prompts come.
    let read_tasks: Vec<_> = reading
        .iter()
        .map(|(p, n, seed)| {
            let req = srv
                .client
                .post(format!("{}/v1/completions", srv.base))
                .json(&completion_body(p, *n, *seed, false));
            tokio::spawn(async move {
                let v: Value = req.send().await.unwrap().json().await.unwrap();
                v["choices"][0]["text"].as_str().unwrap().to_string()
            })
        })
        .collect();
    assert!(
        decode_tasks.iter().all(|t| !t.is_finished()),
        "the streams were still decoding when the long prompts came"
    );
    for (i, t) in decode_tasks.into_iter().chain(read_tasks).enumerate() {
        assert_eq!(t.await.unwrap(), want[i], "request {i}");
    }
    tokio::task::block_in_place(|| srv.stop());
}

// ---------------------------------------------------------------------------------------
// End of turn: the chat template's token, and one conversation engine

/// A ChatML-like template over the embedded tokenizer: `<|endoftext|>` opens a message and
/// `end` closes each reply (the model's own end-of-turn token, not the EOS).
fn chatml(end: &str) -> String {
    format!(
        "{{% for m in messages %}}<|endoftext|>{{{{ m.role }}}}\n{{{{ m.content }}}}\
         {{% if m.role == 'assistant' %}}{end}{{% endif %}}\n{{% endfor %}}\
         {{% if add_generation_prompt %}}<|endoftext|>assistant\n{{% endif %}}"
    )
}

/// The embedded tokenizer with `chatml(end)` as its template, `end` being the text of the
/// reply token at `reply[k]` made a special token: the first token, from the third on, that
/// does not come earlier in the reply and reads as a word with its space (text that cannot
/// appear in a prompt: `Ġ` stands for the space in the vocabulary). A model trained with
/// that template would end its replies with it; this one, greedy, ends there after `k`
/// tokens. Returns the tokenizer, the token and `k`.
fn tokenizer_with_turn_end(reply: &[u32]) -> (Tokenizer, u32, usize) {
    let json: Value = serde_json::from_slice(include_bytes!("../assets/tokenizer.json")).unwrap();
    let text_of = |id: u32| {
        json["model"]["vocab"]
            .as_object()
            .unwrap()
            .iter()
            .find(|(_, v)| v.as_u64() == Some(u64::from(id)))
            .map(|(t, _)| t.clone())
            .unwrap()
    };
    let (k, id, end) = (2..reply.len())
        .map(|k| (k, reply[k], text_of(reply[k])))
        .find(|(k, id, t)| {
            !reply[..*k].contains(id) && t.starts_with('Ġ') && t.chars().count() >= 3
        })
        .unwrap_or_else(|| panic!("no token to end the turn with in {reply:?}"));
    let mut json = json;
    json["added_tokens"].as_array_mut().unwrap().push(json!({
        "id": id, "content": end, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": true,
    }));
    let config = json!({"chat_template": chatml(&end), "eos_token": "<|endoftext|>"});
    let tok = Tokenizer::from_bytes(&serde_json::to_vec(&json).unwrap(), Some(&config)).unwrap();
    (tok, id, k)
}

/// A backend that records every token it feeds (in order), around the CPU reference.
struct Recorder {
    inner: mamba2_wgpu::CpuBackend,
    fed: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
}

impl Backend for Recorder {
    fn config(&self) -> &mamba2_wgpu::config::ModelConfig {
        self.inner.config()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn reset(&mut self) -> mamba2_wgpu::Result<()> {
        self.fed.lock().unwrap().clear();
        self.inner.reset()
    }
    fn prefill_sample(
        &mut self,
        tokens: &[u32],
        sampling: &Sampling,
        pos: u64,
    ) -> mamba2_wgpu::Result<u32> {
        self.fed.lock().unwrap().extend_from_slice(tokens);
        self.inner.prefill_sample(tokens, sampling, pos)
    }
    fn prefill_logits(&mut self, tokens: &[u32]) -> mamba2_wgpu::Result<Vec<Vec<f32>>> {
        self.fed.lock().unwrap().extend_from_slice(tokens);
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
    ) -> mamba2_wgpu::Result<usize> {
        let mut sampled = Vec::new();
        let n = self
            .inner
            .decode(first, pos, max_new, sampling, stop, &mut |t| {
                sampled.push(t);
                on_token(t)
            })?;
        // `first` and every sampled token but the last were fed.
        let mut fed = self.fed.lock().unwrap();
        fed.push(first);
        fed.extend_from_slice(&sampled[..n.saturating_sub(1)]);
        Ok(n)
    }
    fn snapshot(&self) -> mamba2_wgpu::Result<Box<dyn std::any::Any + Send>> {
        self.inner.snapshot()
    }
    fn restore(&mut self, snapshot: &(dyn std::any::Any + Send)) -> mamba2_wgpu::Result<()> {
        self.inner.restore(snapshot)
    }
    fn state(&self) -> mamba2_wgpu::Result<mamba2_wgpu::state::State<f32>> {
        Backend::state(&self.inner)
    }
}

fn cpu_backend(model: &Model) -> mamba2_wgpu::CpuBackend {
    mamba2_wgpu::CpuBackend::new(
        mamba2_wgpu::CpuModel::<f32>::new(&model.config, &model.weights).unwrap(),
    )
}

/// `mamba2 chat` feeds a conversation turn by turn and the server reads it whole from each
/// request (`chat::conversation_tokens`); both go through `chat::input_after`, and here the
/// tokens match: before every turn, what the chat's state has read is exactly the
/// server's prompt for the same messages — without a template (the embedded model) and
/// with one whose replies end on their own end-of-turn token, which also stops the chat's
/// replies (the chat is asked to stop at EOS, as `mamba2 chat` does).
#[test]
fn chat_turns_feed_exactly_the_servers_tokens_for_the_conversation() {
    let (model, plain) = assets::embedded().unwrap();
    let first = "Tell me a fortune";
    // The template's first reply, greedy, to find the token that ends it.
    let mut probe = plain.clone();
    probe.chat_template = Some(chatml(""));
    let prompt =
        mamba2_wgpu::chat::conversation_tokens(&probe, &[("user".to_string(), first.to_string())])
            .unwrap();
    let mut session = Session::new(Box::new(cpu_backend(&model)));
    let greedy = |n: usize, stop: &Tokenizer| GenerateOptions {
        max_new_tokens: n,
        sampling: Sampling::greedy(),
        stop: stop.eos.into_iter().collect(),
    };
    let (reply, _) = session
        .generate(&prompt, &greedy(24, &probe), |_| true)
        .unwrap();
    let (templated, end, k) = tokenizer_with_turn_end(&reply);
    assert_eq!(
        mamba2_wgpu::chat::stop_ids(&templated),
        vec![plain.eos.unwrap(), end]
    );
    assert_eq!(
        mamba2_wgpu::chat::stop_ids(&plain),
        vec![plain.eos.unwrap()]
    );
    for tok in [plain, templated] {
        let with_template = tok.chat_template.is_some();
        let fed = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let backend = Recorder {
            inner: cpu_backend(&model),
            fed: fed.clone(),
        };
        let mut chat = mamba2_wgpu::chat::Chat::new(Session::new(Box::new(backend)), tok);
        for (turn, user) in [first, "Another one", "And a last one"].iter().enumerate() {
            let mut messages = chat.messages.clone();
            messages.push(("user".to_string(), user.to_string()));
            let want = mamba2_wgpu::chat::conversation_tokens(&chat.tokenizer, &messages).unwrap();
            let mut at = None;
            let opts = greedy(24, &chat.tokenizer);
            let r = chat
                .say_with(user, &opts, |e| {
                    if let mamba2_wgpu::chat::TurnEvent::Started { position, .. } = e {
                        at = Some(position);
                    }
                    true
                })
                .unwrap();
            let fed = fed.lock().unwrap();
            assert_eq!(
                at,
                Some(want.len() as u64),
                "turn {turn} (template: {with_template})"
            );
            assert_eq!(
                &fed[..want.len()],
                &want[..],
                "turn {turn} (template: {with_template})"
            );
            if with_template && turn == 0 {
                assert_eq!(r.finish, mamba2_wgpu::session::Finish::Stop);
                assert_eq!(r.tokens, k, "the reply ended at the end-of-turn token");
                assert_eq!(chat.session.pending(), Some(end));
            }
        }
    }
}

/// The server stops a chat reply on the template's end-of-turn token (not the EOS here),
/// as `mamba2 chat` does: `finish_reason: "stop"` after the tokens before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_chat_replies_end_at_the_templates_end_of_turn_token() {
    let (model, plain) = assets::embedded().unwrap();
    let Some(b) = gpu_backend(&model) else { return };
    let messages = [("user".to_string(), "Tell me a fortune".to_string())];
    let mut probe = plain.clone();
    probe.chat_template = Some(chatml(""));
    let prompt = mamba2_wgpu::chat::conversation_tokens(&probe, &messages).unwrap();
    let mut session = Session::new(b);
    let spec = |tok: &Tokenizer| Spec {
        prompt: prompt.clone(),
        max_new: 24,
        sampling: Sampling::greedy(),
        stop_ids: mamba2_wgpu::chat::stop_ids(tok),
    };
    let (reply, _) = tokio::task::block_in_place(|| {
        let s = spec(&probe);
        session.reset().unwrap();
        let opts = GenerateOptions {
            max_new_tokens: s.max_new,
            sampling: s.sampling,
            stop: s.stop_ids.clone(),
        };
        session.generate(&s.prompt, &opts, |_| true).unwrap()
    });
    let (tok, _, k) = tokenizer_with_turn_end(&reply);
    assert_eq!(
        mamba2_wgpu::chat::conversation_tokens(&tok, &messages).unwrap(),
        prompt
    );
    let (want, n) = tokio::task::block_in_place(|| solo(&mut session, &tok, &prompt, &spec(&tok)));
    assert_eq!(n, k);
    let Some(srv) = start(&model, &tok, ServerConfig::default(), None) else {
        return;
    };
    let (status, v) = srv
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Tell me a fortune"}],
                   "max_tokens": 24, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], k, "{v}");
    tokio::task::block_in_place(|| srv.stop());
}
