//! The teacher-signal store: what a teacher said about token windows, captured once and read by
//! every distillation run.
//!
//! A store is a directory: `store.json` (the self-describing header: tokenizer hash, vocab, k,
//! capture temperature, tail policy, the teacher's identity, the dataset) and append-only shards
//! `sig-NNNNN.bin` of records. A record is
//! ```text
//! u32 magic "K3SR" · u8 kind · u8[3] 0 · u32 payload length · u32 CRC-32 of the payload · payload
//! ```
//! so a reader (memory-mapped) stops at the first torn or corrupt record, and a resumed capture
//! truncates the shard there and continues with the next window: `kill -9` neither duplicates nor
//! loses a window.
//!
//! Kinds: [`Kind::Window`] (teacher-forced top-k over a dataset window), [`Kind::Trajectory`]
//! (a prompt and the teacher's generated continuation with its top-k) and [`Kind::RouterStats`]
//! (a MoE teacher's per-layer expert counts). Per predicted position the top-k is stored as the
//! top-1 log-probability (f16), the log of the mass outside the top-k (f16), then k pairs of token
//! id (u16 when the vocabulary fits, else u32) and the log-probability's distance below the top-1
//! in steps of 1/16 nat (u8, saturating at 255 = 15.9 nats): 2 + 2 + 3k bytes (u16 ids).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::{io_err, Error, Result};

pub const FORMAT: &str = "k3mini-teacher-signals";
pub const VERSION: u32 = 1;
const MAGIC: &[u8; 4] = b"K3SR";
const REC_HEADER: usize = 16;
/// Log-probability quantum: 1/16 nat.
pub const LP_STEP: f32 = 1.0 / 16.0;
/// Bytes per shard before the writer starts the next one.
const SHARD_BYTES: u64 = 256 << 20;

/// What happens to the probability mass outside the stored top-k when a loss uses it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum TailPolicy {
    /// Renormalise the top-k to sum to 1.
    Renormalize,
    /// Use the top-k probabilities as they are; the rest does not enter the loss.
    Ignore,
    /// Spread the stored tail mass uniformly over the other V − k tokens.
    Uniform,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TeacherId {
    /// `gguf`, `checkpoint` or `openai`.
    pub kind: String,
    /// File name, checkpoint directory or endpoint URL + model.
    pub name: String,
    /// SHA-256 of the weights file(s) for local teachers; the endpoint's model id otherwise.
    pub fingerprint: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoreHeader {
    pub format: String,
    pub version: u32,
    pub tokenizer_hash: String,
    pub vocab_size: usize,
    pub top_k: usize,
    /// Temperature the teacher's distribution was captured at.
    pub temperature: f32,
    /// The tail policy the capture recommends (losses may choose another).
    pub tail: TailPolicy,
    pub teacher: TeacherId,
    /// The dataset the windows come from (directory and its tokenizer hash), if any.
    pub dataset: Option<String>,
    /// Tokens per teacher-forced window (inputs + the last target).
    pub window: usize,
    /// Which slots of the split the windows cover, in capture order.
    #[serde(default)]
    pub window_order: WindowOrder,
}

/// The order in which a capture visits the split's window slots (slot s = tokens [s·T, s·T+T+1)).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum WindowOrder {
    /// Slot i for window i: the split's beginning first (its first documents only).
    #[default]
    Sequential,
    /// A fixed permutation of all slots (window i → slot (i·P + M/2) mod M, P coprime to M), so
    /// any prefix of the capture is spread over the whole split; extending a capture keeps it so.
    Spread,
}

impl WindowOrder {
    /// The slot of window `i` among `m` slots.
    pub fn slot(self, i: usize, m: usize) -> usize {
        match self {
            WindowOrder::Sequential => i,
            WindowOrder::Spread => {
                let m64 = m.max(1) as u64;
                let mut p = 0x9E37_79B1u64 % m64;
                while gcd(p.max(1), m64) != 1 {
                    p += 1;
                }
                ((i as u64 * p.max(1) + m64 / 2) % m64) as usize
            }
        }
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Window = 0,
    Trajectory = 1,
    RouterStats = 2,
}

/// One predicted position's top-k, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct TopK {
    pub ids: Vec<u32>,
    /// Natural-log probabilities, descending.
    pub logprobs: Vec<f32>,
    /// log of the probability mass outside `ids` (−inf when none).
    pub tail_logmass: f32,
}

/// A teacher-forced window: `tokens` [n] and the teacher's top-k after each of the first n − 1.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowRecord {
    pub index: u64,
    /// Offset of the window in the dataset split.
    pub start: u64,
    pub tokens: Vec<u32>,
    pub positions: Vec<TopK>,
}

/// A prompt, the teacher's continuation, and its top-k at every generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct Trajectory {
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
    pub positions: Vec<TopK>,
    /// A reasoning model's separate reasoning text (`reasoning_content`), when it sent one.
    pub reasoning: Option<String>,
}

fn crc32(b: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(b);
    h.finalize()
}

fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_bits().to_le_bytes()
}

fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Encode one position (`ids`/`logprobs` descending, `k` of them).
fn encode_topk(out: &mut Vec<u8>, t: &TopK, wide: bool) {
    let top = t.logprobs.first().copied().unwrap_or(0.0);
    out.extend_from_slice(&f16_bytes(top));
    out.extend_from_slice(&f16_bytes(t.tail_logmass));
    for (&id, &lp) in t.ids.iter().zip(&t.logprobs) {
        if wide {
            out.extend_from_slice(&id.to_le_bytes());
        } else {
            out.extend_from_slice(&(id as u16).to_le_bytes());
        }
        out.push(((top - lp) / LP_STEP).round().clamp(0.0, 255.0) as u8);
    }
}

fn decode_topk(b: &[u8], k: usize, wide: bool) -> TopK {
    let top = f16_at(b);
    let tail = f16_at(&b[2..]);
    let w = if wide { 5 } else { 3 };
    let (mut ids, mut logprobs) = (Vec::with_capacity(k), Vec::with_capacity(k));
    for e in b[4..4 + k * w].chunks_exact(w) {
        ids.push(if wide {
            u32::from_le_bytes([e[0], e[1], e[2], e[3]])
        } else {
            u16::from_le_bytes([e[0], e[1]]) as u32
        });
        logprobs.push(top - e[w - 1] as f32 * LP_STEP);
    }
    TopK { ids, logprobs, tail_logmass: tail }
}

impl StoreHeader {
    fn wide(&self) -> bool {
        self.vocab_size > u16::MAX as usize + 1
    }
    /// Bytes one predicted position takes.
    pub fn bytes_per_position(&self) -> usize {
        4 + self.top_k * if self.wide() { 5 } else { 3 }
    }
    pub fn encode_window(&self, w: &WindowRecord) -> Vec<u8> {
        let mut p = Vec::with_capacity(20 + 4 * w.tokens.len() + w.positions.len() * self.bytes_per_position());
        p.extend_from_slice(&w.index.to_le_bytes());
        p.extend_from_slice(&w.start.to_le_bytes());
        p.extend_from_slice(&(w.tokens.len() as u32).to_le_bytes());
        for &t in &w.tokens {
            p.extend_from_slice(&t.to_le_bytes());
        }
        for t in &w.positions {
            encode_topk(&mut p, t, self.wide());
        }
        p
    }
    fn decode_window(&self, p: &[u8]) -> Result<WindowRecord> {
        let bad = || Error::Invalid("teacher-signal record: payload shorter than its fields".into());
        let u64_at = |o: usize| p.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
        let index = u64_at(0).ok_or_else(bad)?;
        let start = u64_at(8).ok_or_else(bad)?;
        let n = p.get(16..20).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).ok_or_else(bad)? as usize;
        let tok_end = 20 + 4 * n;
        let tokens: Vec<u32> = p
            .get(20..tok_end)
            .ok_or_else(bad)?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let per = self.bytes_per_position();
        let body = p.get(tok_end..).ok_or_else(bad)?;
        if body.len() % per != 0 {
            return Err(bad());
        }
        let positions = body.chunks_exact(per).map(|b| decode_topk(b, self.top_k, self.wide())).collect();
        Ok(WindowRecord { index, start, tokens, positions })
    }
}

fn shard_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("sig-{i:05}.bin"))
}

fn shards(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    while shard_path(dir, v.len()).exists() {
        v.push(shard_path(dir, v.len()));
    }
    v
}

/// Walk the valid records of a shard's bytes: `(offset, kind, payload range)`, stopping at the
/// first torn or corrupt record. Returns the records and the length of the valid prefix.
fn scan(bytes: &[u8]) -> (Vec<(u8, std::ops::Range<usize>)>, usize) {
    let mut recs = Vec::new();
    let mut o = 0;
    while o + REC_HEADER <= bytes.len() {
        let h = &bytes[o..o + REC_HEADER];
        if &h[..4] != MAGIC {
            break;
        }
        let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let crc = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
        let end = o + REC_HEADER + len;
        if end > bytes.len() || crc32(&bytes[o + REC_HEADER..end]) != crc {
            break;
        }
        recs.push((h[4], o + REC_HEADER..end));
        o = end;
    }
    (recs, o)
}

fn read_header(dir: &Path) -> Result<StoreHeader> {
    let p = dir.join("store.json");
    let text = std::fs::read_to_string(&p).map_err(|e| {
        Error::Invalid(format!("{}: {e}; is {} a teacher-signal store (k3mini capture)?", p.display(), dir.display()))
    })?;
    let h: StoreHeader = serde_json::from_str(&text).map_err(|e| Error::Invalid(format!("{}: {e}", p.display())))?;
    if h.format != FORMAT || h.version != VERSION {
        return Err(Error::Invalid(format!(
            "{}: format {} v{}, this build reads {FORMAT} v{VERSION}; capture it again",
            p.display(),
            h.format,
            h.version
        )));
    }
    Ok(h)
}

/// Appends records; crash-safe as the module doc says.
pub struct SignalWriter {
    dir: PathBuf,
    pub header: StoreHeader,
    file: File,
    shard: usize,
    len: u64,
    /// The highest window index already stored (`None` when there is none).
    pub last_window: Option<u64>,
    /// Records already stored, per kind.
    pub counts: [usize; 3],
}

impl SignalWriter {
    /// Create a store, or reopen one written with the same header (dropping a torn last record).
    pub fn open(dir: &Path, header: StoreHeader) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        if dir.join("store.json").exists() {
            let old = read_header(dir)?;
            if old != header {
                return Err(Error::Invalid(format!(
                    "{}: the store was captured with a different teacher, tokenizer, k, temperature, dataset or \
                     window ({} k={} T={} vs {} k={} T={}); use a new --out",
                    dir.display(),
                    old.teacher.name,
                    old.top_k,
                    old.temperature,
                    header.teacher.name,
                    header.top_k,
                    header.temperature
                )));
            }
        } else {
            let json = serde_json::to_string_pretty(&header).map_err(|e| Error::Invalid(e.to_string()))?;
            k3_format::safetensors_io::write_atomic(&dir.join("store.json"), json.as_bytes())
                .map_err(|e| Error::Invalid(e.to_string()))?;
        }
        let existing = shards(dir);
        let mut last_window = None;
        let mut counts = [0usize; 3];
        let mut tail = (0usize, 0u64);
        for (i, p) in existing.iter().enumerate() {
            let bytes = std::fs::read(p).map_err(io_err(p))?;
            let (recs, valid) = scan(&bytes);
            for (kind, range) in &recs {
                if let Some(c) = counts.get_mut(*kind as usize) {
                    *c += 1;
                }
                if *kind == Kind::Window as u8 {
                    let idx = u64::from_le_bytes(bytes[range.start..range.start + 8].try_into().unwrap_or_default());
                    last_window = Some(last_window.map_or(idx, |l: u64| l.max(idx)));
                }
            }
            if valid < bytes.len() {
                // A torn record from an interrupted capture: cut it off.
                let f = OpenOptions::new().write(true).open(p).map_err(io_err(p))?;
                f.set_len(valid as u64).map_err(io_err(p))?;
                f.sync_all().map_err(io_err(p))?;
            }
            tail = (i, valid as u64);
        }
        let (shard, len) = if existing.is_empty() { (0, 0) } else { tail };
        let path = shard_path(dir, shard);
        let file = OpenOptions::new().create(true).append(true).open(&path).map_err(io_err(&path))?;
        Ok(Self { dir: dir.to_path_buf(), header, file, shard, len, last_window, counts })
    }

    fn append(&mut self, kind: Kind, payload: &[u8]) -> Result<()> {
        if self.len >= SHARD_BYTES {
            self.sync()?;
            self.shard += 1;
            self.len = 0;
            let path = shard_path(&self.dir, self.shard);
            self.file = OpenOptions::new().create(true).append(true).open(&path).map_err(io_err(&path))?;
        }
        let mut rec = Vec::with_capacity(REC_HEADER + payload.len());
        rec.extend_from_slice(MAGIC);
        rec.extend_from_slice(&[kind as u8, 0, 0, 0]);
        rec.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        rec.extend_from_slice(&crc32(payload).to_le_bytes());
        rec.extend_from_slice(payload);
        let path = shard_path(&self.dir, self.shard);
        self.file.write_all(&rec).map_err(io_err(&path))?;
        self.len += rec.len() as u64;
        self.counts[kind as usize] += 1;
        Ok(())
    }

    pub fn append_window(&mut self, w: &WindowRecord) -> Result<()> {
        let p = self.header.encode_window(w);
        self.append(Kind::Window, &p)?;
        self.last_window = Some(self.last_window.map_or(w.index, |l| l.max(w.index)));
        Ok(())
    }

    /// A trajectory: the prompt, the teacher's continuation and its top-k per generated token.
    pub fn append_trajectory(&mut self, prompt: &[u32], generated: &[u32], positions: &[TopK]) -> Result<()> {
        self.append_trajectory_with(prompt, generated, positions, None)
    }

    /// [`Self::append_trajectory`] with the teacher's separate reasoning text, stored after the
    /// positions as `u32 length + UTF-8` (records without it end at the positions).
    pub fn append_trajectory_with(
        &mut self,
        prompt: &[u32],
        generated: &[u32],
        positions: &[TopK],
        reasoning: Option<&str>,
    ) -> Result<()> {
        if positions.len() != generated.len() || positions.iter().any(|p| p.ids.len() != self.header.top_k) {
            return Err(Error::Invalid(format!(
                "trajectory: {} generated tokens need as many top-{} positions, got {}",
                generated.len(),
                self.header.top_k,
                positions.len()
            )));
        }
        let mut p = Vec::new();
        p.extend_from_slice(&(prompt.len() as u32).to_le_bytes());
        p.extend_from_slice(&(generated.len() as u32).to_le_bytes());
        for &t in prompt.iter().chain(generated) {
            p.extend_from_slice(&t.to_le_bytes());
        }
        for t in positions {
            encode_topk(&mut p, t, self.header.wide());
        }
        if let Some(r) = reasoning {
            p.extend_from_slice(&(r.len() as u32).to_le_bytes());
            p.extend_from_slice(r.as_bytes());
        }
        self.append(Kind::Trajectory, &p)
    }

    /// A MoE teacher's routing counts: per layer, tokens routed to each expert.
    pub fn append_router_stats(&mut self, layers: &[(u32, Vec<f32>)]) -> Result<()> {
        let mut p = Vec::new();
        p.extend_from_slice(&(layers.len() as u32).to_le_bytes());
        for (l, counts) in layers {
            p.extend_from_slice(&l.to_le_bytes());
            p.extend_from_slice(&(counts.len() as u32).to_le_bytes());
            for c in counts {
                p.extend_from_slice(&c.to_le_bytes());
            }
        }
        self.append(Kind::RouterStats, &p)
    }

    /// Make everything appended so far durable.
    pub fn sync(&mut self) -> Result<()> {
        let path = shard_path(&self.dir, self.shard);
        self.file.sync_data().map_err(io_err(&path))
    }
}

/// A store opened for reading (memory-mapped).
pub struct SignalStore {
    pub dir: PathBuf,
    pub header: StoreHeader,
    maps: Vec<Mmap>,
    /// (shard, payload range) of every window record, in window-index order.
    windows: Vec<(usize, std::ops::Range<usize>)>,
    /// (shard, payload range) of every trajectory record, in the order written.
    trajectory_records: Vec<(usize, std::ops::Range<usize>)>,
    pub trajectories: usize,
    pub router_stats: usize,
    /// Bytes of all valid records.
    pub bytes: u64,
}

impl SignalStore {
    pub fn open(dir: &Path) -> Result<Self> {
        let header = read_header(dir)?;
        let mut maps = Vec::new();
        let mut windows: Vec<(u64, usize, std::ops::Range<usize>)> = Vec::new();
        let (mut trajectories, mut router_stats, mut bytes) = (0, 0, 0u64);
        let mut trajectory_records = Vec::new();
        for (i, p) in shards(dir).iter().enumerate() {
            let f = File::open(p).map_err(io_err(p))?;
            // SAFETY: read-only mapping; writers only append past the valid prefix we index.
            let m = unsafe { Mmap::map(&f) }.map_err(io_err(p))?;
            let (recs, valid) = scan(&m);
            bytes += valid as u64;
            for (kind, range) in recs {
                match kind {
                    0 => {
                        let idx = u64::from_le_bytes(m[range.start..range.start + 8].try_into().unwrap_or_default());
                        windows.push((idx, i, range));
                    }
                    1 => {
                        trajectories += 1;
                        trajectory_records.push((i, range));
                    }
                    2 => router_stats += 1,
                    _ => {}
                }
            }
            maps.push(m);
        }
        windows.sort_by_key(|w| w.0);
        if windows.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(Error::Invalid(format!("{}: a window is stored twice; the store is corrupt", dir.display())));
        }
        let windows = windows.into_iter().map(|(_, s, r)| (s, r)).collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            header,
            maps,
            windows,
            trajectory_records,
            trajectories,
            router_stats,
            bytes,
        })
    }

    /// Check the store against the tokenizer the student uses.
    pub fn check_tokenizer(&self, tokenizer_hash: &str, vocab: usize) -> Result<()> {
        if self.header.tokenizer_hash != tokenizer_hash || self.header.vocab_size != vocab {
            return Err(Error::Invalid(format!(
                "{}: captured with tokenizer {}… (vocab {}), but the student's data uses {}… (vocab {}); the \
                 student must use the teacher's tokenizer — build the dataset with --tokenizer TEACHER.gguf",
                self.dir.display(),
                &self.header.tokenizer_hash[..12.min(self.header.tokenizer_hash.len())],
                self.header.vocab_size,
                &tokenizer_hash[..12.min(tokenizer_hash.len())],
                vocab
            )));
        }
        Ok(())
    }

    pub fn num_windows(&self) -> usize {
        self.windows.len()
    }

    /// Window record `i` (in index order).
    pub fn window(&self, i: usize) -> Result<WindowRecord> {
        let (s, r) = &self.windows[i];
        self.header.decode_window(&self.maps[*s][r.clone()])
    }

    /// Trajectory `i` (in the order captured).
    pub fn trajectory(&self, i: usize) -> Result<Trajectory> {
        let (s, r) = &self.trajectory_records[i];
        let p = &self.maps[*s][r.clone()];
        let bad =
            || Error::Invalid(format!("{}: trajectory record {i} is shorter than its fields", self.dir.display()));
        let u32_at = |o: usize| p.get(o..o + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let (np, ng) = (u32_at(0).ok_or_else(bad)? as usize, u32_at(4).ok_or_else(bad)? as usize);
        let ids: Vec<u32> = (0..np + ng).map(|j| u32_at(8 + 4 * j)).collect::<Option<_>>().ok_or_else(bad)?;
        let body = p.get(8 + 4 * (np + ng)..).ok_or_else(bad)?;
        let per = self.header.bytes_per_position();
        let (body, rest) = body.split_at_checked(ng * per).ok_or_else(bad)?;
        let reasoning = match rest.len() {
            0 => None,
            n if n >= 4 && u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize == n - 4 => {
                Some(String::from_utf8(rest[4..].to_vec()).map_err(|_| bad())?)
            }
            _ => return Err(bad()),
        };
        let positions = body.chunks_exact(per).map(|b| decode_topk(b, self.header.top_k, self.header.wide())).collect();
        Ok(Trajectory { prompt: ids[..np].to_vec(), generated: ids[np..].to_vec(), positions, reasoning })
    }

    /// Bytes per predicted position, all records included.
    pub fn bytes_per_token(&self) -> f64 {
        // A trajectory payload starts with (prompt length, generated length) as u32.
        let traj: usize = self
            .trajectory_records
            .iter()
            .filter_map(|(sh, r)| self.maps[*sh].get(r.start + 4..r.start + 8))
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .sum();
        let positions: usize = self.windows.len() * self.header.window.saturating_sub(1) + traj;
        self.bytes as f64 / positions.max(1) as f64
    }
}

/// `t` as a reader of the store gets it back (ids kept, log-probabilities quantized).
pub fn decode_roundtrip(t: &TopK, header: &StoreHeader) -> TopK {
    let mut b = Vec::with_capacity(header.bytes_per_position());
    encode_topk(&mut b, t, header.wide());
    decode_topk(&b, t.ids.len(), header.wide())
}

pub use crate::topk::{reconstruction_kl, top_k};

#[cfg(test)]
mod tests {
    use super::*;

    fn header(vocab: usize, k: usize) -> StoreHeader {
        StoreHeader {
            format: FORMAT.into(),
            version: VERSION,
            tokenizer_hash: "ab".repeat(32),
            vocab_size: vocab,
            top_k: k,
            temperature: 1.0,
            tail: TailPolicy::Uniform,
            teacher: TeacherId { kind: "gguf".into(), name: "t.gguf".into(), fingerprint: "00".into() },
            dataset: None,
            window: 5,
            window_order: WindowOrder::Sequential,
        }
    }

    fn dense(v: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let logits: Vec<f64> = (0..v)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 10_000) as f64 / 1000.0
            })
            .collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        logits.iter().map(|l| (l - m - z.ln()) as f32).collect()
    }

    #[test]
    fn round_trip_resume_and_torn_records() {
        let tmp = tempfile::Builder::new().prefix("k3sig-").tempdir().expect("scratch dir");
        let d = tmp.path().to_path_buf();
        let h = header(300, 8);
        let win = |i: u64| WindowRecord {
            index: i,
            start: i * 4,
            tokens: (0..5).map(|t| (i as u32 * 7 + t) % 300).collect(),
            positions: (0..4).map(|p| top_k(&dense(300, i * 10 + p), 8)).collect(),
        };
        {
            let mut w = SignalWriter::open(&d, h.clone()).expect("create");
            for i in 0..3 {
                w.append_window(&win(i)).expect("append");
            }
            w.sync().expect("sync");
        }
        // A torn record (a crash mid-append) is dropped on reopen, and capture continues after 2.
        let shard = shard_path(&d, 0);
        let mut bytes = std::fs::read(&shard).expect("read");
        let head = bytes[..30].to_vec();
        bytes.extend_from_slice(&head);
        std::fs::write(&shard, &bytes).expect("tear");
        let mut w = SignalWriter::open(&d, h.clone()).expect("reopen");
        assert_eq!(w.last_window, Some(2));
        w.append_window(&win(3)).expect("append");
        let tops: Vec<TopK> = (0..3).map(|j| top_k(&dense(300, 99 + j), 8)).collect();
        assert!(w.append_trajectory(&[1, 2], &[3, 4, 5], &tops[..1]).is_err(), "one top-k per generated token");
        w.append_trajectory(&[1, 2], &[3, 4, 5], &tops).expect("traj");
        w.append_trajectory_with(&[7], &[8], &tops[..1], Some("first, think: ½ + ½ = 1")).expect("reasoning");
        w.append_router_stats(&[(3, vec![1.0, 2.0])]).expect("router");
        w.sync().expect("sync");
        let s = SignalStore::open(&d).expect("open");
        assert_eq!((s.num_windows(), s.trajectories, s.router_stats), (4, 2, 1));
        let t = s.trajectory(0).expect("trajectory");
        assert_eq!((t.prompt.as_slice(), t.generated.as_slice()), (&[1u32, 2][..], &[3u32, 4, 5][..]));
        assert_eq!(t.reasoning, None);
        let r = s.trajectory(1).expect("with reasoning");
        assert_eq!((r.generated.as_slice(), r.reasoning.as_deref()), (&[8u32][..], Some("first, think: ½ + ½ = 1")));
        assert_eq!(
            t.positions.iter().map(|p| p.ids.clone()).collect::<Vec<_>>(),
            tops.iter().map(|p| p.ids.clone()).collect::<Vec<_>>()
        );
        for i in 0..4 {
            let got = s.window(i).expect("window");
            let want = win(i as u64);
            assert_eq!((got.index, got.start, &got.tokens), (want.index, want.start, &want.tokens));
            for (g, e) in got.positions.iter().zip(&want.positions) {
                assert_eq!(g.ids, e.ids);
                for (a, b) in g.logprobs.iter().zip(&e.logprobs) {
                    assert!((a - b).abs() <= LP_STEP / 2.0 + 0.01 * b.abs(), "{a} vs {b}");
                }
            }
        }
        // A different teacher or k in the same directory is refused.
        let mut other = h.clone();
        other.top_k = 4;
        let e = SignalWriter::open(&d, other).err().expect("refused").to_string();
        assert!(e.contains("different teacher"), "{e}");
        let e = s.check_tokenizer(&"cd".repeat(32), 300).expect_err("mismatch").to_string();
        assert!(e.contains("teacher's tokenizer"), "{e}");
    }

    #[test]
    fn spread_order_is_a_permutation() {
        for m in [1usize, 7, 64, 400, 13_479] {
            let mut seen = vec![false; m];
            for i in 0..m {
                let s = WindowOrder::Spread.slot(i, m);
                assert!(!seen[s], "m={m}: slot {s} twice");
                seen[s] = true;
            }
            assert_eq!(WindowOrder::Sequential.slot(3.min(m - 1), m), 3.min(m - 1));
        }
        // A short prefix already reaches both halves of the split.
        let first: Vec<usize> = (0..8).map(|i| WindowOrder::Spread.slot(i, 13_479)).collect();
        assert!(first.iter().any(|&s| s < 13_479 / 2) && first.iter().any(|&s| s >= 13_479 / 2), "{first:?}");
    }

    #[test]
    fn reconstruction_kl_shrinks_with_k() {
        let lp = dense(500, 3);
        let mut last = f64::INFINITY;
        for k in [4, 16, 64, 256, 500] {
            let h = header(500, k);
            let w = WindowRecord { index: 0, start: 0, tokens: vec![0], positions: vec![top_k(&lp, k)] };
            let back = h.decode_window(&h.encode_window(&w)).expect("decode");
            let kl = reconstruction_kl(&lp, &back.positions[0]);
            assert!(kl <= last + 1e-6 && kl >= 0.0, "k={k}: {kl} after {last}");
            last = kl;
        }
        assert!(last < 2e-3, "k = V leaves only the 1/16-nat rounding: {last}");
    }
}
