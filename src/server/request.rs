//! Parsing OpenAI-style request bodies by hand from JSON values, so that every refusal
//! names its field (`messages[2].content: expected a string`) in an OpenAI error body.
//! Fields this server does not use are ignored, as OpenAI's clients send many; fields it
//! uses must have the right type and a meaningful value; fields that ask for what it does
//! not do (penalties, logit biases, tools, a JSON response format) are refused unless they
//! hold their no-op values.

use serde_json::{Map, Value};

use crate::sampling::Sampling;

/// A refused request: the message and the field at fault.
#[derive(Debug, Clone)]
pub struct BadRequest {
    pub message: String,
    pub param: Option<String>,
}

impl BadRequest {
    pub fn new(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        BadRequest {
            message: format!("{param}: {}", message.into()),
            param: Some(param),
        }
    }
    pub fn body(message: impl Into<String>) -> Self {
        BadRequest {
            message: message.into(),
            param: None,
        }
    }
}

type Parsed<T> = Result<T, BadRequest>;

/// What both endpoints share.
#[derive(Clone, Debug)]
pub struct Common {
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

/// The body of `/v1/chat/completions`.
#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub messages: Vec<(String, String)>,
    pub common: Common,
}

/// The body of `/v1/completions`.
#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub prompt: String,
    pub common: Common,
}

/// The completion lengths a server allows: what a request that gives none gets, and the
/// most any may ask for (a slot stays taken until its reply ends: a model without a
/// context limit would otherwise decode a huge `max_tokens` until the client leaves).
#[derive(Clone, Copy, Debug)]
pub struct Lengths {
    pub default: usize,
    pub most: usize,
}

/// Most stop strings a request may give (OpenAI allows 4).
const MAX_STOPS: usize = 16;

/// Longest stop string, in bytes: every generated token searches the held-back text for
/// each stop string on the engine thread that all streams share, at a cost that grows with
/// the string (one 16 MiB stop string cost 51 ms per token), so a long one would slow every
/// other client.
const MAX_STOP_BYTES: usize = 1024;

/// A stop string of at most MAX_STOP_BYTES, or the refusal naming `field`.
fn stop_string(field: String, s: &str) -> Parsed<String> {
    if s.len() > MAX_STOP_BYTES {
        return Err(BadRequest::new(
            field,
            format!(
                "a stop string of {} bytes: at most {MAX_STOP_BYTES}",
                s.len()
            ),
        ));
    }
    Ok(s.to_string())
}

fn object(body: &[u8]) -> Parsed<Map<String, Value>> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| BadRequest::body(format!("the body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(BadRequest::body("the body must be a JSON object")),
    }
}

fn opt_f32(m: &Map<String, Value>, key: &str) -> Parsed<Option<f32>> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_f64() {
            // Said in the number's own terms where f32 cannot hold it (1e300 would be
            // reported as inf, 1e-300 as 0).
            Some(x) if x.is_finite() => crate::sampling::narrow_f32(x)
                .map(Some)
                .map_err(|why| BadRequest::new(key, format!("{x:e} {why}"))),
            _ => Err(BadRequest::new(key, "expected a finite number")),
        },
        Some(_) => Err(BadRequest::new(key, "expected a number")),
    }
}

fn opt_u64(m: &Map<String, Value>, key: &str) -> Parsed<Option<u64>> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| BadRequest::new(key, "expected a non-negative integer")),
        Some(_) => Err(BadRequest::new(key, "expected an integer")),
    }
}

fn opt_bool(m: &Map<String, Value>, key: &str) -> Parsed<Option<bool>> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(BadRequest::new(key, "expected true or false")),
    }
}

/// Fields whose asked-for effect this server does not have: refused when they ask for it
/// (a client would otherwise get a reply that silently ignores them), accepted at their
/// no-op values, which many clients send by default.
fn unsupported(m: &Map<String, Value>) -> Parsed<()> {
    for key in ["frequency_penalty", "presence_penalty"] {
        if opt_f32(m, key)?.is_some_and(|p| p != 0.0) {
            return Err(BadRequest::new(key, "penalties are not supported (only 0)"));
        }
    }
    let asks = |key: &str| match m.get(key) {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    if asks("logit_bias") {
        return Err(BadRequest::new(
            "logit_bias",
            "logit biases are not supported",
        ));
    }
    for key in ["tools", "functions"] {
        if asks(key) {
            return Err(BadRequest::new(
                key,
                "tool and function calls are not supported",
            ));
        }
    }
    if opt_u64(m, "best_of")?.is_some_and(|n| n > 1) {
        return Err(BadRequest::new("best_of", "only best_of = 1 is supported"));
    }
    if m.get("suffix")
        .is_some_and(|v| v.as_str().is_none_or(|t| !t.is_empty()) && !v.is_null())
    {
        return Err(BadRequest::new(
            "suffix",
            "a suffix (insertion) is not supported",
        ));
    }
    // With no tools there is nothing to choose: only "none" and "auto" mean what this
    // server does.
    if let Some(c) = m.get("tool_choice")
        && !c.is_null()
        && !matches!(c.as_str(), Some("none" | "auto"))
    {
        return Err(BadRequest::new(
            "tool_choice",
            "tool and function calls are not supported (only \"none\" or \"auto\")",
        ));
    }
    if let Some(f) = m.get("response_format")
        && !f.is_null()
        && f.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(BadRequest::new(
            "response_format",
            "only {\"type\": \"text\"} is supported",
        ));
    }
    Ok(())
}

fn common(m: &Map<String, Value>, lengths: Lengths, default_seed: u64) -> Parsed<Common> {
    if let Some(model) = m.get("model")
        && !model.is_string()
    {
        return Err(BadRequest::new("model", "expected a string"));
    }
    if let Some(n) = opt_u64(m, "n")?
        && n != 1
    {
        return Err(BadRequest::new("n", "only n = 1 is supported"));
    }
    // `logprobs`: a bool (chat) or, in the legacy completions API, how many to return; 0
    // or false asks for none.
    let logprobs = match m.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64() != Some(0),
        Some(_) => {
            return Err(BadRequest::new(
                "logprobs",
                "expected true or false (or a count, in completions)",
            ));
        }
    };
    if logprobs {
        return Err(BadRequest::new(
            "logprobs",
            "log-probabilities are not supported",
        ));
    }
    if opt_bool(m, "echo")? == Some(true) {
        return Err(BadRequest::new(
            "echo",
            "echoing the prompt is not supported",
        ));
    }
    unsupported(m)?;
    let max = match (
        opt_u64(m, "max_completion_tokens")?,
        opt_u64(m, "max_tokens")?,
    ) {
        (Some(n), _) => ("max_completion_tokens", n),
        (None, Some(n)) => ("max_tokens", n),
        (None, None) => ("max_tokens", lengths.default as u64),
    };
    if max.1 == 0 {
        return Err(BadRequest::new(max.0, "must be at least 1"));
    }
    if max.1 > lengths.most as u64 {
        return Err(BadRequest::new(
            max.0,
            format!(
                "{} tokens: this server gives at most {} (--max-completion)",
                max.1, lengths.most
            ),
        ));
    }
    let max_tokens = usize::try_from(max.1).unwrap_or(usize::MAX);
    let sampling = Sampling {
        temperature: opt_f32(m, "temperature")?.unwrap_or(1.0),
        top_p: opt_f32(m, "top_p")?.unwrap_or(1.0),
        top_k: opt_u64(m, "top_k")?.map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX)),
        seed: match m.get("seed") {
            None | Some(Value::Null) => default_seed,
            // OpenAI's seeds may be negative: keep their bits.
            Some(Value::Number(n)) => n
                .as_u64()
                .or_else(|| n.as_i64().map(|i| i as u64))
                .ok_or_else(|| BadRequest::new("seed", "expected an integer"))?,
            Some(_) => return Err(BadRequest::new("seed", "expected an integer")),
        },
    };
    if let Some((field, why)) = sampling.problem() {
        let field = if field == "top-p" { "top_p" } else { field };
        return Err(BadRequest::new(field, why));
    }
    let stop = match m.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![stop_string("stop".into(), s)?],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOPS {
                return Err(BadRequest::new(
                    "stop",
                    format!("at most {MAX_STOPS} stop strings, found {}", a.len()),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some(s) => stop_string(format!("stop[{i}]"), s),
                    None => Err(BadRequest::new(format!("stop[{i}]"), "expected a string")),
                })
                .collect::<Parsed<_>>()?
        }
        Some(_) => {
            return Err(BadRequest::new(
                "stop",
                "expected a string or an array of strings",
            ));
        }
    };
    let stream = opt_bool(m, "stream")?.unwrap_or(false);
    let include_usage = match m.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")
            .map_err(|_| BadRequest::new("stream_options.include_usage", "expected true or false"))?
            .unwrap_or(false),
        Some(_) => return Err(BadRequest::new("stream_options", "expected an object")),
    };
    Ok(Common {
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
    })
}

/// A message's content: a string, or an array of text parts.
fn content(v: &Value, at: &str) -> Parsed<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                let at = format!("{at}[{j}]");
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (Some("text"), None) => {
                        return Err(BadRequest::new(format!("{at}.text"), "expected a string"));
                    }
                    _ => {
                        return Err(BadRequest::new(
                            format!("{at}.type"),
                            "only text parts are supported",
                        ));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(BadRequest::new(
            at,
            "expected a string or an array of text parts",
        )),
    }
}

impl ChatRequest {
    pub fn parse(body: &[u8], lengths: Lengths, default_seed: u64) -> Parsed<Self> {
        let m = object(body)?;
        let messages = match m.get("messages") {
            Some(Value::Array(a)) if a.is_empty() => {
                return Err(BadRequest::new("messages", "the message list is empty"));
            }
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, msg)| {
                    let at = format!("messages[{i}]");
                    let Value::Object(o) = msg else {
                        return Err(BadRequest::new(at, "expected an object"));
                    };
                    let role = match o.get("role") {
                        Some(Value::String(r)) => r.clone(),
                        _ => {
                            return Err(BadRequest::new(format!("{at}.role"), "expected a string"));
                        }
                    };
                    let text = match o.get("content") {
                        Some(v) => content(v, &format!("{at}.content"))?,
                        None => {
                            return Err(BadRequest::new(format!("{at}.content"), "missing"));
                        }
                    };
                    Ok((role, text))
                })
                .collect::<Parsed<Vec<_>>>()?,
            Some(_) => return Err(BadRequest::new("messages", "expected an array")),
            None => return Err(BadRequest::new("messages", "missing")),
        };
        Ok(ChatRequest {
            messages,
            common: common(&m, lengths, default_seed)?,
        })
    }
}

impl CompletionRequest {
    pub fn parse(body: &[u8], lengths: Lengths, default_seed: u64) -> Parsed<Self> {
        let m = object(body)?;
        let prompt = match m.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                a[0].as_str().unwrap_or_default().to_string()
            }
            Some(Value::Array(a)) if a.iter().any(Value::is_number) => {
                return Err(BadRequest::new(
                    "prompt",
                    "prompts as token ids are not supported: send the text",
                ));
            }
            Some(Value::Array(_)) => {
                return Err(BadRequest::new(
                    "prompt",
                    "only one prompt string per request",
                ));
            }
            Some(_) => return Err(BadRequest::new("prompt", "expected a string")),
            None => return Err(BadRequest::new("prompt", "missing")),
        };
        if prompt.is_empty() {
            return Err(BadRequest::new("prompt", "the prompt is empty"));
        }
        Ok(CompletionRequest {
            prompt,
            common: common(&m, lengths, default_seed)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{ChatRequest, CompletionRequest, Lengths};

    const LENGTHS: Lengths = Lengths {
        default: 16,
        most: 100,
    };

    #[test]
    fn refusals_name_their_field() {
        let bad = |body: &str| {
            ChatRequest::parse(body.as_bytes(), LENGTHS, 0)
                .unwrap_err()
                .message
        };
        assert!(bad("{").contains("not valid JSON"));
        assert!(bad("[]").contains("JSON object"));
        assert!(bad(r#"{"messages": []}"#).contains("messages: the message list is empty"));
        assert!(
            bad(r#"{"messages": [{"role": "user", "content": 3}]}"#)
                .contains("messages[0].content")
        );
        assert!(
            bad(r#"{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}"#)
                .contains("temperature: expected a number")
        );
        assert!(
            bad(r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}"#)
                .contains("max_tokens: must be at least 1")
        );
        assert!(
            bad(r#"{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}"#)
                .contains("top_p")
        );
        assert!(
            bad(r#"{"messages": [{"role": "user", "content": "hi"}], "stop": [1]}"#)
                .contains("stop[0]")
        );
        let long = "x".repeat(super::MAX_STOP_BYTES + 1);
        let body = format!(
            r#"{{"messages": [{{"role": "user", "content": "hi"}}], "stop": ["ok", "{long}"]}}"#
        );
        assert!(bad(&body).contains("stop[1]: a stop string of 1025 bytes"));
        let body =
            format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], "stop": "{long}"}}"#);
        assert!(bad(&body).contains("stop: a stop string"));
        assert!(
            bad(r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 101}"#)
                .contains("max_tokens: 101 tokens: this server gives at most 100")
        );
        assert!(
            bad(
                r#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1e3}"#
            )
            .contains("max_completion_tokens")
        );
        let ok = ChatRequest::parse(
            br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "unknown": {"deep": 1}, "seed": -1, "stop": "x", "stream": true}"#,
            LENGTHS,
            0,
        )
        .unwrap();
        assert_eq!(ok.messages, vec![("user".to_string(), "hi".to_string())]);
        assert_eq!(ok.common.sampling.seed, u64::MAX);
        assert_eq!(ok.common.max_tokens, 16);
        assert!(ok.common.stream);
        let bad = |body: &str| {
            CompletionRequest::parse(body.as_bytes(), LENGTHS, 0)
                .unwrap_err()
                .message
        };
        assert!(bad(r#"{"prompt": ""}"#).contains("prompt: the prompt is empty"));
        assert!(bad(r#"{"prompt": ["a", "b"]}"#).contains("one prompt"));
        assert!(bad(r#"{"prompt": "a", "n": 2}"#).contains("n: only n = 1"));
        for (body, want) in [
            (
                r#"{"prompt": "a", "frequency_penalty": 1e9}"#,
                "frequency_penalty: penalties",
            ),
            (
                r#"{"prompt": "a", "presence_penalty": -0.5}"#,
                "presence_penalty: penalties",
            ),
            (
                r#"{"prompt": "a", "presence_penalty": "x"}"#,
                "presence_penalty: expected a number",
            ),
            (
                r#"{"prompt": "a", "logit_bias": {"7": 100}}"#,
                "logit_bias: logit biases",
            ),
            (
                r#"{"prompt": "a", "tools": [{"type": "function"}]}"#,
                "tools: tool and function",
            ),
            (
                r#"{"prompt": "a", "response_format": {"type": "json_object"}}"#,
                "response_format: only",
            ),
            (
                r#"{"prompt": "a", "best_of": 3}"#,
                "best_of: only best_of = 1",
            ),
            (r#"{"prompt": "a", "suffix": "end"}"#, "suffix: a suffix"),
            (
                r#"{"prompt": "a", "tool_choice": "required"}"#,
                "tool_choice: tool and function calls",
            ),
            (
                r#"{"prompt": "a", "logprobs": 2}"#,
                "logprobs: log-probabilities are not supported",
            ),
            (
                r#"{"prompt": "a", "logprobs": "x"}"#,
                "logprobs: expected true or false",
            ),
            (
                r#"{"prompt": [1, 2, 3]}"#,
                "prompt: prompts as token ids are not supported",
            ),
            (
                r#"{"prompt": "a", "temperature": 1e300}"#,
                "temperature: 1e300 is beyond f32's range",
            ),
            (
                r#"{"prompt": "a", "top_p": 1e-300}"#,
                "top_p: 1e-300 is below f32's range",
            ),
        ] {
            assert!(bad(body).contains(want), "{body}: {}", bad(body));
        }
        // The no-op values clients send by default are accepted.
        let defaults = r#"{"prompt": "a", "frequency_penalty": 0, "presence_penalty": 0.0,
               "logit_bias": {}, "tools": [], "response_format": {"type": "text"},
               "best_of": 1, "suffix": null, "tool_choice": "none", "logprobs": 0}"#;
        assert!(CompletionRequest::parse(defaults.as_bytes(), LENGTHS, 0).is_ok());
    }
}
