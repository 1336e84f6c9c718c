//! The GGUF container, version 3, little-endian (interop.md §4): a memory-mapped reader with
//! bounds-checked parsing, and an atomic writer.
//!
//! Tensor shapes use ggml's order: `ne[0]` is the innermost (contiguous) dimension, i.e. the
//! numpy/PyTorch shape reversed. A weight `W: [out, in]` has `ne = [in, out]`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use k3_kernels::quant::GgmlType;
use memmap2::Mmap;

use crate::safetensors_io::write_atomic;
use crate::{io_err, Error, Result};

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    /// Element type id and elements.
    Array(u32, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::Str(_) => 8,
            Value::Array(..) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// Any integer type as u64 (negative values refuse).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64).or(match *self {
                Value::I32(v) => Some(v as f64),
                Value::I64(v) => Some(v as f64),
                _ => None,
            }),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }

    pub fn str_array(v: impl IntoIterator<Item = String>) -> Self {
        Value::Array(8, v.into_iter().map(Value::Str).collect())
    }
    pub fn i32_array(v: impl IntoIterator<Item = i32>) -> Self {
        Value::Array(5, v.into_iter().map(Value::I32).collect())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml dims, innermost first.
    pub ne: Vec<u64>,
    pub type_id: u32,
    /// Offset relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn numel(&self) -> u64 {
        self.ne.iter().product()
    }
    /// The PyTorch-order shape (ne reversed).
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&x| x as usize).collect()
    }
    /// Bytes of its data: whole blocks of its type per row (`None` for a type this reader does
    /// not know).
    pub fn nbytes(&self) -> Option<u64> {
        let ty = GgmlType::from_id(self.type_id)?;
        let row = self.ne.first().copied().unwrap_or(1).max(1);
        Some(ty.row_bytes(row as usize) as u64 * (self.numel() / row))
    }
}

/// A GGUF file opened for reading.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub kv: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    tindex: HashMap<String, usize>,
    data_start: usize,
    mmap: Mmap,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: &str) -> Error {
        Error::Invalid(format!(
            "{}: truncated or corrupt GGUF: cannot read {what} at byte {} (file has {} bytes); re-download or re-export it",
            self.path.display(),
            self.pos,
            self.b.len()
        ))
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| self.err(what))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let s = self.take(8, what)?;
        Ok(u64::from_le_bytes(s.try_into().map_err(|_| self.err(what))?))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)? as usize;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| self.err(&format!("{what} (not UTF-8)")))
    }
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        let what = format!("the value of `{key}`");
        Ok(match ty {
            0 => Value::U8(self.take(1, &what)?[0]),
            1 => Value::I8(self.take(1, &what)?[0] as i8),
            2 => {
                let s = self.take(2, &what)?;
                Value::U16(u16::from_le_bytes([s[0], s[1]]))
            }
            3 => {
                let s = self.take(2, &what)?;
                Value::I16(i16::from_le_bytes([s[0], s[1]]))
            }
            4 => Value::U32(self.u32(&what)?),
            5 => Value::I32(self.u32(&what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(&what)?)),
            7 => Value::Bool(self.take(1, &what)?[0] != 0),
            8 => Value::Str(self.string(&what)?),
            9 if depth == 0 => {
                let et = self.u32(&what)?;
                let n = self.u64(&what)? as usize;
                // Every element takes at least one byte: a count beyond the file is corruption.
                if n > self.b.len() - self.pos {
                    return Err(self.err(&format!("{what}: array of {n} elements")));
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(et, key, depth + 1)?);
                }
                Value::Array(et, v)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(self.u64(&what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(&what)?)),
            _ => {
                return Err(Error::Invalid(format!(
                    "{}: `{key}` has unknown GGUF value type {ty}",
                    self.path.display()
                )))
            }
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(io_err(path))?;
        // SAFETY: read-only mapping of a file we do not modify (see SafetensorsFile::open).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
        let mut c = Cursor { b: &mmap, pos: 0, path };
        let magic = c.take(4, "the magic number")?;
        if magic != MAGIC {
            return Err(Error::Invalid(format!(
                "{}: not a GGUF file (magic bytes {:?}, expected \"GGUF\")",
                path.display(),
                String::from_utf8_lossy(magic)
            )));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::Invalid(format!(
                "{}: GGUF version {version} is not supported (2 or 3)",
                path.display()
            )));
        }
        let n_tensors = c.u64("the tensor count")?;
        let n_kv = c.u64("the metadata count")?;
        if n_tensors > mmap.len() as u64 || n_kv > mmap.len() as u64 {
            return Err(c.err("the header counts"));
        }
        let mut kv = Vec::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&format!("the type of `{key}`"))?;
            let v = c.value(ty, &key, 0)?;
            kv.push((key, v));
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}"))?;
            let nd = c.u32(&format!("the rank of `{name}`"))?;
            if nd > 8 {
                return Err(c.err(&format!("the rank of `{name}` ({nd})")));
            }
            let ne = (0..nd).map(|_| c.u64(&format!("the dims of `{name}`"))).collect::<Result<Vec<_>>>()?;
            let type_id = c.u32(&format!("the type of `{name}`"))?;
            let offset = c.u64(&format!("the offset of `{name}`"))?;
            tensors.push(TensorInfo { name, ne, type_id, offset });
        }
        let index: HashMap<String, usize> = kv.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let align = index.get("general.alignment").and_then(|&i| kv[i].1.as_u64()).unwrap_or(DEFAULT_ALIGNMENT).max(1);
        let data_start = (c.pos as u64).div_ceil(align) * align;
        let tindex = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        let f = Self {
            path: path.to_path_buf(),
            version,
            kv,
            index,
            tensors,
            tindex,
            data_start: data_start as usize,
            mmap,
        };
        for t in &f.tensors {
            f.check_extent(t)?;
        }
        Ok(f)
    }

    fn check_extent(&self, t: &TensorInfo) -> Result<()> {
        let bytes = match GgmlType::from_id(t.type_id) {
            Some(ty) => {
                let row = t.ne.first().copied().unwrap_or(1) as usize;
                if !row.is_multiple_of(ty.block_elems()) {
                    return Err(Error::Invalid(format!(
                        "{}: tensor `{}` has rows of {row} elements, not a multiple of {}'s block of {}",
                        self.path.display(),
                        t.name,
                        ty.name(),
                        ty.block_elems()
                    )));
                }
                t.nbytes().expect("a known type")
            }
            None => return Ok(()), // unsupported types are reported when (and if) the tensor is read
        };
        let end = self.data_start as u64 + t.offset + bytes;
        if end > self.mmap.len() as u64 {
            return Err(Error::Invalid(format!(
                "{}: truncated GGUF: tensor `{}` ends at byte {end} but the file has {} bytes",
                self.path.display(),
                t.name,
                self.mmap.len()
            )));
        }
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.kv[i].1)
    }

    pub fn arch(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tindex.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's type and raw bytes; an unsupported type is an error naming the tensor.
    pub fn tensor_data(&self, name: &str) -> Result<(GgmlType, &TensorInfo, &[u8])> {
        let t = self.tensor_info(name).ok_or_else(|| Error::MissingTensor {
            name: name.into(),
            path: self.path.clone(),
            hint: String::new(),
        })?;
        let ty = GgmlType::from_id(t.type_id).ok_or_else(|| {
            Error::Invalid(format!(
                "{}: tensor `{}` has type {} (id {}), which K3-Mini cannot read yet (supported: {}); requantize the file to one of those (llama-quantize, or tools/bench/llama_quantize.py)",
                self.path.display(),
                name,
                GgmlType::name_of_id(t.type_id),
                t.type_id,
                GgmlType::readable_names().join(", ")
            ))
        })?;
        let row = t.ne.first().copied().unwrap_or(1) as usize;
        let bytes = ty.row_bytes(row) * (t.numel() as usize / row.max(1));
        let start = self.data_start + t.offset as usize;
        Ok((ty, t, &self.mmap[start..start + bytes]))
    }

    /// Let the kernel drop this process's mapped pages of `bytes`, a part of the mapping that the
    /// caller has copied out (the engine repacks every weight at load, a band of rows at a time),
    /// so that the file's pages do not add to the loader's peak memory on top of the repacked
    /// copy; a later read faults them back in from the file. Best effort: a slice from elsewhere
    /// or a refused madvise changes nothing.
    pub fn release_bytes(&self, bytes: &[u8]) {
        let base = self.mmap.as_ptr() as usize;
        let Some(start) = (bytes.as_ptr() as usize).checked_sub(base) else { return };
        if bytes.is_empty() || start + bytes.len() > self.mmap.len() {
            return;
        }
        // SAFETY: the mapping is read-only and file-backed (`Mmap::map`), so its pages are never
        // modified: MADV_DONTNEED only drops them, and any later access (through any live slice)
        // reads the same bytes from the file again.
        #[cfg(unix)]
        let _ = unsafe { self.mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, bytes.len()) };
    }

    /// A whole tensor dequantized to f32 (PyTorch order, i.e. row-major over `shape()`).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let (ty, t, bytes) = self.tensor_data(name)?;
        let mut out = vec![0f32; t.numel() as usize];
        ty.dequantize_row(bytes, &mut out);
        Ok(out)
    }
}

/// Builds a GGUF file: metadata in insertion order, tensors aligned to 32 bytes.
#[derive(Default)]
pub struct GgufWriter {
    kv: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn kv(&mut self, key: &str, v: Value) {
        self.kv.retain(|(k, _)| k != key);
        self.kv.push((key.to_string(), v));
    }

    /// Add a tensor given its PyTorch-order `shape` and its encoded bytes.
    pub fn tensor(&mut self, name: &str, shape: &[usize], ty: GgmlType, bytes: Vec<u8>) -> Result<()> {
        let ne: Vec<u64> = shape.iter().rev().map(|&x| x as u64).collect();
        let row = ne.first().copied().unwrap_or(1) as usize;
        let n: usize = shape.iter().product();
        if !row.is_multiple_of(ty.block_elems()) || bytes.len() != ty.row_bytes(row) * (n / row.max(1)) {
            return Err(Error::Invalid(format!(
                "GGUF writer: tensor `{name}` {shape:?} has {} bytes, not {} data",
                bytes.len(),
                ty.name()
            )));
        }
        self.tensors.push((name.to_string(), ne, ty, bytes));
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        let put_str = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u64).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        fn put_val(b: &mut Vec<u8>, v: &Value) {
            match v {
                Value::U8(x) => b.push(*x),
                Value::I8(x) => b.push(*x as u8),
                Value::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
                Value::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
                Value::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
                Value::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
                Value::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
                Value::Bool(x) => b.push(*x as u8),
                Value::Str(s) => {
                    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
                    b.extend_from_slice(s.as_bytes());
                }
                Value::Array(et, items) => {
                    b.extend_from_slice(&et.to_le_bytes());
                    b.extend_from_slice(&(items.len() as u64).to_le_bytes());
                    for it in items {
                        put_val(b, it);
                    }
                }
                Value::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
                Value::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
                Value::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
            }
        }
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut b, k);
            b.extend_from_slice(&v.type_id().to_le_bytes());
            put_val(&mut b, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for (name, ne, ty, data) in &self.tensors {
            put_str(&mut b, name);
            b.extend_from_slice(&(ne.len() as u32).to_le_bytes());
            for d in ne {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.id().to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        }
        let pad = |b: &mut Vec<u8>| {
            b.resize((b.len() as u64).div_ceil(DEFAULT_ALIGNMENT) as usize * DEFAULT_ALIGNMENT as usize, 0)
        };
        pad(&mut b);
        let data_start = b.len();
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            b.resize(data_start + off as usize, 0);
            b.extend_from_slice(data);
        }
        pad(&mut b);
        b
    }

    /// Write atomically (temp file, fsync, rename).
    pub fn write(&self, path: &Path) -> Result<()> {
        write_atomic(path, &self.to_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory (removed when dropped) and the GGUF path in it.
    fn scratch(tag: &str) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::Builder::new().prefix(&format!("k3gguf-{tag}-")).tempdir().expect("scratch dir");
        let p = d.path().join("m.gguf");
        (d, p)
    }

    fn sample() -> (GgufWriter, Vec<f32>) {
        let mut w = GgufWriter::new();
        w.kv("general.architecture", Value::Str("kimi-linear".into()));
        w.kv("kimi-linear.block_count", Value::U32(4));
        w.kv("kimi-linear.attention.head_count_kv", Value::i32_array([0, 0, 0, 1]));
        w.kv("kimi-linear.rope.freq_base", Value::F32(1e4));
        w.kv("tokenizer.ggml.tokens", Value::str_array(["a".to_string(), "é".into(), "<s>".into()]));
        w.kv("general.flag", Value::Bool(true));
        w.kv("general.big", Value::U64(1 << 40));
        w.kv("general.neg", Value::I64(-7));
        w.kv("general.pi", Value::F64(std::f64::consts::PI));
        let x: Vec<f32> = (0..64 * 3).map(|i| (i as f32 * 0.37).sin()).collect();
        w.tensor("a.weight", &[3, 64], GgmlType::F32, GgmlType::F32.quantize_row(&x)).expect("f32");
        w.tensor("b.weight", &[3, 64], GgmlType::Q8_0, GgmlType::Q8_0.quantize_row(&x)).expect("q8");
        w.tensor("c.weight", &[64], GgmlType::F16, GgmlType::F16.quantize_row(&x[..64])).expect("f16");
        (w, x)
    }

    #[test]
    fn write_then_read_gives_identical_tensors_and_metadata() {
        let (w, x) = sample();
        let (_tmp, p) = scratch("rt");
        w.write(&p).expect("write");
        let f = GgufFile::open(&p).expect("open");
        assert_eq!(f.arch(), Some("kimi-linear"));
        for (k, v) in &w.kv {
            assert_eq!(f.get(k), Some(v), "{k}");
        }
        let (ty, info, bytes) = f.tensor_data("b.weight").expect("b");
        assert_eq!((ty, info.ne.clone(), info.shape()), (GgmlType::Q8_0, vec![64, 3], vec![3, 64]));
        assert_eq!(bytes, GgmlType::Q8_0.quantize_row(&x).as_slice());
        assert_eq!(f.tensor_f32("a.weight").expect("a"), x);
        for t in &f.tensors {
            assert_eq!(t.offset % DEFAULT_ALIGNMENT, 0);
        }
    }

    #[test]
    fn bad_files_get_clear_errors() {
        let (w, _) = sample();
        let bytes = w.to_bytes();
        let (_tmp, p) = scratch("bad");
        std::fs::write(&p, &bytes[..bytes.len() - 100]).expect("w");
        let e = GgufFile::open(&p).err().expect("truncated").to_string();
        assert!(e.contains("truncated") && e.contains("m.gguf"), "{e}");
        std::fs::write(&p, &bytes[..40]).expect("w");
        let e = GgufFile::open(&p).err().expect("truncated header").to_string();
        assert!(e.contains("truncated or corrupt"), "{e}");
        let mut bad = bytes.clone();
        bad[..4].copy_from_slice(b"GGML");
        std::fs::write(&p, &bad).expect("w");
        let e = GgufFile::open(&p).err().expect("magic").to_string();
        assert!(e.contains("not a GGUF file"), "{e}");
        // an unsupported tensor type is reported when that tensor is read, naming it
        let mut w2 = GgufWriter::new();
        w2.kv("general.architecture", Value::Str("llama".into()));
        w2.tensor("q.weight", &[1, 32], GgmlType::F32, vec![0; 128]).expect("t");
        let mut b2 = w2.to_bytes();
        let pos = b2.windows(8).position(|w| w == b"q.weight").expect("name") + 8 + 4 + 16;
        b2[pos..pos + 4].copy_from_slice(&16u32.to_le_bytes()); // IQ2_XXS
        std::fs::write(&p, &b2).expect("w");
        let f = GgufFile::open(&p).expect("opens");
        let e = f.tensor_data("q.weight").expect_err("type").to_string();
        assert!(e.contains("q.weight") && e.contains("IQ"), "{e}");
    }
}
