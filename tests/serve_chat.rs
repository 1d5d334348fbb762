//! End of turn: the chat template's token, and one conversation engine. `mamba2 chat` feeds
//! exactly the server's prompt for the same conversation, turn by turn, and the server,
//! like the chat, stops a reply at the template's end-of-turn token. The HTTP test runs on
//! lavapipe in CI.

mod serve_common;

use mamba2_wgpu::sampling::Sampling;
use mamba2_wgpu::server::ServerConfig;
use mamba2_wgpu::{Backend, GenerateOptions, Session, Tokenizer, assets};
use serde_json::{Value, json};
use serve_common::{Spec, cpu_backend, gpu_backend, solo, start};

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
