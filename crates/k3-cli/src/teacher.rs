//! The in-process teacher for online distillation and the student's sampler for on-policy
//! distillation: the pure-Rust engine behind k3-train's `Teacher` and `Policy` traits (the
//! training crate does not depend on the engine).

use std::path::Path;

use anyhow::{Context, Result};
use k3_data::signals::{top_k, TopK};
use k3_infer::{Model, SamplerConfig};
use k3_train::trainer::distill::{Policy, Teacher};

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

/// The student, sampled with our engine from the checkpoint the trainer last wrote.
pub struct EnginePolicy {
    model: Option<Model>,
    threads: usize,
}

impl EnginePolicy {
    pub fn new(threads: usize) -> Self {
        Self { model: None, threads: threads.max(1) }
    }
}

impl Policy for EnginePolicy {
    fn load(&mut self, checkpoint: &Path) -> std::result::Result<(), String> {
        let (mut m, _) = Model::load(checkpoint).map_err(|e| format!("{}: {e}", checkpoint.display()))?;
        m.compute = k3_infer::linear::Compute { threads: self.threads, exact: false };
        self.model = Some(m);
        Ok(())
    }

    fn sample(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        temperature: f64,
        seed: u64,
        stop: u32,
    ) -> std::result::Result<Vec<u32>, String> {
        let m = self.model.as_ref().ok_or("the sampler has no weights yet")?;
        let sampling = SamplerConfig { temperature: temperature as f32, seed, ..Default::default() };
        crate::native::continue_ids(m, prompt, max_new, sampling, Some(stop)).map_err(|e| e.to_string())
    }
}
