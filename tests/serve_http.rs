//! The server's HTTP front, with reqwest on 127.0.0.1:0: replies equal their solo
//! `generate`, streamed or not and concurrently; every bad request gets a clear
//! OpenAI-style error, a full queue a 503, and a client that vanishes mid-stream frees its
//! slot; stop strings end the reply right before them. GPU tests run on lavapipe in CI.

mod serve_common;

use std::time::Duration;

use mamba2_wgpu::server::ServerConfig;
use mamba2_wgpu::{Session, assets};
use serde_json::{Value, json};
use serve_common::{Spec, completion_body, gpu_backend, solo, sse, start, streamed_text};

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
                    sampling: serve_common::sampling(seed),
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

/// A hybrid's KV caches hold the context it was opened with (256 here): a longer prompt is
/// refused with a 400 that says so, and a reply that reaches the end of the context ends
/// there with `finish_reason: "length"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_holds_a_hybrid_to_its_context() {
    let (embedded, _) = assets::embedded().unwrap();
    // No end-of-sequence token: the reply can only end at the context.
    let tok = serve_common::tokenizer_without_eos();
    let mut config = mamba2_wgpu::model::synthetic::tiny_hybrid("M*M", 2);
    config.vocab_size = embedded.config.vocab_size;
    let model = mamba2_wgpu::model::Model::synthetic(config, 7);
    let Some(srv) = start(&model, &tok, ServerConfig::default(), None) else {
        return;
    };
    // A prompt of `n` tokens or just under: words until the next would pass `n`.
    let prompt_of = |n: usize| {
        let mut text = String::from("Once");
        for i in 0.. {
            let next = format!("{text} {}", ["upon", "a", "time", "there"][i % 4]);
            if tok.encode(&next).unwrap().len() > n {
                break;
            }
            text = next;
        }
        (tok.encode(&text).unwrap().len(), text)
    };
    let (over, text) = prompt_of(300);
    assert!(over > 256);
    let (status, v) = srv
        .post("/v1/completions", json!({"prompt": text, "max_tokens": 4}))
        .await;
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("the prompt has {over} tokens, more than the 255")),
        "{msg}"
    );
    let (p, text) = prompt_of(250);
    assert!(p > 240, "{p}");
    let (status, v) = srv
        .post(
            "/v1/completions",
            json!({"prompt": text, "max_tokens": 40, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], p, "{v}");
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert!(
        (1..=256 + 1 - p).contains(&completion),
        "{completion} tokens after a {p}-token prompt in a 256-token context"
    );
    tokio::task::block_in_place(|| srv.stop());
}

/// A client that opens connections and never finishes a request holds none of them past
/// the timeouts: silent, with half a request head, or with half a body (answered 400 as an
/// unreadable body). Meanwhile and afterwards a real request is served. (CPU backend: this
/// is about the HTTP front.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_closes_connections_that_never_finish_a_request() {
    use std::io::{Read, Write};
    let (_, tok) = assets::embedded().unwrap();
    let srv = serve_common::start_cpu(
        &tok,
        ServerConfig {
            header_timeout: Duration::from_secs(1),
            body_timeout: Duration::from_secs(1),
            ..Default::default()
        },
    );
    let addr = srv.base.trim_start_matches("http://").to_string();
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";
    let cases: [(&str, String); 3] = [
        ("silent", String::new()),
        (
            "half a head",
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\n".into(),
        ),
        (
            "half a body",
            format!("{head}Content-Length: 100\r\n\r\n{{\"prompt\": "),
        ),
    ];
    let stalled: Vec<_> = cases
        .iter()
        .map(|(what, sent)| {
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            s.write_all(sent.as_bytes()).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            (what, s)
        })
        .collect();
    // A real request while they stall, and after (from a new client then: the first
    // one's kept-alive connection has been idle past the head timeout and closed, as an
    // idle connection is).
    let served = |client: reqwest::Client| {
        let url = format!("{}/v1/completions", srv.base);
        async move {
            let body = json!({"prompt": "Once", "max_tokens": 2});
            let r = client.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
        }
    };
    served(srv.client.clone()).await;
    for (what, mut s) in stalled {
        let started = std::time::Instant::now();
        let mut got = Vec::new();
        // The server answers (the body's 400) and closes, or closes: read ends either way.
        let end = tokio::task::block_in_place(|| s.read_to_end(&mut got));
        let waited = started.elapsed();
        assert!(end.is_ok(), "{what}: still open after {waited:?}: {end:?}");
        assert!(
            waited < Duration::from_secs(15),
            "{what}: closed after {waited:?}"
        );
        let text = String::from_utf8_lossy(&got);
        if *what == "half a body" {
            assert!(
                text.starts_with("HTTP/1.1 400") && text.contains("could not be read"),
                "{what}: {text}"
            );
        }
    }
    served(reqwest::Client::new()).await;
    tokio::task::block_in_place(|| srv.stop());
}

/// A stop waits for the replies in flight at most `shutdown_grace`: a client that asked for
/// a long stream and stopped reading it (its socket buffers full, the server's writes
/// blocked) no longer holds the stop for ever; its connection is closed. (CPU backend.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stop_closes_a_stream_its_client_stopped_reading_after_the_grace() {
    use std::io::{Read, Write};
    // No end-of-text token: the stream runs to its max_tokens.
    let tok = serve_common::tokenizer_without_eos();
    let srv = serve_common::start_cpu(
        &tok,
        ServerConfig {
            shutdown_grace: Duration::from_secs(1),
            ..Default::default()
        },
    );
    let addr = srv.base.trim_start_matches("http://").to_string();
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 60000, "stream": true}).to_string();
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The stream has started; from here the client reads nothing.
    let mut first = [0u8; 12];
    s.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    tokio::task::block_in_place(|| srv.stop());
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(15),
        "the stop waited {waited:?} for a client that does not read (grace: 1 s)"
    );
    // The connection was closed: reading drains what was sent and ends.
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut rest = Vec::new();
    let end = s.read_to_end(&mut rest);
    assert!(end.is_ok(), "still open: {end:?}");
}

/// A client that sends its request and then closes its side for writing (`nc -N`, some
/// proxies) still gets the reply; a body announced larger than the server takes is refused
/// (413) at once, not after the body deadline. (CPU backend: this is about the HTTP front.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_answers_half_closed_clients_and_refuses_oversized_bodies_at_once() {
    use std::io::{Read, Write};
    let (_, tok) = assets::embedded().unwrap();
    let srv = serve_common::start_cpu(&tok, ServerConfig::default());
    let addr = srv.base.trim_start_matches("http://").to_string();
    let exchange = |request: &[u8], half_close: bool| -> (String, Duration) {
        let started = std::time::Instant::now();
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(request).unwrap();
        if half_close {
            s.shutdown(std::net::Shutdown::Write).unwrap();
        }
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        (
            String::from_utf8_lossy(&got).into_owned(),
            started.elapsed(),
        )
    };
    let health = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let body = json!({"prompt": "Once", "max_tokens": 2}).to_string();
    let completion = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::task::block_in_place(|| {
        let (reply, _) = exchange(health, false);
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        let (reply, _) = exchange(completion.as_bytes(), false);
        assert!(
            reply.starts_with("HTTP/1.1 200") && reply.contains("\"choices\""),
            "{reply}"
        );
        let (reply, _) = exchange(completion.as_bytes(), true);
        assert!(reply.is_empty(), "a client that closed its side: {reply}");
        let huge = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\
            Content-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n{\"pro";
        let (reply, took) = exchange(huge, false);
        assert!(
            reply.starts_with("HTTP/1.1 413") && reply.contains("99999999999 announced"),
            "{reply}"
        );
        assert!(took < Duration::from_secs(10), "the 413 took {took:?}");
    });
    tokio::task::block_in_place(|| srv.stop());
}

/// With `--api-key`, a request without the key is refused (401) before its body is read: a
/// client announcing a megabyte and sending none of it gets its answer at once, instead of
/// the server buffering (or waiting for) a body it will not use. (CPU backend.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_without_the_key_is_refused_before_its_body_is_read() {
    use std::io::{Read, Write};
    let (_, tok) = assets::embedded().unwrap();
    let srv = serve_common::start_cpu(
        &tok,
        ServerConfig {
            api_key: Some("sekrit".into()),
            ..Default::default()
        },
    );
    let addr = srv.base.trim_start_matches("http://").to_string();
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Authorization: Bearer sekrix\r\nContent-Length: 1000000\r\n\r\n",
        )
        .unwrap();
        let started = std::time::Instant::now();
        let mut head = [0u8; 12];
        let read = s.read_exact(&mut head);
        (read.map(|_| head), started.elapsed())
    })
    .await
    .unwrap();
    let (head, took) = answer;
    assert_eq!(&head.expect("an answer without the body"), b"HTTP/1.1 401");
    assert!(took < Duration::from_secs(10), "{took:?}");
    srv.stop();
}

/// A streamed chat reply without any text (a stop string its first token's text starts
/// with) still names its role: the last chunk's delta carries `role: assistant` when no
/// chunk before it did. (CPU backend.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_empty_streamed_chat_reply_still_names_its_role() {
    let (_, tok) = assets::embedded().unwrap();
    let srv = serve_common::start_cpu(&tok, ServerConfig::default());
    let ask = |stop: Option<String>, stream: bool| {
        let mut b = json!({"messages": [{"role": "user", "content": "Tell me a story"}],
                           "max_tokens": 4, "temperature": 0, "stream": stream});
        if let Some(s) = stop {
            b["stop"] = json!([s]);
        }
        b
    };
    let (status, whole) = srv.post("/v1/chat/completions", ask(None, false)).await;
    assert_eq!(status, 200, "{whole}");
    let text = whole["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let first = text.chars().next().expect("a greedy reply with text");
    let r = srv
        .client
        .post(format!("{}/v1/chat/completions", srv.base))
        .json(&ask(Some(first.to_string()), true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let events = sse(r).await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert!(
        deltas
            .iter()
            .all(|d| d.get("content").is_none_or(|c| c == "")),
        "the reply was to be empty: {events:?}"
    );
    assert_eq!(
        deltas.iter().filter(|d| d["role"] == "assistant").count(),
        1,
        "{events:?}"
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop",
        "{events:?}"
    );
    srv.stop();
}

/// A write timeout the server's timer cannot hold (past the clock's range, where the timer
/// would panic the connection's task; or 0, which fails every write that waits) is refused
/// when the server starts, naming the field.
#[test]
fn a_write_timeout_out_of_range_is_refused_at_start() {
    let (model, tok) = assets::embedded().unwrap();
    for t in [Duration::ZERO, Duration::MAX, Duration::from_secs(86_401)] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let r = mamba2_wgpu::server::Server::start(
            listener,
            ServerConfig {
                write_timeout: t,
                ..Default::default()
            },
            Box::new(serve_common::cpu_backend(&model)),
            tok.clone(),
            serve_common::no_cache(&model),
        );
        let e = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("write_timeout"), "{t:?}: {e}");
    }
}
