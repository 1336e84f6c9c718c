//! Tokenizers for training data: a byte-level BPE trained here (GPT-2 split regex, so it maps to
//! GGUF `tokenizer.ggml.pre = "gpt-2"`), an HF `tokenizer.json`, or the BPE vocabulary embedded in
//! a GGUF (the SmolLM2 teacher's, for distillation). Identity = SHA-256 of the serialized JSON.

use std::path::Path;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::{io_err, sha256_hex, Error, Result};

/// Special tokens of a tokenizer trained here, at ids 0, 1, 2 (matching the presets' pad/bos/eos).
pub const SPECIALS: [&str; 3] = ["<|pad|>", "<|bos|>", "<|endoftext|>"];

pub struct Tok {
    pub inner: Tokenizer,
    /// SHA-256 of the canonical `tokenizer.json`.
    pub hash: String,
    /// The id placed between documents.
    pub separator: u32,
    pub vocab_size: usize,
}

fn terr(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tok {
    fn from_tokenizer(inner: Tokenizer) -> Result<Self> {
        let json = inner.to_string(false).map_err(terr)?;
        let vocab_size = inner.get_vocab_size(true);
        let separator =
            ["<|endoftext|>", "</s>", "<|im_end|>"].iter().find_map(|s| inner.token_to_id(s)).ok_or_else(|| {
                Error::Tokenizer("no document separator token (<|endoftext|>, </s> or <|im_end|>)".into())
            })?;
        Ok(Self { inner, hash: sha256_hex(json.as_bytes()), separator, vocab_size })
    }

    /// Train a byte-level BPE of `vocab` tokens on `texts`.
    pub fn train<'a>(texts: impl Iterator<Item = &'a str> + Send, vocab: usize) -> Result<Self> {
        if vocab < 256 + SPECIALS.len() {
            return Err(Error::Invalid(format!("--tokenizer bpe:{vocab}: a byte-level BPE needs at least 259 tokens")));
        }
        let mut tok = Tokenizer::new(BPE::default());
        tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tok.with_decoder(Some(ByteLevel::default()));
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(vocab)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(SPECIALS.iter().map(|s| AddedToken::from(*s, true)).collect())
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        tok.train(&mut trainer, texts).map_err(terr)?;
        Self::from_tokenizer(tok)
    }

    /// An HF `tokenizer.json`, or the vocabulary embedded in a `.gguf`.
    pub fn load(path: &Path) -> Result<Self> {
        if path.extension().is_some_and(|e| e == "gguf") {
            let f = k3_format::gguf::GgufFile::open(path).map_err(|e| Error::Tokenizer(e.to_string()))?;
            let t = k3_infer::tokenizer::Tokenizer::from_gguf(&f)
                .map_err(|e| Error::Tokenizer(e.to_string()))?
                .ok_or_else(|| Error::Tokenizer(format!("{}: the GGUF has no vocabulary", path.display())))?;
            return Self::from_tokenizer(t.into_inner());
        }
        Self::from_tokenizer(
            Tokenizer::from_file(path).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?,
        )
    }

    /// Parse `--tokenizer`: `bpe:N` (train on `texts`), a `tokenizer.json`, or a `.gguf`.
    pub fn from_spec<'a>(spec: &str, texts: impl Iterator<Item = &'a str> + Send) -> Result<Self> {
        match spec.strip_prefix("bpe:") {
            Some(n) => Self::train(
                texts,
                n.parse().map_err(|_| Error::Invalid(format!("--tokenizer {spec}: N must be an integer")))?,
            ),
            None => Self::load(Path::new(spec)),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, false).map_err(terr)?.get_ids().to_vec())
    }

    /// Save as `tokenizer.json` (what the dataset, checkpoints and GGUF export carry).
    pub fn save(&self, path: &Path) -> Result<()> {
        let json = self.inner.to_string(true).map_err(terr)?;
        std::fs::write(path, json).map_err(io_err(path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trained_bpe_round_trips_and_hash_is_stable() {
        let text = "def add(a, b):\n    return a + b\n".repeat(50) + &"The quick brown fox. ".repeat(50);
        let t = Tok::train(std::iter::once(text.as_str()), 300).expect("train");
        assert!(t.vocab_size > 259 && t.vocab_size <= 300, "{}", t.vocab_size); // fewer if merges run out
        assert_eq!(t.separator, 2);
        let ids = t.encode("def add(x, y):\n    return x + y").expect("encode");
        assert_eq!(t.inner.decode(&ids, false).expect("decode"), "def add(x, y):\n    return x + y");
        let d = std::env::temp_dir().join(format!("k3tok-{}.json", std::process::id()));
        t.save(&d).expect("save");
        let back = Tok::load(&d).expect("load");
        assert_eq!(back.hash, t.hash, "identity survives save/load");
        std::fs::remove_file(d).ok();
    }
}
