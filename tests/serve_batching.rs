//! The server's batching: interleaved sequences give each request exactly the tokens of its
//! solo `generate`, the engine driven directly with 1, 3 and 8 slots; over HTTP, clients
//! that leave the batch or the queue are counted and change no other reply, and long
//! prompts read in chunks between decoding streams change none either. GPU tests run on
//! lavapipe in CI.

mod common;
mod serve_common;

use std::time::Duration;

use mamba2_wgpu::model::Model;
use mamba2_wgpu::sampling::Sampling;
use mamba2_wgpu::server::ServerConfig;
use mamba2_wgpu::{Session, Tokenizer, assets};
use serde_json::Value;
use serve_common::{
    Running, Spec, completion_body, gpu_backend, no_cache, run_engine, solo, sse_data, start,
    streamed_text, tokenizer_without_eos,
};

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

#[test]
fn interleaved_sequences_equal_their_solo_runs_moe() {
    // Granite-4.0-H's layer (softmax router, gated experts, shared MLP) and Nemotron-H's
    // (grouped sigmoid router, relu² experts, shared expert; and with a latent around the
    // experts): their replies decoded as a batch, as the log of `serve` says ("batched
    // decode: N slots").
    let (_, tok) = assets::embedded().unwrap();
    for fixture in ["granite_moe_hybrid", "nemotron_h_moe", "nemotron_h_latent"] {
        let model = Model::load(&common::fixture(fixture)).unwrap();
        // (What the server's engine does first: with a batch, replies decode together.)
        let Some(mut b) = gpu_backend(&model) else {
            return;
        };
        let gpu = b.gpu().expect("a GPU backend");
        gpu.enable_batch(8).unwrap();
        gpu.batch.as_mut().unwrap().prepare(&gpu.engine).unwrap();
        interleaved_equals_solo(&model, &tok, None);
    }
}

// ---------------------------------------------------------------------------------------
// HTTP

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
        sampling: serve_common::sampling(seed),
        stop_ids: mamba2_wgpu::chat::stop_ids(tok),
    };
    solo(session, tok, &spec.prompt, &spec).0
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
