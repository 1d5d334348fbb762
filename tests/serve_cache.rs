//! The prefix cache and state files: a follow-up feeds only what is new and replies as a
//! fresh run does, an entry is kept every N prompt tokens, cache files survive a restart
//! and refuse another model's, and saved states round-trip and refuse bad headers; over
//! HTTP, the API key, and a cached prefix reported in `usage` across a restart. GPU tests
//! run on lavapipe in CI.

mod common;
mod serve_common;

use mamba2_wgpu::model::Model;
use mamba2_wgpu::prefix_cache::{CacheConfig, PrefixCache};
use mamba2_wgpu::sampling::Sampling;
use mamba2_wgpu::server::ServerConfig;
use mamba2_wgpu::state_file::{self, SavedState, StateDtype};
use mamba2_wgpu::{Session, assets};
use serde_json::{Value, json};
use serve_common::{Spec, gpu_backend, key, run_engine, solo, start};

/// A follow-up that extends a cached prompt feeds only the new tokens and produces what a
/// fresh run produces.
#[test]
fn prefix_cache_feeds_only_new_tokens_and_changes_nothing() {
    let (model, tok) = assets::embedded().unwrap();
    let base: Vec<u32> = tok
        .encode("The quick brown fox jumps over the lazy dog.")
        .unwrap();
    let mut longer = base.clone();
    longer.extend(tok.encode_with(" Then it sat down and", false).unwrap());
    let cfgs = [
        // Device snapshots.
        CacheConfig::default(),
        // Host memory only (f32).
        CacheConfig {
            device_bytes: 0,
            ..Default::default()
        },
    ];
    follow_up_resumes_like_a_fresh_run(&model, &tok, &base, &longer, cfgs);
}

/// The same on a hybrid: its cached states hold the attention layers' KV rows too, from a
/// device snapshot, from host memory, or from a file.
#[test]
fn prefix_cache_resumes_a_hybrid_with_its_kv_rows() {
    let model = Model::load(&common::fixture("nemotron_h_hybrid")).unwrap();
    // The fixture has no tokenizer; its ids decode through the embedded one (the texts
    // compared are a readable form of the ids).
    let (_, tok) = assets::embedded().unwrap();
    let vocab = model.config.vocab_size as u64;
    let ids = |n: u64, seed: u64| -> Vec<u32> {
        (0..n)
            .map(|i| ((i * 37 + seed * 11 + i * i) % vocab) as u32)
            .collect()
    };
    let base = ids(40, 1);
    let mut longer = base.clone();
    longer.extend(ids(9, 5));
    let dir = tempdir("hybrid-resume");
    let cfgs = [
        CacheConfig::default(),
        CacheConfig {
            device_bytes: 0,
            ..Default::default()
        },
        CacheConfig {
            device_bytes: 0,
            host_bytes: 1,
            dir: Some(dir.to_path_buf()),
            ..Default::default()
        },
    ];
    follow_up_resumes_like_a_fresh_run(&model, &tok, &base, &longer, cfgs);
}

/// Under each cache config, `base` then `longer` (which extends it) through one slot: the
/// second resumes at the first's end and replies as a fresh run of `longer` does.
fn follow_up_resumes_like_a_fresh_run<const N: usize>(
    model: &Model,
    tok: &mamba2_wgpu::Tokenizer,
    base: &[u32],
    longer: &[u32],
    cfgs: [CacheConfig; N],
) {
    let Some(b) = gpu_backend(model) else { return };
    let mut solo_session = Session::new(b);
    let spec = |prompt: &[u32]| Spec {
        prompt: prompt.to_vec(),
        max_new: 12,
        sampling: Sampling::greedy(),
        stop_ids: Vec::new(),
    };
    let want = solo(&mut solo_session, tok, longer, &spec(longer));
    for cfg in cfgs {
        let what = format!("{cfg:?}");
        let cache = PrefixCache::open(key(model), &model.config, cfg, &mut |_| {}).unwrap();
        let backend = gpu_backend(model).unwrap();
        let heard = run_engine(backend, tok, cache, 1, &[spec(base), spec(longer)]);
        assert_eq!(heard[0].cached, 0, "{what}");
        assert_eq!(
            heard[1].cached,
            base.len(),
            "{what}: the second request resumes at the first's end"
        );
        assert_eq!(heard[1].text, want.0, "{what}");
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
        dir: Some(dir.to_path_buf()),
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
    // Forged headers: a position past what a sequence can reach, a position of 0 beside a
    // state that holds fed tokens, token ids outside the vocabulary.
    state_file::save(&path, &k, &saved, StateDtype::F32, c).unwrap();
    let forge = |fields: &[(&str, &str)]| {
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (key, value) in fields {
            header["__metadata__"][key] = serde_json::Value::String(value.to_string());
        }
        let text = serde_json::to_vec(&header).unwrap();
        let forged = dir.join("forged.safetensors");
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend(&text);
        out.extend(&bytes[8 + n..]);
        std::fs::write(&forged, out).unwrap();
        state_file::load(&forged, &k, c).unwrap_err().to_string()
    };
    // (A position without its token list: the list's length must match the position.)
    let position = |p: &'static str| vec![("mamba2.position", p), ("mamba2.tokens", "")];
    for (fields, key, says) in [
        (
            position("4294967295"),
            "mamba2.position",
            "more than the 2147483647",
        ),
        (
            position("2147483648"),
            "mamba2.position",
            "more than the 2147483647",
        ),
        (
            position("0"),
            "mamba2.position",
            "is 0 but the state holds fed tokens",
        ),
        (
            vec![("mamba2.tokens", "4,5,999")],
            "mamba2.tokens",
            "token id 999 is outside the model's vocabulary",
        ),
    ] {
        let err = forge(&fields);
        assert!(
            err.contains(says) && err.contains(key) && err.contains("forged.safetensors"),
            "{fields:?}: {err}"
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

fn tempdir(name: &str) -> common::Scratch {
    common::Scratch::new(&format!("serve-{name}"))
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
        dir: Some(dir.to_path_buf()),
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
