//! Token shards: `{split}-NNNNN.bin` files of little-endian u16/u32 token ids behind a 64-byte
//! header (magic, version, dtype, vocab, token count, tokenizer SHA-256), memory-mapped for
//! random access. Documents are concatenated with the separator token between them, so a training
//! window of T + 1 tokens is a packed batch row.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::{io_err, Error, Result};

pub const MAGIC: &[u8; 8] = b"K3TOKSH1";
pub const VERSION: u32 = 1;
pub const HEADER: usize = 64;
/// Tokens per shard file.
pub const SHARD_TOKENS: usize = 1 << 24;

fn hash_bytes(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("00"), 16).unwrap_or(0);
    }
    out
}

/// Write tokens to `dir/{split}-NNNNN.bin`, each file atomically. Returns the file paths.
pub fn write_split(dir: &Path, split: &str, tokens: &[u32], vocab: usize, tok_hash: &str) -> Result<Vec<PathBuf>> {
    let wide = vocab > u16::MAX as usize + 1;
    let mut paths = Vec::new();
    for (i, chunk) in tokens.chunks(SHARD_TOKENS).enumerate() {
        let mut b = Vec::with_capacity(HEADER + chunk.len() * 4);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(if wide { 4u32 } else { 2u32 }).to_le_bytes());
        b.extend_from_slice(&(vocab as u32).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&(chunk.len() as u64).to_le_bytes());
        b.extend_from_slice(&hash_bytes(tok_hash));
        debug_assert_eq!(b.len(), HEADER);
        for &t in chunk {
            if wide {
                b.extend_from_slice(&t.to_le_bytes());
            } else {
                b.extend_from_slice(&(t as u16).to_le_bytes());
            }
        }
        let p = dir.join(format!("{split}-{i:05}.bin"));
        k3_format::safetensors_io::write_atomic(&p, &b).map_err(|e| Error::Invalid(e.to_string()))?;
        paths.push(p);
    }
    Ok(paths)
}

struct Shard {
    mmap: Mmap,
    n: usize,
    wide: bool,
}

/// Starts of up to `n` windows of `ctx` tokens spread evenly over a stream of `len` tokens (at
/// least one; never more than fit side by side). `ctx` must be ≤ `len`.
pub fn spread_starts(len: usize, ctx: usize, n: usize) -> Vec<usize> {
    let n = n.min(len / ctx.max(1)).max(1);
    (0..n).map(|w| if n > 1 { w * (len - ctx) / (n - 1) } else { 0 }).collect()
}

/// All shards of one split, as one token stream.
pub struct TokenSet {
    shards: Vec<Shard>,
    starts: Vec<usize>,
    pub len: usize,
    pub vocab: usize,
}

impl TokenSet {
    /// Open `dir/{split}-*.bin`, checking every header against the expected tokenizer and vocab.
    pub fn open(dir: &Path, split: &str, tok_hash: &str, vocab: usize) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io_err(dir))?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                n.starts_with(&format!("{split}-")) && n.ends_with(".bin")
            })
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: no {split}-*.bin shards; build the dataset with `k3mini data build`",
                dir.display()
            )));
        }
        let want_hash = hash_bytes(tok_hash);
        let (mut shards, mut starts, mut len) = (Vec::new(), Vec::new(), 0usize);
        for p in files {
            let f = File::open(&p).map_err(io_err(&p))?;
            // SAFETY: read-only mapping of a file this process does not write.
            let mmap = unsafe { Mmap::map(&f) }.map_err(io_err(&p))?;
            let bad = |msg: String| Error::Invalid(format!("{}: {msg}", p.display()));
            if mmap.len() < HEADER || &mmap[..8] != MAGIC {
                return Err(bad("not a K3-Mini token shard (bad magic or shorter than its header)".into()));
            }
            let u32_at = |o: usize| u32::from_le_bytes([mmap[o], mmap[o + 1], mmap[o + 2], mmap[o + 3]]);
            let version = u32_at(8);
            if version != VERSION {
                return Err(bad(format!(
                    "shard version {version}, this build reads version {VERSION}; rebuild the dataset"
                )));
            }
            let width = u32_at(12) as usize;
            let shard_vocab = u32_at(16) as usize;
            let n = u64::from_le_bytes(mmap[24..32].try_into().map_err(|_| bad("bad header".into()))?) as usize;
            if mmap[32..64] != want_hash {
                return Err(bad("tokenizer mismatch: the shard was tokenized with a different tokenizer than this dataset's (or the model's); rebuild it".into()));
            }
            if shard_vocab != vocab {
                return Err(bad(format!("vocab {shard_vocab} in the shard, {vocab} expected")));
            }
            if width != 2 && width != 4 {
                return Err(bad(format!("token width {width} bytes is not 2 or 4")));
            }
            if mmap.len() != HEADER + n * width {
                return Err(bad(format!(
                    "truncated or corrupt: the header promises {n} tokens ({} bytes) but the file has {} bytes; rebuild the dataset",
                    HEADER + n * width,
                    mmap.len()
                )));
            }
            starts.push(len);
            len += n;
            shards.push(Shard { mmap, n, wide: width == 4 });
        }
        Ok(Self { shards, starts, len, vocab })
    }

    /// Tokens `start .. start + n` of the stream (may span shards).
    pub fn read(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        out.clear();
        let mut pos = start;
        while out.len() < n && pos < self.len {
            let s = self.starts.partition_point(|&x| x <= pos) - 1;
            let sh = &self.shards[s];
            let off = pos - self.starts[s];
            let take = (n - out.len()).min(sh.n - off);
            for i in off..off + take {
                let b = HEADER + i * if sh.wide { 4 } else { 2 };
                out.push(if sh.wide {
                    u32::from_le_bytes([sh.mmap[b], sh.mmap[b + 1], sh.mmap[b + 2], sh.mmap[b + 3]])
                } else {
                    u16::from_le_bytes([sh.mmap[b], sh.mmap[b + 1]]) as u32
                });
            }
            pos += take;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_windows_cover_the_stream_end_to_end_and_never_overrun() {
        assert_eq!(spread_starts(100, 10, 3), vec![0, 45, 90]);
        assert_eq!(spread_starts(100, 40, 8), vec![0, 60], "at most as many as fit side by side");
        assert_eq!(spread_starts(10, 10, 5), vec![0]);
    }

    #[test]
    fn shards_round_trip_and_refuse_bad_files() {
        let tmp = tempfile::Builder::new().prefix("k3shard-").tempdir().expect("scratch dir");
        let d = tmp.path().to_path_buf();
        std::fs::create_dir_all(&d).expect("dir");
        let h = "ab".repeat(32);
        let toks: Vec<u32> = (0..1000).map(|i| (i * 7) % 500).collect();
        let paths = write_split(&d, "train", &toks, 500, &h).expect("write");
        let ts = TokenSet::open(&d, "train", &h, 500).expect("open");
        let mut out = Vec::new();
        ts.read(990, 20, &mut out);
        assert_eq!(out, toks[990..].to_vec());
        let e = TokenSet::open(&d, "train", &"cd".repeat(32), 500).err().expect("hash").to_string();
        assert!(e.contains("tokenizer mismatch") && e.contains("train-00000.bin"), "{e}");
        let e = TokenSet::open(&d, "train", &h, 600).err().expect("vocab").to_string();
        assert!(e.contains("vocab 500"), "{e}");
        let bytes = std::fs::read(&paths[0]).expect("read");
        std::fs::write(&paths[0], &bytes[..bytes.len() - 7]).expect("truncate");
        let e = TokenSet::open(&d, "train", &h, 500).err().expect("trunc").to_string();
        assert!(e.contains("truncated"), "{e}");
        std::fs::write(&paths[0], b"garbage").expect("garbage");
        let e = TokenSet::open(&d, "train", &h, 500).err().expect("magic").to_string();
        assert!(e.contains("not a K3-Mini token shard"), "{e}");
    }
}
