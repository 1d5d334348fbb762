//! The `tokenizers` library behind a small API: encode, streaming decode that never emits
//! half a UTF-8 character, the end-of-sequence token and the chat template.

use std::path::Path;

use crate::error::{Error, Result};

/// A model's tokenizer plus what `tokenizer_config.json` says about it.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The token that ends a reply, when the tokenizer has one.
    pub eos: Option<u32>,
    /// The Jinja chat template of `tokenizer_config.json`, when present.
    pub chat_template: Option<String>,
    /// The BOS token's text, for templates that use it.
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` (and `tokenizer_config.json` when present) from a model dir.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Ok(None);
        }
        let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            let text =
                std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
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
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let token_text = |key: &str| -> Option<String> {
            let v = config?.get(key)?;
            v.as_str().map(str::to_string).or_else(|| {
                v.get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string)
            })
        };
        let eos_token = token_text("eos_token").or_else(|| {
            ["<|endoftext|>", "</s>", "<|im_end|>", "<|end_of_text|>"]
                .into_iter()
                .find(|t| inner.token_to_id(t).is_some())
                .map(str::to_string)
        });
        let eos = eos_token.as_deref().and_then(|t| inner.token_to_id(t));
        Ok(Tokenizer {
            chat_template: config
                .and_then(|c| c.get("chat_template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            bos_token: token_text("bos_token"),
            eos_token,
            eos,
            inner,
        })
    }

    /// Token ids of `text` (with the special tokens the tokenizer's post-processor adds).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
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
        env.render_str(template, ctx)
            .map(Some)
            .map_err(|e| Error::Tokenizer(format!("chat template: {e}")))
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
        tokenizers::tokenizer::step_decode_stream(
            &tok.inner,
            vec![id],
            true,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| Error::Tokenizer(e.to_string()))
    }
}
