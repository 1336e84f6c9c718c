//! The in-process teacher for online distillation: the pure-Rust engine behind k3-train's
//! `Teacher` trait (the training crate does not depend on the engine).

use std::path::Path;

use anyhow::{Context, Result};
use k3_data::signals::{top_k, TopK};
use k3_infer::Model;
use k3_train::trainer::distill::Teacher;

pub struct EngineTeacher {
    model: Model,
    tokenizer_hash: String,
    vocab: usize,
}

impl EngineTeacher {
    pub fn load(path: &Path, threads: usize) -> Result<Self> {
        let tok = crate::capture::teacher_tokenizer(path)?;
        let (mut model, warnings) =
            Model::load(path).with_context(|| format!("loading the teacher {}", path.display()))?;
        for w in warnings {
            eprintln!("warning: {w}");
        }
        model.compute = k3_infer::linear::Compute { threads: threads.max(1), exact: false };
        Ok(Self { vocab: model.vocab_size(), model, tokenizer_hash: tok.hash })
    }
}

impl Teacher for EngineTeacher {
    fn top_k(&mut self, rows: &[Vec<u32>], k: usize) -> std::result::Result<Vec<Vec<TopK>>, String> {
        rows.iter()
            .map(|row| {
                let logp = crate::capture::teacher_logprobs(&self.model, row, 1.0).map_err(|e| format!("{e:#}"))?;
                Ok(logp.chunks_exact(self.vocab).map(|r| top_k(r, k)).collect())
            })
            .collect()
    }

    fn tokenizer(&self) -> (String, usize) {
        (self.tokenizer_hash.clone(), self.vocab)
    }
}
