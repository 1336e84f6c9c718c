//! Text ↔ token ids at the engine's edge: HF `tokenizer.json` or the BPE vocabulary embedded in
//! a GGUF (through the `tokenizers` crate), and chat templates rendered with minijinja.

use std::path::Path;

use k3_format::gguf::{GgufFile, Value};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

use crate::{Error, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
    /// Token strings by id (for chat-template special tokens and GGUF export).
    pub bos_str: Option<String>,
    pub eos_str: Option<String>,
}

fn terr(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Find a tokenizer for a model path: `tokenizer.json` inside a checkpoint directory, or the
    /// vocabulary embedded in a GGUF. `Ok(None)` when the model has none.
    pub fn for_model(path: &Path) -> Result<Option<Self>> {
        if path.is_dir() {
            let tj = path.join("tokenizer.json");
            if !tj.exists() {
                return Ok(None);
            }
            return Self::from_json_file(&tj).map(Some);
        }
        let f = GgufFile::open(path)?;
        Self::from_gguf(&f)
    }

    /// An HF `tokenizer.json` (with `tokenizer_config.json` beside it for the chat template and
    /// special tokens, when present).
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let mut t =
            Self { inner, bos: None, eos: None, add_bos: false, chat_template: None, bos_str: None, eos_str: None };
        let cfg = path.with_file_name("tokenizer_config.json");
        if let Ok(text) = std::fs::read_to_string(&cfg) {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::Tokenizer(format!("{}: {e}", cfg.display())))?;
            let tok = |k: &str| {
                v.get(k)
                    .and_then(|x| x.as_str().or_else(|| x.get("content").and_then(|c| c.as_str())))
                    .map(str::to_string)
            };
            t.bos_str = tok("bos_token");
            t.eos_str = tok("eos_token");
            t.bos = t.bos_str.as_deref().and_then(|s| t.inner.token_to_id(s));
            t.eos = t.eos_str.as_deref().and_then(|s| t.inner.token_to_id(s));
            t.add_bos = v.get("add_bos_token").and_then(|x| x.as_bool()).unwrap_or(false);
            t.chat_template = v.get("chat_template").and_then(|x| x.as_str()).map(str::to_string);
        }
        Ok(t)
    }

    /// The GPT-2-style BPE vocabulary llama.cpp stores in a GGUF (`tokenizer.ggml.*`).
    pub fn from_gguf(f: &GgufFile) -> Result<Option<Self>> {
        let model = f.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("none");
        if model == "none" || model == "no_vocab" {
            return Ok(None);
        }
        if model != "gpt2" {
            return Err(Error::Tokenizer(format!(
                "{}: tokenizer.ggml.model `{model}` is not supported (supported: gpt2 byte-level BPE)",
                f.path.display()
            )));
        }
        let strs = |key: &str| -> Result<Vec<String>> {
            f.get(key)
                .and_then(Value::as_array)
                .ok_or_else(|| Error::Tokenizer(format!("{}: missing `{key}`", f.path.display())))?
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| Error::Tokenizer(format!("{}: `{key}` holds a non-string", f.path.display())))
                })
                .collect()
        };
        let tokens = strs("tokenizer.ggml.tokens")?;
        let merges: Vec<(String, String)> = strs("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| match m.split_once(' ') {
                Some((a, b)) => Ok((a.to_string(), b.to_string())),
                None => Err(Error::Tokenizer(format!("{}: malformed merge `{m}`", f.path.display()))),
            })
            .collect::<Result<_>>()?;
        let types: Vec<u64> = f
            .get("tokenizer.ggml.token_type")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, s)| (s.clone(), i as u32)).collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(terr)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = f.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("gpt-2");
        let byte_level = ByteLevel::new(false, true, true);
        let pre_tok: PreTokenizerWrapper = match pre {
            // llama.cpp's SMOLLM / STARCODER-style: split digits individually, then GPT-2's regex.
            "smollm" | "starcoder" | "codeshell" => {
                Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
            }
            "gpt-2" | "default" => byte_level.into(),
            other => {
                return Err(Error::Tokenizer(format!(
                    "{}: pre-tokenizer `{other}` is not supported (supported: gpt-2, smollm)",
                    f.path.display()
                )))
            }
        };
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevel::default()));
        // Control tokens (type 3) match literally in text, as llama.cpp's parse_special does.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| types.get(*i).copied() == Some(3))
            .map(|(_, s)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(specials).map_err(terr)?;
        let id = |k: &str| f.get(k).and_then(Value::as_u64).map(|v| v as u32);
        let bos = id("tokenizer.ggml.bos_token_id");
        let eos = id("tokenizer.ggml.eos_token_id");
        Ok(Some(Self {
            bos_str: bos.and_then(|b| tokens.get(b as usize).cloned()),
            eos_str: eos.and_then(|e| tokens.get(e as usize).cloned()),
            inner,
            bos,
            eos,
            add_bos: f.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false),
            chat_template: f.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_string),
        }))
    }

    /// Encode text (special-token strings in the text are recognised); prepends BOS when the
    /// tokenizer asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(terr)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(terr)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn into_inner(self) -> tokenizers::Tokenizer {
        self.inner
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Render the chat template for a single user turn (and an optional system prompt), with the
    /// assistant prefix appended (`add_generation_prompt`).
    pub fn apply_chat(&self, system: Option<&str>, user: &str) -> Result<String> {
        let tpl = self.chat_template.as_deref().ok_or_else(|| {
            Error::Tokenizer("this model has no chat template (tokenizer.chat_template); drop --chat".into())
        })?;
        let mut env = minijinja::Environment::new();
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", tpl).map_err(terr)?;
        let mut messages = vec![];
        if let Some(s) = system {
            messages.push(minijinja::context! { role => "system", content => s });
        }
        messages.push(minijinja::context! { role => "user", content => user });
        env.get_template("chat")
            .map_err(terr)?
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_str.clone().unwrap_or_default(),
                eos_token => self.eos_str.clone().unwrap_or_default(),
            })
            .map_err(terr)
    }
}
