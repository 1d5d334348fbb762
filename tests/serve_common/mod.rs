//! Helpers shared by the server tests (`serve_*.rs`): a GPU backend, the engine driven
//! directly with its requests interleaved, a request's solo `generate` to compare with, and
//! a server on 127.0.0.1:0 with the requests and server-sent events its tests read.
#![allow(dead_code)]

use std::sync::mpsc;

use mamba2_wgpu::gpu::context::{DeviceChoice, pick_adapter};
use mamba2_wgpu::model::Model;
use mamba2_wgpu::prefix_cache::{CacheConfig, PrefixCache};
use mamba2_wgpu::sampling::Sampling;
use mamba2_wgpu::server::engine::{Engine, Event, FinishReason, Job, PREFILL_CHUNK};
use mamba2_wgpu::server::{Server, ServerConfig};
use mamba2_wgpu::state_file::StateKey;
use mamba2_wgpu::{Backend, EngineOptions, GenerateOptions, Session, Tokenizer};
use serde_json::{Value, json};

/// A GPU backend for `model`, or None (the test is skipped, loudly) without an adapter;
/// with MAMBA2_REQUIRE_GPU set (CI) a missing adapter fails instead.
pub fn gpu_backend(model: &Model) -> Option<Box<dyn Backend>> {
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

pub fn key(model: &Model) -> StateKey {
    StateKey {
        model: model.fingerprint(),
        format: "test".into(),
        blocks: model.config.pattern(),
    }
}

/// A cache that keeps nothing.
pub fn no_cache(model: &Model) -> PrefixCache {
    let cfg = CacheConfig {
        device_bytes: 0,
        host_bytes: 0,
        dir: None,
        ..Default::default()
    };
    PrefixCache::open(key(model), &model.config, cfg, &mut |_| {}).unwrap()
}

/// The reply text of a solo `generate` from a fresh state, decoded as the server streams it.
pub fn solo(backend: &mut Session, tok: &Tokenizer, prompt: &[u32], job: &Spec) -> (String, usize) {
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
pub struct Spec {
    pub prompt: Vec<u32>,
    pub max_new: usize,
    pub sampling: Sampling,
    pub stop_ids: Vec<u32>,
}

impl Spec {
    /// The engine's job for this request, and where its events go.
    pub fn job(&self) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (events, heard) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt: self.prompt.clone(),
            max_new: self.max_new,
            sampling: self.sampling,
            stop_ids: self.stop_ids.clone(),
            stop_text: Vec::new(),
            events,
            place: None,
        };
        (job, heard)
    }
}

/// The embedded model's tokenizer without its end-of-sequence token: replies run to their
/// `max_tokens` (a stream meant to outlast the test must not end on its own).
pub fn tokenizer_without_eos() -> Tokenizer {
    let (_, mut tok) = mamba2_wgpu::assets::embedded().unwrap();
    tok.eos = None;
    tok.eos_token = None;
    tok
}

/// The CPU reference over `model`.
pub fn cpu_backend(model: &Model) -> mamba2_wgpu::CpuBackend {
    mamba2_wgpu::CpuBackend::new(
        mamba2_wgpu::CpuModel::<f32>::new(&model.config, &model.weights).unwrap(),
    )
}

/// What one job heard: its text, finish and usage.
#[derive(Debug, Clone, PartialEq)]
pub struct Heard {
    pub text: String,
    pub finish: Option<FinishReason>,
    pub completion: usize,
    pub cached: usize,
}

/// Runs `specs` through an engine with `slots` slots (all sent at once, so they
/// interleave), returning what each heard, in order.
pub fn run_engine(
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
        let (job, heard) = s.job();
        tx.send(job).unwrap();
        outs.push(heard);
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

// ---------------------------------------------------------------------------------------
// HTTP

pub struct Running {
    server: Option<Server>,
    pub base: String,
    pub client: reqwest::Client,
    key: Option<String>,
}

impl Running {
    pub fn stop(mut self) {
        self.server.take().unwrap().stop().unwrap();
    }
    /// POSTs `body` as JSON (with the server's API key, if it has one).
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let mut req = self.client.post(format!("{}{path}", self.base)).json(&body);
        if let Some(k) = &self.key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }
    pub async fn raw(&self, path: &str, body: &'static str) -> (u16, Value) {
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
    pub async fn metric(&self, name: &str) -> f64 {
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

pub fn start(
    model: &Model,
    tok: &Tokenizer,
    config: ServerConfig,
    cache: Option<CacheConfig>,
) -> Option<Running> {
    let backend = gpu_backend(model)?;
    Some(start_on(backend, model, tok, config, cache))
}

/// `start_on` the CPU reference of the embedded model, with `tok` (tests of the HTTP front,
/// where the device does not matter).
pub fn start_cpu(tok: &Tokenizer, config: ServerConfig) -> Running {
    let (model, _) = mamba2_wgpu::assets::embedded().unwrap();
    start_on(Box::new(cpu_backend(&model)), &model, tok, config, None)
}

/// `start` over a given backend (the CPU reference's, say).
pub fn start_on(
    backend: Box<dyn Backend>,
    model: &Model,
    tok: &Tokenizer,
    config: ServerConfig,
    cache: Option<CacheConfig>,
) -> Running {
    let api_key = config.api_key.clone();
    let cache = match cache {
        Some(cfg) => PrefixCache::open(key(model), &model.config, cfg, &mut |_| {}).unwrap(),
        None => no_cache(model),
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let server = Server::start(listener, config, backend, tok.clone(), cache).unwrap();
    let base = format!("http://{}", server.addr);
    Running {
        server: Some(server),
        base,
        client: reqwest::Client::new(),
        key: api_key,
    }
}

/// Reads a server-sent-event stream to its end: the `data:` payloads in order.
pub async fn sse(r: reqwest::Response) -> Vec<String> {
    sse_data(&r.text().await.unwrap())
}

pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// The text of a streamed completion: its chunks' `choices[0].text`, which must end with
/// `[DONE]`.
pub fn streamed_text(events: &[String]) -> String {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    events[..events.len() - 1]
        .iter()
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect()
}

pub fn completion_body(prompt: &str, max: usize, seed: Option<u64>, stream: bool) -> Value {
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

/// Greedy, or with `seed` the tests' sampled setting (temperature 0.8, top-k 30).
pub fn sampling(seed: Option<u64>) -> Sampling {
    match seed {
        Some(s) => Sampling {
            temperature: 0.8,
            top_k: 30,
            top_p: 1.0,
            seed: s,
        },
        None => Sampling::greedy(),
    }
}
