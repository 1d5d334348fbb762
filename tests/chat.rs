//! Conversations: each turn feeds only its new tokens, and the result equals reading the
//! whole conversation at once; regenerate restores the state before the reply.

use mamba2_wgpu::chat::Chat;
use mamba2_wgpu::{CpuBackend, CpuModel, Finish, GenerateOptions, Session, assets};

fn chat(template: Option<&str>) -> Chat {
    let (model, mut tok) = assets::embedded().unwrap();
    tok.chat_template = template.map(str::to_string);
    let session = Session::new(Box::new(CpuBackend::new(
        CpuModel::<f32>::new(&model.config, &model.weights).unwrap(),
    )));
    Chat::new(session, tok)
}

fn greedy(n: usize, stop: Option<u32>) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: n,
        stop: stop.into_iter().collect(),
        ..Default::default()
    }
}

#[test]
fn template_turns_feed_only_new_tokens_and_match_one_read() {
    let template = "{% for m in messages %}<|endoftext|>{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}";
    let mut c = chat(Some(template));
    let eos = c.tokenizer.eos;
    // Without the stop token the replies end by length, so the template's own markup
    // after each reply has to be fed by the next turn.
    let opts = greedy(12, None);
    let r1 = c.say("Tell me a fortune", &opts, |_| true).unwrap();
    let pos1 = c.session.position();
    let r2 = c.say("Another one", &opts, |_| true).unwrap();
    // Turn 2 fed the end of turn 1's markup and its own message only.
    let turn2_text = "\n<|endoftext|>user: Another one\n<|endoftext|>assistant: ";
    assert_eq!(
        r2.fed,
        c.tokenizer.encode_with(turn2_text, false).unwrap().len()
    );
    assert_eq!(
        c.session.position(),
        pos1 + 1 + r2.fed as u64 + r2.tokens as u64 - 1
    );
    // The same conversation read in one go gives the same second reply.
    let mut msgs = c.messages.clone();
    msgs.pop();
    let text = c.tokenizer.render_chat(&msgs, true).unwrap().unwrap();
    // (one read: the first reply as the template renders it, i.e. its decoded text)
    let ids = c.tokenizer.encode_with(&text, true).unwrap();
    let mut fresh = chat(Some(template));
    let (again, _) = fresh.session.generate(&ids, &opts, |_| true).unwrap();
    assert_eq!(
        c.tokenizer.decode(&again).unwrap(),
        r2.text,
        "turn by turn vs one read (first reply: {:?})",
        r1.text
    );
    let _ = eos;
}

#[test]
fn plain_chat_carries_state_and_regenerates() {
    let mut c = chat(None);
    let eos = c.tokenizer.eos;
    assert!(eos.is_some());
    let opts = greedy(20, eos);
    let r1 = c.say("Love is", &opts, |_| true).unwrap();
    let pos = c.session.position();
    let r2 = c.say("The best thing", &opts, |_| true).unwrap();
    assert!(
        c.session.position() > pos,
        "the second turn continues the state"
    );
    let again = c.regenerate(&opts, |_| true).unwrap();
    assert_eq!(
        again.text, r2.text,
        "greedy regenerate from the snapshot gives the same reply"
    );
    assert_eq!(c.messages.len(), 4);
    assert!(!r1.text.is_empty() && !r2.text.is_empty());
    // Empty messages are refused with a clear error.
    assert_eq!(
        c.say("  ", &opts, |_| true).unwrap_err().to_string(),
        "invalid input: the message is empty"
    );
}

#[test]
fn regenerate_after_a_template_that_rereads_the_past() {
    // This template shows only the newest message, so turn 2 cannot continue turn 1's
    // rendering: the session is reset and the new rendering read from zero. Regenerating
    // must start from that same zero state (greedy: the same reply), not from turn 1's.
    let template =
        "{% for m in messages %}{% if loop.last %}{{ m.content }}\n{% endif %}{% endfor %}";
    let mut c = chat(Some(template));
    let opts = greedy(10, None);
    c.say("Tell me a fortune", &opts, |_| true).unwrap();
    let r2 = c.say("Another one", &opts, |_| true).unwrap();
    let again = c.regenerate(&opts, |_| true).unwrap();
    assert_eq!(again.text, r2.text, "the regenerated greedy reply");
    assert_eq!(again.fed, r2.fed, "the same tokens fed");
}

/// A template that writes past replies otherwise than they were generated (here: in
/// capitals; real ones drop a reply's reasoning or trim it).
const REWRITING: &str = "{% for m in messages %}<|endoftext|>{{ m.role }}: {% if m.role == 'assistant' %}{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}";

/// With a template that rewrites past replies, the turn after the one that found it out
/// goes on from the state at the last assistant cue and feeds only the rewritten reply and
/// the new message (not the whole conversation), and replies as a fresh read of the same
/// tokens does; regenerate and a failed turn keep to that state.
#[test]
fn a_template_that_rewrites_the_last_reply_is_read_from_its_cue() {
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut c = wrapped(Some(REWRITING), &fail, None);
    let opts = greedy(10, None);
    let tok = c.tokenizer.clone();
    let render = |msgs: &[(String, String)]| tok.render_chat(msgs, true).unwrap().unwrap();
    c.say("Tell me a fortune", &opts, |_| true).unwrap();
    // Turn 2 finds the first reply rewritten: the conversation is read again, whole.
    let r2 = c.say("Another one", &opts, |_| true).unwrap();
    let two = render(&c.messages[..3]);
    assert_eq!(r2.fed, tok.encode_with(&two, true).unwrap().len());
    let r2_text = r2.text.clone();
    assert_ne!(r2_text.to_uppercase(), r2_text, "the reply is rewritten");
    // Turn 3: from turn 2's cue, only the rewritten reply 2 and the new message.
    let r3 = c.say("And a third", &opts, |_| true).unwrap();
    let three = render(&c.messages[..5]);
    let suffix = three
        .strip_prefix(two.as_str())
        .expect("the cue's text is a prefix");
    let from_cue = tok.encode_with(suffix, false).unwrap();
    assert_eq!(r3.fed, from_cue.len());
    assert!(r3.fed < tok.encode_with(&three, true).unwrap().len() / 2);
    // The oracle: a fresh session reading the same tokens from zero.
    let mut ids = tok.encode_with(&two, true).unwrap();
    ids.extend(&from_cue);
    let mut fresh = chat(Some(REWRITING));
    let (want, _) = fresh.session.generate(&ids, &opts, |_| true).unwrap();
    assert_eq!(tok.decode(&want).unwrap(), r3.text);
    assert_eq!(c.session.position(), fresh.session.position());
    assert_ne!(r3.text.to_uppercase(), r3.text, "reply 3 is rewritten too");
    // Regenerate starts from the same cue state.
    let again = c.regenerate(&opts, |_| true).unwrap();
    assert_eq!((again.text.as_str(), again.fed), (r3.text.as_str(), r3.fed));
    // A turn that fails after going back to the cue leaves the chat able to go on: a
    // regenerate of the reply that stands gives it again, and the same message again
    // gives the reply of a chat that never failed.
    fail.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(c.say("A fourth", &opts, |_| true).is_err());
    fail.store(false, std::sync::atomic::Ordering::Relaxed);
    let again = c.regenerate(&opts, |_| true).unwrap();
    assert_eq!((again.text.as_str(), again.fed), (r3.text.as_str(), r3.fed));
    let r4 = c.say("A fourth", &opts, |_| true).unwrap();
    assert_eq!(
        r4.fed,
        tok.encode_with(
            render(&c.messages[..7])
                .strip_prefix(render(&c.messages[..5]).as_str())
                .unwrap(),
            false
        )
        .unwrap()
        .len(),
        "turn 4 went on from turn 3's cue"
    );
    let never = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut d = wrapped(Some(REWRITING), &never, None);
    for m in [
        "Tell me a fortune",
        "Another one",
        "And a third",
        "A fourth",
    ] {
        let r = d.say(m, &opts, |_| true).unwrap();
        if m == "A fourth" {
            assert_eq!((r.text.as_str(), r.fed), (r4.text.as_str(), r4.fed));
        }
    }
    assert_eq!(c.session.position(), d.session.position());
    // A new conversation forgets the cue: its first turn reads from zero.
    c.reset().unwrap();
    let first = c.say("Tell me a fortune", &opts, |_| true).unwrap();
    let alone = render(&c.messages[..1]);
    assert_eq!(first.fed, tok.encode_with(&alone, true).unwrap().len());
}

/// A CPU backend whose decode fails, when told to, after feeding a few tokens (a device
/// error midway through a reply), and that reports a context limit when given one (as a
/// GPU engine's KV caches set one).
struct Wrapped {
    inner: CpuBackend,
    fail: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ctx: Option<usize>,
}

impl mamba2_wgpu::Backend for Wrapped {
    fn config(&self) -> &mamba2_wgpu::ModelConfig {
        self.inner.config()
    }
    fn describe(&self) -> String {
        "wrapped cpu".into()
    }
    fn reset(&mut self) -> mamba2_wgpu::Result<()> {
        self.inner.reset()
    }
    fn prefill_sample(
        &mut self,
        tokens: &[u32],
        sampling: &mamba2_wgpu::Sampling,
        pos: u64,
    ) -> mamba2_wgpu::Result<u32> {
        self.inner.prefill_sample(tokens, sampling, pos)
    }
    fn prefill_logits(&mut self, tokens: &[u32]) -> mamba2_wgpu::Result<Vec<Vec<f32>>> {
        self.inner.prefill_logits(tokens)
    }
    fn decode(
        &mut self,
        first: u32,
        pos: u64,
        max_new: usize,
        sampling: &mamba2_wgpu::Sampling,
        stop: &[u32],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> mamba2_wgpu::Result<usize> {
        if !self.fail.load(std::sync::atomic::Ordering::Relaxed) {
            return self
                .inner
                .decode(first, pos, max_new, sampling, stop, on_token);
        }
        self.inner
            .decode(first, pos, max_new.min(3), sampling, stop, on_token)?;
        Err(mamba2_wgpu::Error::Gpu("the device went away".into()))
    }
    fn snapshot(&self) -> mamba2_wgpu::Result<Box<dyn std::any::Any + Send>> {
        self.inner.snapshot()
    }
    fn restore(&mut self, snapshot: &(dyn std::any::Any + Send)) -> mamba2_wgpu::Result<()> {
        self.inner.restore(snapshot)
    }
    fn state(&self) -> mamba2_wgpu::Result<mamba2_wgpu::state::State<f32>> {
        mamba2_wgpu::Backend::state(&self.inner)
    }
    fn context(&self) -> Option<usize> {
        self.ctx
    }
}

/// A chat over `Wrapped` (the embedded model, `template`).
fn wrapped(
    template: Option<&str>,
    fail: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    ctx: Option<usize>,
) -> Chat {
    let (model, mut tok) = assets::embedded().unwrap();
    tok.chat_template = template.map(str::to_string);
    let backend = Wrapped {
        inner: CpuBackend::new(CpuModel::<f32>::new(&model.config, &model.weights).unwrap()),
        fail: fail.clone(),
        ctx,
    };
    Chat::new(Session::new(Box::new(backend)), tok)
}

/// A turn or a regenerate that fails midway (input fed, part of a reply fed) leaves the
/// conversation as it was: the next turn gives what it gives without the failed one.
#[test]
fn a_turn_that_fails_midway_leaves_no_trace() {
    let template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flaky =
        |fail: &std::sync::Arc<std::sync::atomic::AtomicBool>| wrapped(Some(template), fail, None);
    let opts = greedy(8, None);
    let mut c = flaky(&fail);
    let first = c.say("Tell me a story", &opts, |_| true).unwrap();
    let pos = c.session.position();
    fail.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(c.say("Go on", &opts, |_| true).is_err());
    assert_eq!(
        c.session.position(),
        pos,
        "the failed turn's tokens are gone"
    );
    assert_eq!(c.messages.len(), 2);
    // A regenerate that fails keeps the reply it would have replaced.
    assert!(c.regenerate(&opts, |_| true).is_err());
    assert_eq!(c.session.position(), pos);
    assert_eq!(c.messages[1].1, first.text);
    fail.store(false, std::sync::atomic::Ordering::Relaxed);
    let next = c.say("And then?", &opts, |_| true).unwrap();
    // The same two turns in a chat that never failed.
    let never = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut d = flaky(&never);
    d.say("Tell me a story", &opts, |_| true).unwrap();
    let want = d.say("And then?", &opts, |_| true).unwrap();
    assert_eq!(next.text, want.text);
    assert_eq!(c.session.position(), d.session.position());
    // And regenerate still works on the reply that stands.
    let again = c.regenerate(&opts, |_| true).unwrap();
    assert_eq!(again.text, next.text);
}

/// `TurnEvent::Started` says where the state stands once the turn's input is fed: a turn
/// after a reply ends with that reply's last token pending, fed before the input, and a
/// regenerate starts from its snapshot, not from the end of the reply it replaces.
#[test]
fn a_turn_reports_where_its_input_leaves_the_state() {
    use mamba2_wgpu::chat::TurnEvent;
    let mut c = chat(None);
    let opts = greedy(6, None);
    let turn = |c: &mut Chat, user: Option<&str>| {
        let mut at = None;
        let on = |e: TurnEvent| {
            if let TurnEvent::Started { position, .. } = e {
                at = Some(position);
            }
            true
        };
        let r = match user {
            Some(u) => c.say_with(u, &opts, on).unwrap(),
            None => c.regenerate_with(&opts, on).unwrap(),
        };
        // Every reply token but the last (pending) has been fed after the input.
        assert_eq!(c.session.position(), at.unwrap() + r.tokens as u64 - 1);
        at.unwrap()
    };
    let first = turn(&mut c, Some("Hello"));
    let second = turn(&mut c, Some("Go on"));
    assert!(second > first);
    assert_eq!(
        turn(&mut c, None),
        second,
        "a regenerate starts where the turn did"
    );
}

/// A saved conversation resumed into a context it fills is refused when it is loaded,
/// naming both sizes and --ctx, not at the first message; one with room continues.
#[test]
fn a_conversation_resumed_into_a_context_it_fills_is_refused_at_once() {
    let mut c = chat(None);
    let reply = c
        .say("Tell me a story", &greedy(6, None), |_| true)
        .unwrap();
    assert!(!reply.text.is_empty());
    let saved = c.export().unwrap();
    let held = saved.state.len + 1; // the reply's last token is pending
    let working = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let limited = |ctx: usize| wrapped(None, &working, Some(ctx));
    let path = std::path::Path::new("talk.safetensors");
    for ctx in [held - 1, held] {
        let e = limited(ctx).import(&saved, path).unwrap_err().to_string();
        assert!(
            e.contains(&format!("holds {held} tokens"))
                && e.contains(&format!("context (--ctx) holds {ctx}")),
            "{e}"
        );
    }
    let mut roomy = limited(held + 64);
    roomy.import(&saved, path).unwrap();
    assert_eq!(roomy.session.position(), saved.state.len as u64);
    // The reply it came with cannot be regenerated (the state before it was not saved),
    // and is said so; one made since can.
    let e = roomy.regenerate(&greedy(2, None), |_| true).unwrap_err();
    assert!(
        e.to_string()
            .contains("only replies made since it was resumed"),
        "{e}"
    );
    let go_on = roomy.say("Go on", &greedy(2, None), |_| true).unwrap();
    let again = roomy.regenerate(&greedy(2, None), |_| true).unwrap();
    assert_eq!(again.text, go_on.text);
}

/// A sequence never passes `MAX_POSITION` (the device's 32-bit positions, kept below 2^31):
/// near it a reply stops at the limit and a prompt that would cross it is refused (a forged
/// saved state can start a sequence there).
#[test]
fn a_sequence_stops_at_the_last_position() {
    use mamba2_wgpu::session::MAX_POSITION;
    let (model, _) = assets::embedded().unwrap();
    let backend = CpuBackend::new(CpuModel::<f32>::new(&model.config, &model.weights).unwrap());
    let mut s = Session::new(Box::new(backend));
    let mut state = mamba2_wgpu::state::State::<f32>::new(&model.config);
    state.len = (MAX_POSITION - 3) as usize;
    s.load_state(&state, None).unwrap();
    let (reply, finish) = s.generate(&[5, 6], &greedy(10, None), |_| true).unwrap();
    // Fed to MAX_POSITION − 1; two tokens sampled, at MAX_POSITION − 1 and MAX_POSITION.
    assert_eq!((reply.len(), finish), (2, Finish::Length), "{reply:?}");
    assert!(s.position() <= MAX_POSITION);
    let e = s.generate(&[7, 8], &greedy(1, None), |_| true).unwrap_err();
    assert!(e.to_string().contains("past the 2147483647"), "{e}");
}

/// A long prompt whose reading is stopped between pieces (the app's Stop, through
/// `PromptProgress`) fails the turn, and the turn is rolled back: the conversation goes on
/// as if the message had never been sent.
#[test]
fn a_turn_stopped_while_its_prompt_is_read_leaves_no_trace() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let mut c = chat(None);
    let flag = stop.clone();
    c.session
        .set_prompt_progress(Some(mamba2_wgpu::PromptProgress {
            every: 1,
            // Go on until told to stop, and always past the first report.
            on: Box::new(move |fed, _| fed == 0 || !flag.load(Ordering::SeqCst)),
        }));
    let opts = greedy(4, None);
    c.say("Tell me a story", &opts, |_| true).unwrap();
    let (pos, messages) = (c.session.position(), c.messages.len());
    let long = "and then the wind came over the hills ".repeat(400);
    stop.store(true, Ordering::SeqCst);
    let e = c.say(&long, &opts, |_| true).unwrap_err();
    assert!(
        e.to_string()
            .contains(mamba2_wgpu::session::STOPPED_READING),
        "{e}"
    );
    assert_eq!((c.session.position(), c.messages.len()), (pos, messages));
    // The next turn equals the same turn in a chat that never saw the long message.
    stop.store(false, Ordering::SeqCst);
    let next = c.say("Go on", &opts, |_| true).unwrap();
    let mut d = chat(None);
    d.say("Tell me a story", &opts, |_| true).unwrap();
    let want = d.say("Go on", &opts, |_| true).unwrap();
    assert_eq!(next.text, want.text);
    assert_eq!(c.session.position(), d.session.position());
}

/// A template that renders the conversation the same without its last message (here one
/// that renders nothing) is refused naming the template, not answered blind, turn after
/// turn; the server's prompts go through the same check.
#[test]
fn a_template_that_ignores_the_message_is_refused() {
    let mut c = chat(Some("{{ '' }}"));
    let e = c
        .say("Tell me a story", &greedy(4, None), |_| true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the chat template renders the conversation the same without its last"),
        "{e}"
    );
    let msgs = vec![("user".to_string(), "Hello".to_string())];
    let e = mamba2_wgpu::chat::conversation_tokens(&c.tokenizer, &msgs)
        .unwrap_err()
        .to_string();
    assert!(e.contains("the chat template renders"), "{e}");
}

/// A template that writes a space between the reply and its end token (Mistral's shape,
/// `{{ content }} {{ eos_token }}`): a reply that stopped on that token has it pending in
/// the state, and the next turn feeds what follows it, not a second one.
#[test]
fn a_spaced_end_token_after_a_reply_is_not_fed_twice() {
    let template = "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %}{{ m.content }} {{ eos_token }}{% endif %}{% endfor %}";
    let mut c = chat(Some(template));
    let eos = c.tokenizer.eos.expect("the embedded tokenizer has an EOS");
    let opts = greedy(200, Some(eos));
    let r1 = c.say("Tell me a fortune", &opts, |_| true).unwrap();
    let r2 = c.say("Tell me more", &opts, |_| true).unwrap();
    // The case this is about: the reply ended on the EOS (the embedded model's greedy
    // reply here does, within 200 tokens).
    assert_eq!(r1.finish, mamba2_wgpu::Finish::Stop, "{:?}", r1.text);
    // Only the next user turn is fed, not the template's " <eos>" again.
    let after = "[INST] Tell me more [/INST]";
    assert_eq!(
        r2.fed,
        c.tokenizer.encode_with(after, false).unwrap().len(),
        "first reply {:?} ({:?})",
        r1.text,
        r1.finish
    );
}

/// Without an end-of-text token, the tokens a reply stops on (what `chat`, the app and the
/// server all pass as `stop`) still hold the template's end of turn, and a turn stops on
/// it.
#[test]
fn a_tokenizer_without_an_eos_still_stops_at_the_template_s_end_of_turn() {
    let template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|endoftext|>{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";
    let mut c = chat(Some(template));
    let end = c.tokenizer.eos.unwrap();
    c.tokenizer.eos = None;
    c.tokenizer.eos_token = None;
    let stop = mamba2_wgpu::chat::stop_ids(&c.tokenizer);
    assert_eq!(stop, vec![end]);
    let opts = GenerateOptions {
        stop,
        ..greedy(300, None)
    };
    let r = c.say("Tell me a fortune", &opts, |_| true).unwrap();
    assert_eq!(r.finish, mamba2_wgpu::Finish::Stop, "{:?}", r.text);
}

/// A conversation saved without a chat template is refused when resumed with one, and the
/// other way round: its state holds the past as then written, and the new rendering's
/// start cannot be told from it, so the past would be fed again on top. With another
/// template (a model's template fixed upstream) it resumes, and its next turn reads the
/// conversation afresh; with the same one it goes on from the state.
#[test]
fn a_conversation_resumed_with_another_template_is_refused() {
    let template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";
    let path = std::path::Path::new("talk.safetensors");
    let mut plain = chat(None);
    plain
        .say("Tell me a story", &greedy(4, None), |_| true)
        .unwrap();
    let saved = plain.export().unwrap();
    let e = chat(Some(template))
        .import(&saved, path)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("talk.safetensors")
            && e.contains("without a chat template, and this model has one"),
        "{e}"
    );
    let mut templated = chat(Some(template));
    templated
        .say("Tell me a story", &greedy(4, None), |_| true)
        .unwrap();
    let saved = templated.export().unwrap();
    let other = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}";
    let mut fixed = chat(Some(other));
    fixed.import(&saved, path).unwrap();
    let r = fixed.say("Go on", &greedy(2, None), |_| true).unwrap();
    let all = fixed.messages[..fixed.messages.len() - 1].to_vec();
    let whole = fixed.tokenizer.render_chat(&all, true).unwrap().unwrap();
    assert_eq!(
        r.fed,
        fixed.tokenizer.encode_with(&whole, true).unwrap().len(),
        "the conversation read afresh"
    );
    let e = chat(None).import(&saved, path).unwrap_err().to_string();
    assert!(
        e.contains("with a chat template, and this model has none"),
        "{e}"
    );
    let mut same = chat(Some(template));
    same.import(&saved, path).unwrap();
    same.say("Go on", &greedy(2, None), |_| true).unwrap();
}
