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
    /// The state before the last turn, with that turn's input.
    before_last: Option<(Snapshot, Vec<u32>, Option<Finish>, String)>,
}

/// What a saved chat keeps beside the state (`mamba2.extra` of its file).
#[derive(serde::Serialize, serde::Deserialize)]
struct SavedChat {
    messages: Vec<(String, String)>,
    fed: String,
    last_finish: Option<Finish>,
    pending: Option<u32>,
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
        self.session.reset()
    }

    /// The tokens a new user message adds. With a template: the rendering of the
    /// conversation with the new message (and the assistant cue) minus the text already
    /// fed (the previous rendering up to the cue, plus the reply as generated); a template
    /// that renders the past differently (say, it strips replies) is read again in full.
    fn turn_input(&mut self, user: &str) -> Result<Vec<u32>> {
        let mut msgs = self.messages.clone();
        msgs.push(("user".into(), user.to_string()));
        if let Some(text) = self.tokenizer.render_chat(&msgs, true)? {
            let before = self.fed.clone();
            let mut suffix = match text.strip_prefix(before.as_str()) {
                Some(s) => s.to_string(),
                None => {
                    // The template renders the past differently now: read it all again.
                    self.session.reset()?;
                    self.last_finish = None;
                    text.clone()
                }
            };
            // A reply that ended on the end-of-sequence token left it pending in the
            // session; the template writes it again after the reply.
            if self.last_finish == Some(Finish::Stop)
                && let Some(eos) = &self.tokenizer.eos_token
                && let Some(rest) = suffix.strip_prefix(eos.as_str())
            {
                suffix = rest.to_string();
            }
            // The first turn gets the tokenizer's special tokens unless the template
            // already wrote the BOS token itself.
            let template_bos = self
                .tokenizer
                .bos_token
                .as_deref()
                .is_some_and(|b| !b.is_empty() && text.starts_with(b));
            let add_special = self.session.position() == 0 && !template_bos;
            self.pending_render = text;
            return self.tokenizer.encode_with(&suffix, add_special);
        }
        // No template: plain continuation, turns separated by end-of-text.
        let mut ids = Vec::new();
        if self.session.position() > 0
            && self.last_finish != Some(Finish::Stop)
            && let Some(eos) = self.tokenizer.eos
        {
            ids.push(eos);
        }
        let first = self.session.position() == 0;
        ids.extend(self.tokenizer.encode_with(user, first)?);
        Ok(ids)
    }

    /// The conversation and its state, to write with `state_file::save` (the state is
    /// read from the device: blocking).
    pub fn export(&self) -> Result<crate::state_file::SavedState> {
        let saved = SavedChat {
            messages: self.messages.clone(),
            fed: self.fed.clone(),
            last_finish: self.last_finish,
            pending: self.session.pending(),
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
        self.session.load_state(&saved.state, chat.pending)?;
        self.messages = chat.messages;
        self.fed = chat.fed;
        self.last_finish = chat.last_finish;
        self.before_last = None;
        self.pending_render.clear();
        Ok(())
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
        let fed = self.fed.clone();
        self.pending_render.clear();
        let ids = self.turn_input(user)?;
        // The state `ids` are fed from: taken after turn_input, which resets the session
        // when the template renders the past differently (a snapshot from before would make
        // a regenerated reply read the history twice).
        let snapshot = self.session.snapshot()?;
        let finish = self.last_finish;
        let reply = match self.reply(&ids, opts, on) {
            Ok(reply) => reply,
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
        self.before_last = Some((snapshot, ids, finish, fed));
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
        let (snapshot, ids, finish, fed) = self
            .before_last
            .take()
            .ok_or_else(|| Error::InvalidInput("there is no reply to regenerate".into()))?;
        // The state after the old reply, to go back to if the new one fails.
        let after = match self.session.snapshot() {
            Ok(after) => after,
            Err(e) => {
                self.before_last = Some((snapshot, ids, finish, fed));
                return Err(e);
            }
        };
        let old_finish = self.last_finish;
        self.session.restore(&snapshot)?;
        self.last_finish = finish;
        let last = self.messages.pop();
        let reply = match self.reply(&ids, opts, on) {
            Ok(reply) => reply,
            Err(e) => {
                // As if nothing had been asked: the old reply and its state stay.
                let _ = self.session.restore(&after);
                self.last_finish = old_finish;
                self.messages.extend(last);
                self.before_last = Some((snapshot, ids, finish, fed));
                return Err(e);
            }
        };
        if let Some((role, old)) = last {
            // The rendering up to the cue is what was fed before the old reply.
            self.fed = format!(
                "{}{}",
                self.fed.strip_suffix(old.as_str()).unwrap_or(&self.fed),
                reply.text
            );
            self.messages.push((role, reply.text.clone()));
        }
        self.before_last = Some((snapshot, ids, finish, fed));
        Ok(reply)
    }

    fn reply(
        &mut self,
        ids: &[u32],
        opts: &GenerateOptions,
        mut on: impl FnMut(TurnEvent) -> bool,
    ) -> Result<Reply> {
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
        let (tokens, finish) =
            self.session
                .generate(ids, opts, |id| match decoder.step(tok, id) {
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
        Ok(Reply {
            text,
            tokens: tokens.len(),
            finish,
            fed: ids.len(),
        })
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

/// The tokens of a whole conversation rendered from scratch, ending with the cue for the
/// assistant's reply: what `Chat` feeds turn by turn, in one piece (the server's requests
/// carry the whole conversation each time; the prefix cache finds what was fed before).
/// With a template, its rendering with the tokenizer's special tokens unless the template
/// writes the BOS token itself; without one, the messages as plain text, each but the
/// replies after an end-of-text token, as `Chat` continues a conversation.
pub fn conversation_tokens(tok: &Tokenizer, messages: &[(String, String)]) -> Result<Vec<u32>> {
    if messages.is_empty() {
        return Err(Error::InvalidInput("the message list is empty".into()));
    }
    if let Some(text) = tok.render_chat(messages, true)? {
        let template_bos = tok
            .bos_token
            .as_deref()
            .is_some_and(|b| !b.is_empty() && text.starts_with(b));
        return tok.encode_with(&text, !template_bos);
    }
    // A reply follows its message directly; every other message after the first starts
    // after an end-of-text token.
    let mut ids = Vec::new();
    for (i, (role, content)) in messages.iter().enumerate() {
        if i > 0
            && role != "assistant"
            && let Some(eos) = tok.eos
        {
            ids.push(eos);
        }
        ids.extend(tok.encode_with(content, i == 0)?);
    }
    Ok(ids)
}
