//! The HTTP routes: OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models`,
//! plus `/health` and `/metrics`. A handler parses and tokenizes the request, refuses what
//! cannot run (400 naming the field, 503 with `Retry-After` when the queue is full; every
//! error, 401, 404, 405 and 413 included, in OpenAI's JSON shape), then
//! hands a `Job` to the engine thread and relays its events, as one JSON body or as
//! server-sent events. A client that goes away drops its receiver; the engine sees that
//! and frees the slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::App;
use super::engine::{Event, FinishReason, Job, Usage};
use super::request::{BadRequest, ChatRequest, Common, CompletionRequest, Lengths};

/// An OpenAI-style error response.
pub fn error(app: &App, status: StatusCode, message: &str, param: Option<&str>) -> Response {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        404 => "not_found_error",
        503 => "server_overloaded",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    count(app, status);
    let body = json!({"error": {"message": message, "type": kind, "param": param, "code": null}});
    let mut r = (status, axum::Json(body)).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

fn count(app: &App, status: StatusCode) {
    let m = &app.metrics;
    let c = match status.as_u16() {
        200..=299 => &m.requests_ok,
        400..=499 => &m.requests_client_error,
        _ => &m.requests_server_error,
    };
    c.fetch_add(1, Ordering::Relaxed);
}

fn bad(app: &App, e: BadRequest) -> Response {
    error(app, StatusCode::BAD_REQUEST, &e.message, e.param.as_deref())
}

/// Refuses a request without the API key (when the server has one).
fn authorize(app: &App, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let Some(key) = &app.config.api_key else {
        return Ok(());
    };
    if super::auth::key_matches(headers, key) {
        Ok(())
    } else {
        Err(Box::new(error(
            app,
            StatusCode::UNAUTHORIZED,
            "a valid API key is required: Authorization: Bearer KEY",
            None,
        )))
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A place among the server's slots and queue (`--slots` + `--queue` of them), taken
/// before a prompt is tokenized (so a full server turns requests away before that work,
/// and no more prompts are tokenized at once than there are places) and held by the
/// engine's job until the reply ends. Holds the counter only, not the `App` (whose job
/// channel holds the jobs).
pub struct Place(Arc<AtomicUsize>);

impl Place {
    /// A place, or the 503 that says the server is busy.
    fn take(app: &App) -> Result<Place, Box<Response>> {
        let limit = app.config.slots.saturating_add(app.config.queue);
        if app
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_err()
        {
            app.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(Box::new(error(
                app,
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is busy: every slot and queue place is taken; retry shortly",
                None,
            )));
        }
        Ok(Place(app.in_flight.clone()))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Which endpoint a response is for.
#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Completion,
}

/// The request's body, read once its key has been checked (a client without the key
/// never makes the server buffer a body), within `DefaultBodyLimit`.
async fn authorized_body(app: &Arc<App>, request: Request) -> Result<Bytes, Box<Response>> {
    authorize(app, request.headers())?;
    let body = Bytes::from_request(request, app).await;
    read_body(app, body)
}

/// The request body, or the error response: a body over the limit is a 413 in the same
/// JSON shape as every other error (axum's own rejection is plain text).
fn read_body(app: &App, body: Result<Bytes, BytesRejection>) -> Result<Bytes, Box<Response>> {
    body.map_err(|e| {
        let status = e.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!(
                "the request body is larger than this server takes ({} bytes)",
                app.config.body_limit
            )
        } else {
            format!("the request body could not be read: {}", e.body_text())
        };
        Box::new(error(app, status, &message, None))
    })
}

pub async fn chat(State(app): State<Arc<App>>, request: Request) -> Response {
    let body = match authorized_body(&app, request).await {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let req = match ChatRequest::parse(&body, lengths(&app), app.next_seed()) {
        Ok(r) => r,
        Err(e) => return bad(&app, e),
    };
    drop(body);
    let messages = req.messages;
    match tokenize(&app, Kind::Chat, move |tok| {
        crate::chat::conversation_tokens(tok, &messages)
    })
    .await
    {
        Ok((prompt, place)) => run(app, Kind::Chat, prompt, req.common, place).await,
        Err(r) => *r,
    }
}

pub async fn completions(State(app): State<Arc<App>>, request: Request) -> Response {
    let body = match authorized_body(&app, request).await {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let req = match CompletionRequest::parse(&body, lengths(&app), app.next_seed()) {
        Ok(r) => r,
        Err(e) => return bad(&app, e),
    };
    drop(body);
    let text = req.prompt;
    match tokenize(&app, Kind::Completion, move |tok| tok.encode(&text)).await {
        Ok((prompt, place)) => run(app, Kind::Completion, prompt, req.common, place).await,
        Err(r) => *r,
    }
}

/// The completion lengths the server's settings allow.
fn lengths(app: &App) -> Lengths {
    Lengths {
        default: app.config.max_tokens,
        most: app.config.max_completion,
    }
}

/// The request's field that holds its prompt.
fn prompt_param(kind: Kind) -> &'static str {
    match kind {
        Kind::Chat => "messages",
        Kind::Completion => "prompt",
    }
}

/// Takes the request's place (or answers 503), then runs `encode` on a blocking thread (a
/// long prompt or a template takes a while), one of at most `App::tokenizing` at once: the
/// token ids and the place, or the error response (400 naming the prompt's field). The
/// blocking task holds the turn and the place until it ends, even where the client hangs
/// up and the request's future is dropped meanwhile (the work goes on, and must still
/// count).
async fn tokenize(
    app: &Arc<App>,
    kind: Kind,
    encode: impl FnOnce(&crate::tokenizer::Tokenizer) -> crate::Result<Vec<u32>> + Send + 'static,
) -> Result<(Vec<u32>, Place), Box<Response>> {
    let place = Place::take(app)?;
    let tok = app.tokenizer.clone();
    // (The semaphore is never closed.)
    let turn = app.tokenizing.clone().acquire_owned().await.ok();
    let work = move || {
        let _turn = turn;
        (encode(&tok), place)
    };
    match tokio::task::spawn_blocking(work).await {
        Ok((Ok(ids), place)) => Ok((ids, place)),
        Ok((Err(e), _)) => Err(Box::new(bad(
            app,
            BadRequest::new(prompt_param(kind), e.to_string()),
        ))),
        Err(e) => Err(Box::new(error(
            app,
            StatusCode::INTERNAL_SERVER_ERROR,
            &e.to_string(),
            None,
        ))),
    }
}

/// Checks the prompt, hands it to the engine with its place and answers.
async fn run(app: Arc<App>, kind: Kind, prompt: Vec<u32>, c: Common, place: Place) -> Response {
    let param = prompt_param(kind);
    if prompt.is_empty() {
        return bad(&app, BadRequest::new(param, "the prompt has no tokens"));
    }
    if let Some(&bad_id) = prompt.iter().find(|&&t| t as usize >= app.vocab) {
        return bad(
            &app,
            BadRequest::new(
                param,
                format!(
                    "token id {bad_id} is outside the model's vocabulary ({})",
                    app.vocab
                ),
            ),
        );
    }
    if prompt.len() > app.config.max_prompt {
        return bad(
            &app,
            BadRequest::new(
                param,
                format!(
                    "the prompt has {} tokens, more than the {} this server takes \
                     (--max-prompt or the context)",
                    prompt.len(),
                    app.config.max_prompt
                ),
            ),
        );
    }
    let (tx, rx) = unbounded_channel();
    let job = Job {
        prompt,
        max_new: c.max_tokens,
        sampling: c.sampling,
        stop_ids: app.stop_ids.clone(),
        stop_text: c.stop.clone(),
        events: tx,
        place: Some(place),
    };
    let sent = app
        .jobs
        .lock()
        .map(|j| j.send(job).is_ok())
        .unwrap_or(false);
    if !sent {
        return error(
            &app,
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is shutting down",
            None,
        );
    }
    let id = format!(
        "{}-{}",
        match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        },
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    if c.stream {
        count(&app, StatusCode::OK);
        stream(app, kind, id, rx, c.include_usage).into_response()
    } else {
        whole(app, kind, id, rx).await
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Waits for the whole reply and answers with one JSON body.
async fn whole(
    app: Arc<App>,
    kind: Kind,
    id: String,
    mut rx: UnboundedReceiver<Event>,
) -> Response {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Error(e) => return error(&app, status_of(&e), &e, None),
            Event::Done { finish, usage } => {
                count(&app, StatusCode::OK);
                let choice = match kind {
                    Kind::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish.name(),
                        "logprobs": null,
                    }),
                    Kind::Completion => json!({
                        "index": 0,
                        "text": text,
                        "finish_reason": finish.name(),
                        "logprobs": null,
                    }),
                };
                let body = json!({
                    "id": id,
                    "object": match kind {
                        Kind::Chat => "chat.completion",
                        Kind::Completion => "text_completion",
                    },
                    "created": now(),
                    "model": app.config.model_name,
                    "choices": [choice],
                    "usage": usage_json(&usage),
                });
                return axum::Json(body).into_response();
            }
        }
    }
    error(
        &app,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the engine stopped before the reply ended",
        None,
    )
}

/// An engine error as an HTTP status: what the request asked for is a 400, the rest 500.
fn status_of(message: &str) -> StatusCode {
    if message.starts_with("invalid input") {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    }
}

/// Streams the reply as server-sent events: OpenAI's chunks, then `[DONE]`.
fn stream(
    app: Arc<App>,
    kind: Kind,
    id: String,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
    let created = now();
    let model = app.config.model_name.clone();
    let chunk = move |delta: Option<&str>, finish: Option<FinishReason>, first: bool| {
        let choice = match kind {
            Kind::Chat => {
                let mut d = serde_json::Map::new();
                if first {
                    d.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = delta {
                    d.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": d, "finish_reason": finish.map(|f| f.name()),
                       "logprobs": null})
            }
            Kind::Completion => json!({"index": 0, "text": delta.unwrap_or(""),
                                       "finish_reason": finish.map(|f| f.name()),
                                       "logprobs": null}),
        };
        json!({
            "id": id,
            "object": match kind {
                Kind::Chat => "chat.completion.chunk",
                Kind::Completion => "text_completion",
            },
            "created": created,
            "model": model,
            "choices": [choice],
        })
    };
    // The state of the stream: the receiver, whether the role chunk went out, what is left
    // to send after the last event.
    struct St {
        rx: UnboundedReceiver<Event>,
        first: bool,
        tail: Vec<String>,
        over: bool,
    }
    let st = St {
        rx,
        first: true,
        tail: Vec::new(),
        over: false,
    };
    let events = futures_util::stream::unfold(st, move |mut st| {
        let chunk = chunk.clone();
        async move {
            if let Some(next) = st.tail.pop() {
                return Some((Ok(SseEvent::default().data(next)), st));
            }
            if st.over {
                return None;
            }
            let data = match st.rx.recv().await {
                Some(Event::Text(t)) => {
                    let c = chunk(Some(&t), None, st.first);
                    st.first = false;
                    c.to_string()
                }
                Some(Event::Done { finish, usage }) => {
                    st.over = true;
                    // Sent in reverse order of the pops above: last chunk, usage, [DONE].
                    st.tail.push("[DONE]".into());
                    if include_usage {
                        let mut u = chunk(None, None, false);
                        u["choices"] = json!([]);
                        u["usage"] = usage_json(&usage);
                        st.tail.push(u.to_string());
                    }
                    // (A reply without text still says whose it is: the role goes in
                    // the last chunk when no chunk carried it.)
                    let last = chunk(None, Some(finish), st.first);
                    last.to_string()
                }
                Some(Event::Error(e)) => {
                    st.over = true;
                    st.tail.push("[DONE]".into());
                    json!({"error": {"message": e, "type": "server_error", "param": null,
                                     "code": null}})
                    .to_string()
                }
                None => return None,
            };
            Some((Ok(SseEvent::default().data(data)), st))
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

pub async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&app, &headers) {
        return *r;
    }
    count(&app, StatusCode::OK);
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": app.config.model_name,
            "object": "model",
            "created": app.started,
            "owned_by": "mamba2-wgpu",
        }],
    }))
    .into_response()
}

pub async fn health(State(app): State<Arc<App>>) -> Response {
    count(&app, StatusCode::OK);
    axum::Json(json!({"status": "ok", "model": app.config.model_name})).into_response()
}

pub async fn metrics(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&app, &headers) {
        return *r;
    }
    count(&app, StatusCode::OK);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        app.metrics.render(),
    )
        .into_response()
}

pub async fn not_found(State(app): State<Arc<App>>) -> Response {
    error(&app, StatusCode::NOT_FOUND, "no such route", None)
}

/// A route asked with a method it does not take (axum adds the `Allow` header).
pub async fn method_not_allowed(State(app): State<Arc<App>>, method: Method) -> Response {
    error(
        &app,
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("this route does not take {method}"),
        None,
    )
}
