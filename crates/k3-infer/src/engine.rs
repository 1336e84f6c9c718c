//! The engine: one model, several live sequences, prefill / decode on token ids, and a streaming
//! generation loop. Text never enters here (the tokenizer sits at the CLI / server edge).

use std::ops::ControlFlow;

use crate::model::{Logits, Model, SeqState};
use crate::sampler::{Sampler, SamplerConfig};
use crate::{Error, Result};

/// A handle to a live sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqId(usize);

struct Seq {
    state: SeqState,
    tokens: Vec<u32>,
}

pub struct Engine {
    pub model: Model,
    seqs: Vec<Option<Seq>>,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    MaxTokens,
    StopToken,
    Callback,
    Context,
}

#[derive(Debug, Clone)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub reason: StopReason,
}

impl Engine {
    pub fn new(model: Model) -> Self {
        Self { model, seqs: Vec::new() }
    }

    /// Start a new, empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        let seq = Seq { state: self.model.new_state(), tokens: Vec::new() };
        if let Some(i) = self.seqs.iter().position(Option::is_none) {
            self.seqs[i] = Some(seq);
            SeqId(i)
        } else {
            self.seqs.push(Some(seq));
            SeqId(self.seqs.len() - 1)
        }
    }

    /// Free a sequence's state.
    pub fn remove_sequence(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.get_mut(id.0) {
            *s = None;
        }
    }

    pub fn live_sequences(&self) -> usize {
        self.seqs.iter().filter(|s| s.is_some()).count()
    }

    fn seq(&mut self, id: SeqId) -> Result<&mut Seq> {
        self.seqs
            .get_mut(id.0)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::Invalid(format!("sequence {id:?} does not exist")))
    }

    /// The tokens a sequence holds so far.
    pub fn tokens(&mut self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.tokens)
    }

    /// Bytes of inference state a sequence holds.
    pub fn state_bytes(&mut self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.state.bytes())
    }

    /// Append tokens to a sequence; returns logits ([V] or [T, V]).
    pub fn feed(&mut self, id: SeqId, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let Engine { model, seqs } = self;
        let seq = seqs
            .get_mut(id.0)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::Invalid(format!("sequence {id:?} does not exist")))?;
        let out = model.forward(tokens, &mut seq.state, which)?;
        seq.tokens.extend_from_slice(tokens);
        Ok(out)
    }

    /// One decode step for several sequences at once: each gets its next token, and its logits
    /// [V] come back in the same order. The sequences go through the model together
    /// ([`Model::forward_batch`]: each weight read once for all of them). A sequence may appear
    /// once per step; on any error no sequence has moved.
    pub fn step(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>> {
        let Engine { model, seqs } = self;
        let mut slots: Vec<Option<&mut Seq>> = seqs.iter_mut().map(Option::as_mut).collect();
        let mut picked = Vec::with_capacity(batch.len());
        for &(id, _) in batch {
            match slots.get_mut(id.0).map(Option::take) {
                Some(Some(seq)) => picked.push(seq),
                _ if batch.iter().filter(|(other, _)| *other == id).count() > 1 => {
                    return Err(Error::Invalid(format!("sequence {id:?} appears more than once in one step")))
                }
                _ => return Err(Error::Invalid(format!("sequence {id:?} does not exist"))),
            }
        }
        let tokens: Vec<u32> = batch.iter().map(|&(_, tok)| tok).collect();
        let mut states: Vec<&mut SeqState> = picked.iter_mut().map(|s| &mut s.state).collect();
        let out = model.forward_batch(&tokens, &mut states)?;
        for (seq, &tok) in picked.iter_mut().zip(&tokens) {
            seq.tokens.push(tok);
        }
        Ok(out)
    }

    /// Prefill `prompt` into a sequence and sample up to `max_new` tokens, streaming each token id
    /// to `on_token` (which may stop generation). Stops at any of `stop_tokens` (not emitted) or at
    /// the context limit.
    pub fn generate(
        &mut self,
        id: SeqId,
        prompt: &[u32],
        max_new: usize,
        sampler: SamplerConfig,
        stop_tokens: &[u32],
        mut on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Generated> {
        let mut out = self.generate_many(&[(id, prompt)], max_new, sampler, stop_tokens, |_, t| on_token(t))?;
        Ok(out.remove(0))
    }

    /// [`Self::generate`] for several sequences at once: each prompt is prefilled into its
    /// sequence, then every sequence still going is decoded in one batched [`Self::step`] a
    /// token (each weight read once for all of them). Each sequence samples with its own
    /// [`Sampler`] built from `sampler` (the same seed, so a sequence draws what it would draw
    /// alone) and stops on its own: `max_new` tokens, a stop token, the context limit, or
    /// `on_token(job, token)` breaking. Results come back in the order of `jobs`. A sequence may
    /// appear once; on an error, sequences before the failing one may hold their prompts.
    pub fn generate_many(
        &mut self,
        jobs: &[(SeqId, &[u32])],
        max_new: usize,
        sampler: SamplerConfig,
        stop_tokens: &[u32],
        mut on_token: impl FnMut(usize, u32) -> ControlFlow<()>,
    ) -> Result<Vec<Generated>> {
        for (i, (id, _)) in jobs.iter().enumerate() {
            if jobs[..i].iter().any(|(other, _)| other == id) {
                return Err(Error::Invalid(format!("sequence {id:?} is given more than one prompt")));
            }
            self.seq(*id)?;
        }
        let n_ctx = self.model.n_ctx;
        let mut runs = Vec::with_capacity(jobs.len());
        for &(id, prompt) in jobs {
            let logits = self.feed(id, prompt, Logits::Last)?;
            runs.push((Sampler::new(sampler.clone()), logits, Vec::new(), None));
        }
        loop {
            let mut batch = Vec::new();
            let mut fed = Vec::new();
            for (j, (sampler, logits, out, done)) in runs.iter_mut().enumerate() {
                if done.is_some() {
                    continue;
                }
                let id = jobs[j].0;
                if out.len() >= max_new {
                    *done = Some(StopReason::MaxTokens);
                    continue;
                }
                let next = sampler.sample(logits, &self.seq(id)?.tokens);
                if stop_tokens.contains(&next) {
                    *done = Some(StopReason::StopToken);
                    continue;
                }
                out.push(next);
                if on_token(j, next).is_break() {
                    *done = Some(StopReason::Callback);
                } else if self.seq(id)?.tokens.len() + 1 > n_ctx {
                    *done = Some(StopReason::Context);
                } else {
                    batch.push((id, next));
                    fed.push(j);
                }
            }
            if batch.is_empty() {
                break;
            }
            for (j, logits) in fed.into_iter().zip(self.step(&batch)?) {
                runs[j].1 = logits;
            }
        }
        Ok(runs
            .into_iter()
            .map(|(_, _, tokens, done)| Generated { tokens, reason: done.expect("every run has stopped") })
            .collect())
    }
}
