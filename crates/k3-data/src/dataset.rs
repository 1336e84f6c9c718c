//! `k3mini data build`: sources → deduplicated documents → train/val split → tokenizer →
//! token shards + `meta.json` + `tokenizer.json`; and opening a built dataset.

use std::path::{Path, PathBuf};

use crate::corpus::{collect, is_validation, CorpusStats, Source};
use crate::shards::{write_split, TokenSet};
use crate::tok::Tok;
use crate::{io_err, Error, Result};

pub const META_VERSION: u32 = 1;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DatasetMeta {
    pub version: u32,
    pub sources: Vec<String>,
    pub tokenizer_hash: String,
    pub vocab_size: usize,
    pub separator: u32,
    pub val_permille: u32,
    pub train_docs: usize,
    pub val_docs: usize,
    pub train_bytes: usize,
    pub val_bytes: usize,
    pub train_tokens: usize,
    pub val_tokens: usize,
    pub skipped_binary: usize,
    pub skipped_invalid_utf8: usize,
    pub skipped_too_large: usize,
    pub duplicates: usize,
}

impl DatasetMeta {
    pub fn bytes_per_token(&self) -> f64 {
        (self.train_bytes + self.val_bytes) as f64 / (self.train_tokens + self.val_tokens).max(1) as f64
    }
}

pub struct BuildOptions {
    pub sources: Vec<String>,
    pub tokenizer: String,
    pub out: PathBuf,
    pub val_permille: u32,
    /// Where downloaded sources are cached.
    pub cache: PathBuf,
}

/// Build a dataset. Returns its metadata (also written to `out/meta.json`).
pub fn build(o: &BuildOptions) -> Result<DatasetMeta> {
    let sources = o.sources.iter().map(|s| Source::parse(s)).collect::<Result<Vec<_>>>()?;
    if sources.is_empty() {
        return Err(Error::Invalid("give at least one --source (stdlib, english, pip:NAME==VERSION, dir:PATH)".into()));
    }
    let mut stats = CorpusStats::default();
    let docs = collect(&sources, &o.cache, &mut stats)?;
    if docs.is_empty() {
        return Err(Error::Invalid("the sources hold no usable documents".into()));
    }
    let (val, train): (Vec<_>, Vec<_>) = docs.iter().partition(|d| is_validation(d, o.val_permille));
    let tok = Tok::from_spec(&o.tokenizer, train.iter().map(|d| d.text.as_str()))?;
    std::fs::create_dir_all(&o.out).map_err(io_err(&o.out))?;
    let mut meta = DatasetMeta {
        version: META_VERSION,
        sources: o.sources.clone(),
        tokenizer_hash: tok.hash.clone(),
        vocab_size: tok.vocab_size,
        separator: tok.separator,
        val_permille: o.val_permille,
        train_docs: train.len(),
        val_docs: val.len(),
        train_bytes: train.iter().map(|d| d.text.len()).sum(),
        val_bytes: val.iter().map(|d| d.text.len()).sum(),
        train_tokens: 0,
        val_tokens: 0,
        skipped_binary: stats.skipped_binary,
        skipped_invalid_utf8: stats.skipped_invalid_utf8,
        skipped_too_large: stats.skipped_too_large,
        duplicates: stats.duplicates,
    };
    for (split, part) in [("train", &train), ("val", &val)] {
        let texts: Vec<&str> = part.iter().map(|d| d.text.as_str()).collect();
        let enc = tok.inner.encode_batch(texts, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut stream = Vec::new();
        for e in enc {
            stream.extend_from_slice(e.get_ids());
            stream.push(tok.separator);
        }
        if split == "train" {
            meta.train_tokens = stream.len();
        } else {
            meta.val_tokens = stream.len();
        }
        write_split(&o.out, split, &stream, tok.vocab_size, &tok.hash)?;
    }
    tok.save(&o.out.join("tokenizer.json"))?;
    let json = serde_json::to_string_pretty(&meta).map_err(|e| Error::Invalid(e.to_string()))?;
    k3_format::safetensors_io::write_atomic(&o.out.join("meta.json"), json.as_bytes())
        .map_err(|e| Error::Invalid(e.to_string()))?;
    Ok(meta)
}

/// A built dataset, opened for training.
pub struct Dataset {
    pub dir: PathBuf,
    pub meta: DatasetMeta,
    pub train: TokenSet,
    pub val: TokenSet,
}

impl Dataset {
    pub fn open(dir: &Path) -> Result<Self> {
        let mp = dir.join("meta.json");
        let text = std::fs::read_to_string(&mp).map_err(|e| {
            Error::Invalid(format!(
                "{}: {e}; is {} a dataset built with `k3mini data build`?",
                mp.display(),
                dir.display()
            ))
        })?;
        let meta: DatasetMeta =
            serde_json::from_str(&text).map_err(|e| Error::Invalid(format!("{}: {e}", mp.display())))?;
        if meta.version != META_VERSION {
            return Err(Error::Invalid(format!(
                "{}: dataset version {}, expected {META_VERSION}; rebuild it",
                mp.display(),
                meta.version
            )));
        }
        let train = TokenSet::open(dir, "train", &meta.tokenizer_hash, meta.vocab_size)?;
        let val = TokenSet::open(dir, "val", &meta.tokenizer_hash, meta.vocab_size)?;
        Ok(Self { dir: dir.to_path_buf(), meta, train, val })
    }

    /// The dataset's tokenizer.
    pub fn tokenizer(&self) -> Result<Tok> {
        let t = Tok::load(&self.dir.join("tokenizer.json"))?;
        if t.hash != self.meta.tokenizer_hash {
            return Err(Error::Invalid(format!(
                "{}: tokenizer.json does not match the shards' tokenizer hash",
                self.dir.display()
            )));
        }
        Ok(t)
    }
}
