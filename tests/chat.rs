//! Conversations: each turn feeds only its new tokens, and the result equals reading the
//! whole conversation at once; regenerate restores the state before the reply.

use mamba2_wgpu::chat::Chat;
use mamba2_wgpu::{CpuBackend, CpuModel, GenerateOptions, Session, assets};

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
