//! Safetensors reading (memory-mapped, any float dtype widened to f32) and atomic writing.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use crate::{io_err, Error, Result};

/// One memory-mapped safetensors file with its parsed header.
pub struct SafetensorsFile {
    pub path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    meta: Metadata,
}

/// A tensor's location: which file, its dtype, shape and raw little-endian bytes.
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(io_err(path))?;
        // SAFETY: the mapping is read-only; a checkpoint rewritten under us is the same hazard
        // every mmap-based loader (safetensors, llama.cpp) accepts.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
        let (n, meta) = safetensors::SafeTensors::read_metadata(&mmap)
            .map_err(|e| Error::Safetensors { path: path.to_path_buf(), msg: e.to_string() })?;
        let header_len = 8 + n;
        let data_len = mmap.len() - header_len;
        if meta.data_len() > data_len {
            return Err(Error::Safetensors {
                path: path.to_path_buf(),
                msg: format!("header describes {} data bytes but the file holds {data_len}", meta.data_len()),
            });
        }
        Ok(Self { path: path.to_path_buf(), mmap, header_len, meta })
    }

    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.meta.tensors().keys().cloned().collect();
        v.sort();
        v
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.meta.info(name)
    }

    /// User metadata (`__metadata__`) of the file.
    pub fn metadata(&self) -> HashMap<String, String> {
        self.meta.metadata().clone().unwrap_or_default()
    }

    pub fn tensor<'a>(&'a self, name: &'a str) -> Option<TensorRef<'a>> {
        let info = self.meta.info(name)?;
        let (a, b) = info.data_offsets;
        Some(TensorRef {
            name,
            path: &self.path,
            dtype: info.dtype,
            shape: &info.shape,
            bytes: &self.mmap[self.header_len + a..self.header_len + b],
        })
    }
}

impl TensorRef<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn dtype_err(&self) -> Error {
        Error::Dtype { name: self.name.to_string(), path: self.path.to_path_buf(), dtype: format!("{:?}", self.dtype) }
    }

    /// The values widened to f32 (F32, F16, BF16, F64).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = self.bytes;
        Ok(match self.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F64 => b
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
                .collect(),
            _ => return Err(self.dtype_err()),
        })
    }

    /// Integer values (I64, I32) as i64, e.g. token ids in a fixture.
    pub fn to_i64(&self) -> Result<Vec<i64>> {
        let b = self.bytes;
        Ok(match self.dtype {
            Dtype::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
            Dtype::I32 => b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect(),
            _ => return Err(self.dtype_err()),
        })
    }
}

/// An owned tensor to write: name, shape and data.
pub enum OwnedData {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

struct WriteView<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: std::borrow::Cow<'a, [u8]>,
}

impl safetensors::View for WriteView<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Write f32 tensors `(name, shape, data)` (and optional i64 ones) to `path` atomically:
/// a temporary file in the same directory is written, fsynced and renamed over `path`.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, OwnedData)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, shape, data) in tensors {
        let n: usize = shape.iter().product();
        let (dtype, bytes, len) = match data {
            OwnedData::F32(v) => (Dtype::F32, f32_bytes(v), v.len()),
            OwnedData::I64(v) => (Dtype::I64, v.iter().flat_map(|x| x.to_le_bytes()).collect(), v.len()),
        };
        if len != n {
            return Err(Error::Invalid(format!("tensor `{name}`: shape {shape:?} needs {n} values, got {len}")));
        }
        views.push((name.clone(), WriteView { dtype, shape: shape.clone(), bytes: bytes.into() }));
    }
    let bytes = safetensors::serialize(views, metadata)
        .map_err(|e| Error::Safetensors { path: path.to_path_buf(), msg: e.to_string() })?;
    write_atomic(path, &bytes)
}

/// Write `bytes` to `path` atomically (write temp, fsync, rename, fsync the directory).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let file_name = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    {
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(bytes).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all(); // best effort: not every filesystem can fsync a directory
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory, removed when dropped.
    fn tmpdir(tag: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("k3fmt-{tag}-")).tempdir().expect("scratch dir")
    }

    #[test]
    fn roundtrip_is_bit_exact() {
        let d = tmpdir("rt");
        let p = d.path().join("a.safetensors");
        let x: Vec<f32> = (0..24).map(|i| (i as f32).sin() * 1e-3 + f32::MIN_POSITIVE * i as f32).collect();
        write_safetensors(&p, &[("x".into(), vec![2, 3, 4], OwnedData::F32(x.clone()))], None).expect("write");
        let f = SafetensorsFile::open(&p).expect("open");
        let t = f.tensor("x").expect("tensor");
        assert_eq!(t.shape, &[2, 3, 4]);
        let y = t.to_f32().expect("f32");
        assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn truncated_file_is_a_clear_error() {
        let d = tmpdir("trunc");
        let p = d.path().join("a.safetensors");
        write_safetensors(&p, &[("x".into(), vec![64], OwnedData::F32(vec![1.0; 64]))], None).expect("write");
        let bytes = std::fs::read(&p).expect("read");
        std::fs::write(&p, &bytes[..bytes.len() - 10]).expect("truncate");
        let err = SafetensorsFile::open(&p).err().expect("must fail").to_string();
        assert!(err.contains("a.safetensors") && err.contains("truncated"), "{err}");
        std::fs::write(&p, b"garbage").expect("write");
        let err = SafetensorsFile::open(&p).err().expect("must fail").to_string();
        assert!(err.contains("not a valid safetensors"), "{err}");
    }
}
