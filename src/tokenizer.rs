//! The `tokenizers` library behind a small API: encode, streaming decode that never emits
//! half a UTF-8 character, the end-of-sequence token and the chat template.

use std::path::Path;
use tokenizers::{OffsetReferential, OffsetType};

use crate::error::{Error, Result};

/// SentencePiece-derived tokenizers carry a `Precompiled` normalizer whose base64
/// `precompiled_charsmap` starts with the byte size of a trie; the library reserves room for
/// that many entries before reading them, so a corrupt size asks for up to 8 GiB — even in
/// a file whose JSON breaks further on (it deserializes as it reads). So the check is
/// textual: every `"precompiled_charsmap": "…"` value's declared size against its bytes.
fn check_precompiled_charsmaps(bytes: &[u8]) -> Result<()> {
    const KEY: &[u8] = b"\"precompiled_charsmap\"";
    let bad = |why: String| {
        Err(Error::Tokenizer(format!(
            "normalizer `precompiled_charsmap`: {why}"
        )))
    };
    let mut rest = bytes;
    while let Some(at) = rest.windows(KEY.len()).position(|w| w == KEY) {
        rest = &rest[at + KEY.len()..];
        let value = rest.trim_ascii_start();
        let Some(value) = value.strip_prefix(b":").map(<[u8]>::trim_ascii_start) else {
            continue;
        };
        let Some(value) = value.strip_prefix(b"\"") else {
            continue; // not a string: the library refuses it
        };
        let Some(end) = value.iter().position(|&b| b == b'"' || b == b'\\') else {
            return bad("is an unterminated string".into());
        };
        if value[end] == b'\\' {
            return bad("holds an escape, which base64 never needs".into());
        }
        let Ok(raw) = base64::decode(&value[..end]) else {
            return bad("is not valid base64".into());
        };
        let Some(size) = raw
            .get(..4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        else {
            return bad(format!(
                "holds {} bytes, fewer than its 4-byte header",
                raw.len()
            ));
        };
        if size as usize > raw.len() - 4 {
            return bad(format!(
                "declares a {size}-byte trie but holds {} bytes after its header",
                raw.len() - 4
            ));
        }
    }
    Ok(())
}

thread_local! {
    /// Whether this thread is inside `guarded` (its panics are reported as errors).
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The chat template of `tokenizer_config.json`: a string, or the named templates
/// transformers also writes (a list of `{"name", "template"}` entries, or an object of
/// name → template), of which the one named `default` is the chat template (named ones
/// without it: none, as transformers applies none unasked); absent or null: none. A value
/// of any other shape is refused, naming the key, rather than taken as no template.
fn chat_template(config: Option<&serde_json::Value>) -> Result<Option<String>> {
    use serde_json::Value;
    let bad = |what: &str| Error::Tokenizer(format!("tokenizer_config.json: chat_template {what}"));
    // The `default` template among named ones, every entry checked.
    let pick = |named: Vec<(Option<&str>, Option<&Value>)>| {
        let mut found = None;
        for (name, template) in named {
            let (Some(name), Some(template)) = (name, template.and_then(Value::as_str)) else {
                return Err(bad(
                    "holds a named template whose name or text is not a string",
                ));
            };
            if name == "default" && found.is_none() {
                found = Some(template.to_string());
            }
        }
        Ok(found)
    };
    match config.and_then(|c| c.get("chat_template")) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(t)) => Ok(Some(t.clone())),
        Some(Value::Array(entries)) => pick(
            entries
                .iter()
                .map(|e| (e.get("name").and_then(Value::as_str), e.get("template")))
                .collect(),
        ),
        Some(Value::Object(map)) => pick(
            map.iter()
                .map(|(name, template)| (Some(name.as_str()), Some(template)))
                .collect(),
        ),
        Some(other) => {
            let kind = match other {
                Value::Bool(_) => "a boolean",
                _ => "a number",
            };
            Err(bad(&format!(
                "must be a string or named templates, found {kind}"
            )))
        }
    }
}

/// Runs a call into the `tokenizers` library, turning a panic inside it into an error:
/// some malformed tokenizer.json files load and then reach out-of-range slices and
/// `unwrap`s there (found by tests/fuzz/). The panic hook stays quiet for such calls,
/// so the user sees one clean error instead of a panic message.
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    static QUIET_HOOK: std::sync::Once = std::sync::Once::new();
    QUIET_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(|g| g.get()) {
                previous(info);
            }
        }));
    });
    let outer = GUARDED.with(|g| g.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(outer));
    result.unwrap_or_else(|payload| {
        let why = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(Error::Tokenizer(format!(
            "the tokenizers library failed on this tokenizer ({why}): its description is malformed"
        )))
    })
}

/// The most bytes a chat template's rendering may write (or four times the messages' bytes,
/// if more): a real template writes the conversation and some markup.
const TEMPLATE_OUTPUT: usize = 16 << 20;

/// Where a chat template renders: an error once it would hold more than `cap` bytes.
struct CappedOutput {
    bytes: Vec<u8>,
    cap: usize,
    over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + b.len() > self.cap {
            self.over = true;
            return Err(std::io::Error::other("chat template output cap"));
        }
        self.bytes.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The work a chat template may do for one rendering, in minijinja's fuel: one per
/// instruction, one per 64 bytes it writes or makes. 1M bounds a hostile template to ~64 MB
/// written or made (10M let a template build ~640 MB); a real template renders a long
/// conversation in a few thousand.
const TEMPLATE_FUEL: u64 = 1_000_000;

/// Whether a model has a token for a character of a text, where it leaves out those it has
/// none for (see `Tokenizer::refusing_uncovered`).
pub type Covers = std::sync::Arc<dyn Fn(char) -> bool + Send + Sync>;

/// A model's tokenizer plus what `tokenizer_config.json` says about it.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The token that ends a reply, when the tokenizer has one.
    pub eos: Option<u32>,
    /// The Jinja chat template of `tokenizer_config.json`, when present.
    pub chat_template: Option<String>,
    /// The BOS token's text, for templates that use it.
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Which characters the model has a token (or byte tokens) for, where it leaves out
    /// the others without a word: a vocabulary rebuilt from GGUF metadata without byte
    /// tokens or an unknown token. `encode` refuses a text with another character outside
    /// the added tokens.
    covers: Option<Covers>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` (and `tokenizer_config.json` when present) from a model dir.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let bytes = crate::files::read_bounded(&path, crate::files::MAX_TOKENIZER_BYTES)?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            let text = crate::files::read_text(&config_path, crate::files::MAX_JSON_BYTES)?;
            Some(
                serde_json::from_str(&text)
                    .map_err(|e| Error::format(&config_path, format!("not valid JSON: {e}")))?,
            )
        } else {
            None
        };
        Self::from_bytes(&bytes, config.as_ref())
            .map(Some)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// Builds from `tokenizer.json` bytes and an optional parsed `tokenizer_config.json`.
    pub fn from_bytes(bytes: &[u8], config: Option<&serde_json::Value>) -> Result<Self> {
        guarded(|| Self::build(bytes, config))
    }

    fn build(bytes: &[u8], config: Option<&serde_json::Value>) -> Result<Self> {
        check_precompiled_charsmaps(bytes)?;
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        // Padding and truncation serve batched training: here they would cut a prompt
        // silently or pad each one to the file's length (a hostile file asks for 10^8).
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let token_text = |key: &str| -> Option<String> {
            let v = config?.get(key)?;
            v.as_str().map(str::to_string).or_else(|| {
                v.get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string)
            })
        };
        // A named end token the vocabulary lacks would never end a reply: refused.
        let named_eos = token_text("eos_token");
        if let Some(t) = &named_eos
            && inner.token_to_id(t).is_none()
        {
            return Err(Error::Tokenizer(format!(
                "tokenizer_config.json: eos_token `{t}` is not a token of the vocabulary"
            )));
        }
        let eos_token = named_eos.or_else(|| {
            ["<|endoftext|>", "</s>", "<|im_end|>", "<|end_of_text|>"]
                .into_iter()
                .find(|t| inner.token_to_id(t).is_some())
                .map(str::to_string)
        });
        let eos = eos_token.as_deref().and_then(|t| inner.token_to_id(t));
        Ok(Tokenizer {
            chat_template: chat_template(config)?,
            bos_token: token_text("bos_token"),
            eos_token,
            eos,
            inner,
            covers: None,
        })
    }

    /// The same tokenizer, refusing a text with a character `covers` says the model has no
    /// token for (`encode` names the first) instead of leaving it out.
    pub fn refusing_uncovered(self, covers: Covers) -> Self {
        Tokenizer {
            covers: Some(covers),
            ..self
        }
    }

    /// The first character of `text` the model has no token for, with its byte offset,
    /// outside the added tokens (which never reach the model): the text's splits as the
    /// tokenizer makes them, redone only where some character is not covered.
    fn uncovered(&self, text: &str, covers: &Covers) -> Option<(usize, char)> {
        if text.chars().all(|c| covers(c)) {
            return None;
        }
        let splits = self
            .inner
            .get_added_vocabulary()
            .extract_and_normalize(self.inner.get_normalizer(), text);
        splits
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .filter(|(_, _, added)| added.is_none())
            .find_map(|(_, (a, b), _)| {
                let part = text.get(a..b)?;
                let (i, c) = part.char_indices().find(|&(_, c)| !covers(c))?;
                Some((a + i, c))
            })
    }

    /// Token ids of `text` (with the special tokens the tokenizer's post-processor adds).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        guarded(|| {
            let enc = self
                .inner
                .encode(text, add_special)
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            if let Some(covers) = &self.covers
                && let Some((at, c)) = self.uncovered(text, covers)
            {
                return Err(Error::Tokenizer(format!(
                    "the text's character {c:?} (U+{:04X}, byte {at}) has no token in this \
                     vocabulary, which has neither byte tokens nor an unknown token for it",
                    c as u32
                )));
            }
            Ok(enc.get_ids().to_vec())
        })
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        guarded(|| {
            self.inner
                .decode(ids, true)
                .map_err(|e| Error::Tokenizer(e.to_string()))
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Renders a conversation with the model's chat template (`tokenizer_config.json`):
    /// `messages` as (role, content) pairs; `add_generation_prompt` appends the cue for the
    /// assistant's turn. `None` when the model has no template.
    pub fn render_chat(
        &self,
        messages: &[(String, String)],
        add_generation_prompt: bool,
    ) -> Result<Option<String>> {
        let Some(template) = &self.chat_template else {
            return Ok(None);
        };
        let mut env = minijinja::Environment::new();
        // A template comes with the model: bound its work so that a hostile one (nested
        // loops over huge ranges) is an error, not a hang. Real templates render a long
        // conversation in a few thousand instructions.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let msgs: Vec<minijinja::Value> = messages
            .iter()
            .map(|(role, content)| minijinja::context! { role => role, content => content })
            .collect();
        let ctx = minijinja::context! {
            messages => msgs,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        // The output goes through a capped writer: fuel is charged for what an instruction
        // wrote only after it ran, so one `{{ … }}` of a huge value would otherwise be
        // written whole first.
        let cap = TEMPLATE_OUTPUT.max(
            4 * messages
                .iter()
                .map(|(r, c)| r.len() + c.len())
                .sum::<usize>(),
        );
        let mut out = CappedOutput {
            bytes: Vec::new(),
            cap,
            over: false,
        };
        let rendered = env
            .template_from_str(template)
            .and_then(|t| t.render_captured_to(ctx, &mut out));
        if out.over {
            return Err(Error::Tokenizer(format!(
                "chat template: it writes more than {} MiB for {} messages (a broken or hostile \
                 template)",
                cap >> 20,
                messages.len()
            )));
        }
        rendered.map_err(|e| Error::Tokenizer(format!("chat template: {e}")))?;
        String::from_utf8(out.bytes)
            .map(Some)
            .map_err(|e| Error::Tokenizer(format!("chat template: its output is not UTF-8: {e}")))
    }

    /// A fresh streaming decoder.
    pub fn stream(&self) -> StreamDecoder {
        StreamDecoder::default()
    }
}

/// Turns a stream of ids into text pieces; a piece is released only once its bytes form
/// whole UTF-8 characters.
#[derive(Default, Clone)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl StreamDecoder {
    /// The text that `id` completes, if any.
    pub fn step(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        guarded(|| {
            tokenizers::tokenizer::step_decode_stream(
                &tok.inner,
                vec![id],
                true,
                &mut self.ids,
                &mut self.prefix,
                &mut self.prefix_index,
            )
            .map_err(|e| Error::Tokenizer(e.to_string()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Tokenizer;

    /// The embedded tokenizer with `config` as its tokenizer_config.json.
    fn with(config: serde_json::Value) -> crate::Result<Tokenizer> {
        Tokenizer::from_bytes(include_bytes!("../assets/tokenizer.json"), Some(&config))
    }

    #[test]
    fn an_eos_token_outside_the_vocabulary_is_refused() {
        let e = with(serde_json::json!({"eos_token": "<not-a-token>"}))
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("tokenizer_config.json: eos_token `<not-a-token>` is not a token"),
            "{e}"
        );
        let t = with(serde_json::json!({"eos_token": "<|endoftext|>"})).unwrap();
        assert_eq!(t.eos, Some(0));
    }

    #[test]
    fn chat_templates_as_a_string_or_named_and_nothing_else() {
        let t = with(serde_json::json!({"chat_template": "A"})).unwrap();
        assert_eq!(t.chat_template.as_deref(), Some("A"));
        let named = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]});
        assert_eq!(with(named).unwrap().chat_template.as_deref(), Some("D"));
        let map = serde_json::json!({"chat_template": {"rag": "R", "default": "D"}});
        assert_eq!(with(map).unwrap().chat_template.as_deref(), Some("D"));
        let no_default = serde_json::json!({"chat_template": [{"name": "rag", "template": "R"}]});
        assert_eq!(with(no_default).unwrap().chat_template, None);
        assert_eq!(with(serde_json::json!({})).unwrap().chat_template, None);
        let bad = [
            (serde_json::json!(42), "found a number"),
            (serde_json::json!(true), "found a boolean"),
            (
                serde_json::json!([{"name": 1}]),
                "name or text is not a string",
            ),
            (
                serde_json::json!({"default": 7}),
                "name or text is not a string",
            ),
        ];
        for (value, want) in bad {
            let e = with(serde_json::json!({ "chat_template": value }))
                .err()
                .expect("refused")
                .to_string();
            assert!(
                e.contains("tokenizer_config.json: chat_template") && e.contains(want),
                "{e}"
            );
        }
    }
}
