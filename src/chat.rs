//! A conversation over a `Session`: each turn feeds only its new tokens (the state carries
//! the past), rendered with the model's chat template when it has one, as plain
//! continuation after an end-of-text separator when it does not. Regenerating a reply
//! restores the state snapshot taken before it instead of re-reading the conversation.

use crate::error::{Error, Result};
use crate::session::{Finish, GenerateOptions, Session, Snapshot};
use crate::tokenizer::Tokenizer;

/// A chat: the session, the tokenizer and what has been said.
pub struct Chat {
    pub session: Session,
    pub tokenizer: Tokenizer,
    /// (role, content) of every message so far.
    pub messages: Vec<(String, String)>,
    last_finish: Option<Finish>,
    /// The template text fed so far: rendering up to the last assistant cue + the reply.
    fed: String,
    /// The rendering of the turn in progress (up to its assistant cue).
    pending_render: String,
    /// The state before the last turn, with that turn's input, the finish before it and
    /// its rendering up to the assistant cue.
    before_last: Option<(Snapshot, Vec<u32>, Option<Finish>, String)>,
    /// The template renders past turns otherwise than they were read (reasoning dropped
    /// from past replies, say): seen once, every turn keeps `at_cue`.
    rewrites_past: bool,
    /// The state right after the last turn's rendering up to its assistant cue was read,
    /// with that text: where the next turn goes on from when the template renders the last
    /// reply otherwise than it was generated, instead of reading the whole conversation
    /// again.
    at_cue: Option<(Snapshot, String)>,
}

/// What a saved chat keeps beside the state (`mamba2.extra` of its file).
#[derive(serde::Serialize, serde::Deserialize)]
struct SavedChat {
    messages: Vec<(String, String)>,
    fed: String,
    last_finish: Option<Finish>,
    pending: Option<u32>,
    /// The chat template the state was read with (`template_known`: files of earlier
    /// builds do not say). The state holds the conversation as that template rendered it;
    /// resumed without one (or, saved without one, with one) the past would be fed again
    /// on top.
    #[serde(default)]
    template_known: bool,
    #[serde(default)]
    template: Option<String>,
}

/// One finished reply.
#[derive(Clone, Debug)]
pub struct Reply {
    pub text: String,
    pub tokens: usize,
    pub finish: Finish,
    /// Tokens fed for this turn (new tokens only).
    pub fed: usize,
}

impl Chat {
    pub fn new(session: Session, tokenizer: Tokenizer) -> Self {
        Chat {
            session,
            tokenizer,
            messages: Vec::new(),
            fed: String::new(),
            pending_render: String::new(),
            last_finish: None,
            before_last: None,
            rewrites_past: false,
            at_cue: None,
        }
    }

    /// Whether turns are rendered with a chat template.
    pub fn has_template(&self) -> bool {
        self.tokenizer.chat_template.is_some()
    }

    /// Forgets the conversation and zeroes the state.
    pub fn reset(&mut self) -> Result<()> {
        self.messages.clear();
        self.fed.clear();
        self.last_finish = None;
        self.before_last = None;
        self.at_cue = None;
        self.session.reset()
    }

    /// The tokens a new user message adds: `input_after` the conversation read so far. A
    /// template that renders the past differently now goes back to the state at the last
    /// assistant cue where the new rendering still starts with what was read up to there
    /// (it rewrote the last reply only), else resets the session: it is read again in full.
    fn turn_input(&mut self, user: &str) -> Result<(Vec<u32>, Option<Snapshot>)> {
        let mut msgs = self.messages.clone();
        msgs.push(("user".into(), user.to_string()));
        if let Some((_, cue)) = &self.at_cue
            && let Some(render) = self.tokenizer.render_chat(&msgs, true)?
            && !render.starts_with(self.fed.as_str())
            && render.starts_with(cue.as_str())
        {
            let input = input_after(
                &self.tokenizer,
                &msgs,
                &Read {
                    text: cue,
                    messages: self.messages.len(),
                    at_start: false,
                    ended_on: None,
                },
            )?;
            if !input.reread {
                // What the state holds from here on: the rendering up to the last cue. (The
                // snapshot becomes the turn's own: a copy of it would be the same state.)
                let (snapshot, cue) = self.at_cue.take().expect("matched above");
                if let Err(e) = self.session.restore(&snapshot) {
                    self.at_cue = Some((snapshot, cue));
                    return Err(e);
                }
                self.fed = cue;
                self.last_finish = None;
                self.pending_render = input.render;
                return Ok((input.ids, Some(snapshot)));
            }
        }
        // A reply that ended on a stop token left it pending in the session.
        let ended_on = match self.last_finish {
            Some(Finish::Stop) => self.session.pending(),
            _ => None,
        };
        let input = input_after(
            &self.tokenizer,
            &msgs,
            &Read {
                text: &self.fed,
                messages: self.messages.len(),
                at_start: self.session.position() == 0,
                ended_on,
            },
        )?;
        if input.reread {
            self.rewrites_past = true;
            self.session.reset()?;
            self.last_finish = None;
        }
        self.pending_render = input.render;
        Ok((input.ids, None))
    }

    /// The tokens that end this chat's turns (`stop_ids`).
    pub fn stop_ids(&self) -> Vec<u32> {
        stop_ids(&self.tokenizer)
    }

    /// The conversation and its state, to write with `state_file::save` (the state is
    /// read from the device: blocking).
    pub fn export(&self) -> Result<crate::state_file::SavedState> {
        let saved = SavedChat {
            messages: self.messages.clone(),
            fed: self.fed.clone(),
            last_finish: self.last_finish,
            pending: self.session.pending(),
            template_known: true,
            template: self.tokenizer.chat_template.clone(),
        };
        Ok(crate::state_file::SavedState {
            state: self.session.backend().state()?,
            tokens: Vec::new(),
            extra: Some(serde_json::to_string(&saved).map_err(|e| {
                Error::InvalidInput(format!("the conversation does not serialize: {e}"))
            })?),
        })
    }

    /// Continues the conversation of `saved` (read with `state_file::load`, which checked
    /// that it belongs to this model); `path` names the file in errors.
    pub fn import(
        &mut self,
        saved: &crate::state_file::SavedState,
        path: &std::path::Path,
    ) -> Result<()> {
        let extra = saved.extra.as_deref().ok_or_else(|| {
            Error::format(
                path,
                "this saved state holds no conversation (field mamba2.extra)",
            )
        })?;
        let chat: SavedChat = serde_json::from_str(extra).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            field: "mamba2.extra".into(),
            message: format!("not a saved conversation: {e}"),
        })?;
        // With a template on one side only, the saved text (the rendering read) cannot be
        // told from the new rendering's start: the whole past would be fed again on top of
        // the state. (Two different templates are fine: the next turn finds the past
        // rendered otherwise and reads the conversation afresh, `input_after`'s reread.)
        if chat.template_known && chat.template.is_some() != self.tokenizer.chat_template.is_some()
        {
            let how = match chat.template {
                Some(_) => "with a chat template, and this model has none",
                None => "without a chat template, and this model has one",
            };
            return Err(Error::Config {
                path: path.to_path_buf(),
                field: "mamba2.extra".into(),
                message: format!(
                    "the conversation was read {how}: its state holds the past as written \
                     then, which this one would feed again on top; resume it with the \
                     tokenizer files it was saved with, or start a new conversation"
                ),
            });
        }
        // A conversation that fills this run's context (a smaller --ctx than it was saved
        // with) could take no further turn: said now, not at the first message.
        let held = saved.state.len as u64 + u64::from(chat.pending.is_some());
        if let Some(ctx) = self.session.backend().context()
            && held >= ctx as u64
        {
            return Err(Error::InvalidInput(format!(
                "the conversation holds {held} tokens, and this run's context (--ctx) holds \
                 {ctx}: no turn would fit; resume with a larger --ctx"
            )));
        }
        self.session.load_state(&saved.state, chat.pending)?;
        self.messages = chat.messages;
        self.fed = chat.fed;
        self.last_finish = chat.last_finish;
        self.before_last = None;
        self.at_cue = None;
        self.pending_render.clear();
        Ok(())
    }

    /// The tokens `user` would take as a new conversation's only message (through its
    /// cue), with the context, where they leave no room for a reply: a new conversation
    /// would not help a message refused for a full context.
    pub fn too_long_alone(&self, user: &str) -> Option<(usize, usize)> {
        let ctx = self.session.backend().context()?;
        let n = conversation_tokens(&self.tokenizer, &[("user".into(), user.to_string())])
            .ok()?
            .len();
        (n >= ctx).then_some((n, ctx))
    }

    /// Sends a user message and streams the reply's text to `on_text` (return false to
    /// stop).
    pub fn say(
        &mut self,
        user: &str,
        opts: &GenerateOptions,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Reply> {
        self.say_with(user, opts, |e| match e {
            TurnEvent::Token { piece: Some(p), .. } => on_text(p),
            _ => true,
        })
    }

    /// `say`, telling `on` when the turn's input is ready and about every sampled token
    /// (with its text once whole characters are complete): for front-ends that time
    /// tokens or watch the state while decoding.
    pub fn say_with(
        &mut self,
        user: &str,
        opts: &GenerateOptions,
        on: impl FnMut(TurnEvent) -> bool,
    ) -> Result<Reply> {
        if user.trim().is_empty() {
            return Err(Error::InvalidInput("the message is empty".into()));
        }
        self.pending_render.clear();
        let (ids, start) = self.turn_input(user)?;
        // The state `ids` are fed from: taken after turn_input, which resets the session
        // when the template renders the past differently (a snapshot from before would make
        // a regenerated reply read the history twice), or the cue's it went back to.
        let snapshot = match start {
            Some(s) => s,
            None => self.session.snapshot()?,
        };
        let finish = self.last_finish;
        let reply = match self.reply(&ids, opts, self.rewrites_past, on) {
            Ok((reply, at_cue)) => {
                if let Some(s) = at_cue {
                    self.at_cue = Some((s, self.pending_render.clone()));
                }
                reply
            }
            Err(e) => {
                // The turn failed midway, its input (and maybe part of a reply) fed: back to
                // the state it started from, so that the next turn does not read a turn the
                // conversation does not have. A session reset by turn_input has read nothing
                // of the past, so nothing of it counts as fed.
                let _ = self.session.restore(&snapshot);
                self.last_finish = finish;
                if self.session.position() == 0 {
                    self.fed.clear();
                    self.last_finish = None;
                }
                return Err(e);
            }
        };
        self.before_last = Some((snapshot, ids, finish, self.pending_render.clone()));
        self.messages.push(("user".into(), user.to_string()));
        self.messages.push(("assistant".into(), reply.text.clone()));
        self.fed = format!("{}{}", self.pending_render, reply.text);
        Ok(reply)
    }

    /// Replaces the last reply with a new one from the same state (a sampled chat moves
    /// its seed on by one, so the new reply differs).
    pub fn regenerate(
        &mut self,
        opts: &GenerateOptions,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Reply> {
        self.regenerate_with(opts, |e| match e {
            TurnEvent::Token { piece: Some(p), .. } => on_text(p),
            _ => true,
        })
    }

    /// `regenerate` with the events of `say_with`.
    pub fn regenerate_with(
        &mut self,
        opts: &GenerateOptions,
        on: impl FnMut(TurnEvent) -> bool,
    ) -> Result<Reply> {
        let Some((snapshot, ids, finish, cue)) = self.before_last.take() else {
            // A resumed conversation has its replies but not the state before the last.
            let why = match self.messages.last() {
                Some((role, _)) if role == "assistant" => {
                    "the state before the last reply was not saved with the conversation: \
                     only replies made since it was resumed can be regenerated"
                }
                _ => "there is no reply to regenerate",
            };
            return Err(Error::InvalidInput(why.into()));
        };
        // The state after the old reply, to go back to if the new one fails.
        let after = match self.session.snapshot() {
            Ok(after) => after,
            Err(e) => {
                self.before_last = Some((snapshot, ids, finish, cue));
                return Err(e);
            }
        };
        let old_finish = self.last_finish;
        if let Err(e) = self.session.restore(&snapshot) {
            // Nothing was changed: the reply can still be regenerated.
            self.before_last = Some((snapshot, ids, finish, cue));
            return Err(e);
        }
        self.last_finish = finish;
        let last = self.messages.pop();
        // (The state at this cue is kept already unless a failed turn took it.)
        let mark = self.rewrites_past && self.at_cue.as_ref().is_none_or(|(_, c)| *c != cue);
        let reply = match self.reply(&ids, opts, mark, on) {
            Ok((reply, at_cue)) => {
                if let Some(s) = at_cue {
                    self.at_cue = Some((s, cue.clone()));
                }
                reply
            }
            Err(e) => {
                // As if nothing had been asked: the old reply and its state stay.
                let _ = self.session.restore(&after);
                self.last_finish = old_finish;
                self.messages.extend(last);
                self.before_last = Some((snapshot, ids, finish, cue));
                return Err(e);
            }
        };
        if let Some((role, _)) = last {
            // The state read the turn's rendering up to its cue, then the new reply.
            self.fed = format!("{cue}{}", reply.text);
            self.messages.push((role, reply.text.clone()));
        }
        self.before_last = Some((snapshot, ids, finish, cue));
        Ok(reply)
    }

    fn reply(
        &mut self,
        ids: &[u32],
        opts: &GenerateOptions,
        mark: bool,
        mut on: impl FnMut(TurnEvent) -> bool,
    ) -> Result<(Reply, Option<Snapshot>)> {
        // A caller that stops at the end of the sequence stops at the end of the turn too:
        // a template's end-of-turn token (`<|im_end|>`) is not always the EOS.
        let mut opts = opts.clone();
        if self
            .tokenizer
            .eos
            .is_some_and(|eos| opts.stop.contains(&eos))
        {
            for id in self.stop_ids() {
                if !opts.stop.contains(&id) {
                    opts.stop.push(id);
                }
            }
        }
        let opts = &opts;
        let mut decoder = self.tokenizer.stream();
        let mut text = String::new();
        let mut failure = None;
        let tok = &self.tokenizer;
        // The input is fed whatever this returns (stop at the first token instead).
        let position = self.session.position()
            + u64::from(self.session.pending().is_some())
            + ids.len() as u64;
        let _ = on(TurnEvent::Started {
            fed: ids.len(),
            position,
        });
        // `mark`: a template seen rewriting the past; the state at this turn's cue is kept.
        let (tokens, finish, at_cue) =
            self.session
                .generate_marked(ids, opts, mark, |id| match decoder.step(tok, id) {
                    Ok(piece) => {
                        if let Some(p) = &piece {
                            text.push_str(p);
                        }
                        on(TurnEvent::Token {
                            id,
                            piece: piece.as_deref(),
                        })
                    }
                    Err(e) => {
                        failure = Some(e);
                        false
                    }
                })?;
        if let Some(e) = failure {
            return Err(e);
        }
        self.last_finish = Some(finish);
        let reply = Reply {
            text,
            tokens: tokens.len(),
            finish,
            fed: ids.len(),
        };
        Ok((reply, at_cue))
    }
}

/// What `Chat::say_with` reports while a turn runs.
#[derive(Debug)]
pub enum TurnEvent<'a> {
    /// The turn's new tokens are ready and about to be fed (they are fed whatever the
    /// callback returns).
    /// `position`: the tokens the state holds once they are fed (the first reply token is
    /// sampled there).
    Started { fed: usize, position: u64 },
    /// A sampled token of the reply (a stop token is not reported), with its text once
    /// whole UTF-8 characters are complete.
    Token { id: u32, piece: Option<&'a str> },
}

/// The tokens that end an assistant's turn, with their text: the tokenizer's end-of-sequence
/// token and, with a chat template, the special token the template writes right after a
/// reply (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>` …) where that is another one. `Chat`
/// (for a caller that stops at EOS) and the server stop a reply on these.
pub fn turn_ends(tok: &Tokenizer) -> Vec<(u32, String)> {
    let mut ends: Vec<(u32, String)> = Vec::new();
    if let (Some(id), Some(text)) = (tok.eos, &tok.eos_token) {
        ends.push((id, text.clone()));
    }
    if let Some(end) = template_turn_end(tok)
        && !ends.iter().any(|(id, _)| *id == end.0)
    {
        ends.push(end);
    }
    ends
}

/// The ids of `turn_ends`.
pub fn stop_ids(tok: &Tokenizer) -> Vec<u32> {
    turn_ends(tok).into_iter().map(|(id, _)| id).collect()
}

/// The special token a chat template writes right after an assistant's reply, found by
/// rendering one: the shortest start of what follows the reply (spaces skipped) that is a
/// single token decoding to nothing (a special token; text always decodes to itself).
/// `None` without a template, when one does not render this conversation, or when plain
/// text follows the reply.
fn template_turn_end(tok: &Tokenizer) -> Option<(u32, String)> {
    // Not text a template would change (some strip or capitalize the content).
    const REPLY: &str = "\u{2063}7f3a\u{2063}";
    // Longer than any special token's text.
    const MOST_CHARS: usize = 64;
    let msgs = [
        ("user".to_string(), "hello".to_string()),
        ("assistant".to_string(), REPLY.to_string()),
    ];
    let text = tok.render_chat(&msgs, false).ok()??;
    let after = text[text.rfind(REPLY)? + REPLY.len()..].trim_start();
    let ends = after
        .char_indices()
        .map(|(i, _)| i)
        .skip(1)
        .chain([after.len()])
        .take(MOST_CHARS);
    for end in ends {
        let piece = &after[..end];
        if let Ok([id]) = tok.encode_with(piece, false).as_deref()
            && tok.decode(&[*id]).is_ok_and(|t| t.is_empty())
        {
            return Some((*id, piece.to_string()));
        }
    }
    None
}

/// What a conversation's state has read, for `input_after`.
struct Read<'a> {
    /// With a template: the text read (the rendering up to the last assistant cue, plus
    /// the reply as generated).
    text: &'a str,
    /// Without one: the messages read.
    messages: usize,
    /// Whether the state is empty (the tokenizer's special tokens go first).
    at_start: bool,
    /// The stop token the last reply ended on: pending in the state, it is fed before the
    /// input, so the copy the template writes after the reply is not.
    ended_on: Option<u32>,
}

impl Read<'_> {
    /// A state that has read nothing.
    const NOTHING: Read<'static> = Read {
        text: "",
        messages: 0,
        at_start: true,
        ended_on: None,
    };
}

/// The input of a turn: the tokens to feed after what was read.
struct Input {
    ids: Vec<u32>,
    /// The template's rendering up to the assistant cue (empty without a template).
    render: String,
    /// The template renders the past differently from what was read: `ids` are the whole
    /// conversation, to read from a fresh state.
    reread: bool,
}

/// The tokens that take a state which has read `read` to the cue for the assistant's reply
/// to `messages`. With a template: its rendering minus the text already read, with the
/// tokenizer's special tokens at the start unless the template writes the BOS token itself.
/// Without one: the messages not yet read as plain text, each but the replies after an
/// end-of-text token (unless it starts the state, or the last reply ended on a stop
/// token). `Chat` feeds this turn by turn; the server, from an empty state, in one piece.
fn input_after(tok: &Tokenizer, messages: &[(String, String)], read: &Read) -> Result<Input> {
    if let Some(render) = tok.render_chat(messages, true)? {
        // A template that renders the conversation the same without its last message
        // (`{{ '' }}`, one that drops what it does not know) would have every turn read
        // nothing of what was said: refused, not answered blind. (A template that refuses
        // the shorter conversation, as some do one that does not start with a user,
        // is not this case.)
        if let Some(before) = messages.len().checked_sub(1)
            && tok
                .render_chat(&messages[..before], true)
                .ok()
                .flatten()
                .as_deref()
                == Some(render.as_str())
        {
            return Err(Error::InvalidInput(format!(
                "the chat template renders the conversation the same without its last \
                 message (a `{}` one): the model would not read it",
                messages[before].0
            )));
        }
        let (mut suffix, reread) = match render.strip_prefix(read.text) {
            Some(s) => (s, false),
            None => (render.as_str(), true),
        };
        if !reread
            && let Some(t) = read.ended_on
            && let Some((_, end)) = turn_ends(tok).into_iter().find(|(id, _)| *id == t)
            && let Some(rest) = suffix.trim_start().strip_prefix(end.as_str())
        {
            // (The spaces some templates write between the reply and its end token go
            // with it: the generated stop token stands for both, as `template_turn_end`
            // skips them to find it.)
            suffix = rest;
        }
        let template_bos = tok
            .bos_token
            .as_deref()
            .is_some_and(|b| !b.is_empty() && render.starts_with(b));
        let ids = tok.encode_with(suffix, (read.at_start || reread) && !template_bos)?;
        return Ok(Input {
            ids,
            render,
            reread,
        });
    }
    let mut ids = Vec::new();
    for (i, (role, content)) in messages.iter().enumerate().skip(read.messages) {
        let first = i == read.messages && read.at_start;
        let after_stop = i == read.messages && read.ended_on.is_some();
        if !first
            && !after_stop
            && role != "assistant"
            && let Some(eos) = tok.eos
        {
            ids.push(eos);
        }
        ids.extend(tok.encode_with(content, first)?);
    }
    Ok(Input {
        ids,
        render: String::new(),
        reread: false,
    })
}

/// The tokens of a whole conversation read from an empty state, ending with the cue for
/// the assistant's reply: what `Chat` feeds turn by turn (through the same `input_after`),
/// in one piece. The server's requests carry the whole conversation each time; the prefix
/// cache finds what was fed before.
pub fn conversation_tokens(tok: &Tokenizer, messages: &[(String, String)]) -> Result<Vec<u32>> {
    if messages.is_empty() {
        return Err(Error::InvalidInput("the message list is empty".into()));
    }
    Ok(input_after(tok, messages, &Read::NOTHING)?.ids)
}

#[cfg(test)]
mod tests {
    use super::{stop_ids, turn_ends};
    use crate::tokenizer::Tokenizer;

    /// The embedded tokenizer (EOS `<|endoftext|>`, id 0) with the special tokens of common
    /// templates added, and `template`.
    fn tokenizer(template: &str) -> Tokenizer {
        let mut json: serde_json::Value =
            serde_json::from_slice(include_bytes!("../assets/tokenizer.json")).unwrap();
        let added = json["added_tokens"].as_array_mut().unwrap();
        for (i, t) in ["<|im_start|>", "<|im_end|>", "<|eot_id|>"]
            .iter()
            .enumerate()
        {
            added.push(serde_json::json!({
                "id": 4096 + i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true,
            }));
        }
        let config = serde_json::json!({"chat_template": template, "eos_token": "<|endoftext|>"});
        Tokenizer::from_bytes(&serde_json::to_vec(&json).unwrap(), Some(&config)).unwrap()
    }

    #[test]
    fn a_turn_ends_at_the_eos_and_the_special_token_the_template_writes_after_a_reply() {
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\
                      {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        assert_eq!(
            turn_ends(&tokenizer(chatml)),
            vec![(0, "<|endoftext|>".into()), (4097, "<|im_end|>".into())]
        );
        // Llama 3's shape: the content trimmed, the token right after it.
        let llama = "{% for m in messages %}<|im_start|>{{ m.role }}\n\n{{ m.content | trim }}\
                     <|eot_id|>{% endfor %}";
        assert_eq!(stop_ids(&tokenizer(llama)), vec![0, 4098]);
        // A reply followed by the EOS itself (Mistral's shape), after a space: the EOS once.
        let eos = "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]\
                   {% else %}{{ m.content }} {{ eos_token }}{% endif %}{% endfor %}";
        assert_eq!(stop_ids(&tokenizer(eos)), vec![0]);
        // Plain text after the reply, a template that refuses this conversation, none: the
        // EOS only.
        for template in [
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}",
            "{{ raise_exception('a system message first') }}",
        ] {
            assert_eq!(stop_ids(&tokenizer(template)), vec![0], "{template}");
        }
        let mut plain = tokenizer("");
        plain.chat_template = None;
        assert_eq!(stop_ids(&plain), vec![0]);
    }
}
