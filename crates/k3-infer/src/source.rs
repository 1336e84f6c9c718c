//! Where weights come from: an HF / Kimi safetensors checkpoint, or a GGUF (ours or llama.cpp's
//! converter's). The model asks for *semantic* pieces by HF name (and a few derived forms: the
//! absorbed MLA matrices, one routed expert, a fused AttnRes score vector, A_log per head); each
//! backend knows its own names and transforms (`k3_format::gguf_map`).

use std::path::Path;

use k3_config::ModelConfig;
use k3_format::gguf::GgufFile;
use k3_format::gguf_map::{blk, config_from_gguf, gguf_name, GgufArch};
use k3_format::{tensor_specs, Checkpoint, TensorSpec};
use k3_kernels::quant::GgmlType;

use crate::linear::Matrix;
use crate::{Error, Result};

/// Which routed-expert matrix: w1 (gate), w3 (up) or w2 (down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPart {
    Gate,
    Up,
    Down,
}

pub enum Source {
    Hf { ck: Checkpoint, specs: Vec<TensorSpec> },
    Gguf { file: GgufFile, arch: GgufArch, config: ModelConfig },
}

impl Source {
    /// Open a checkpoint directory or a `.gguf` file. Returns the source and loader warnings.
    pub fn open(path: &Path) -> Result<(Self, Vec<String>)> {
        if path.is_dir() {
            let ck = Checkpoint::open(path)?;
            let specs = tensor_specs(&ck.config);
            let warnings = ck.warnings.clone();
            return Ok((Source::Hf { ck, specs }, warnings));
        }
        if !path.exists() {
            return Err(Error::Invalid(format!(
                "{}: no such file or directory (give a checkpoint directory or a .gguf file)",
                path.display()
            )));
        }
        let file = GgufFile::open(path)?;
        let config = config_from_gguf(&file)?;
        let arch = GgufArch::for_config(&config);
        let declared = file.arch().and_then(GgufArch::from_name);
        let mut warnings = vec![];
        if declared != Some(arch) {
            warnings.push(format!(
                "{}: architecture `{}` read as `{}`",
                path.display(),
                file.arch().unwrap_or("?"),
                arch.name()
            ));
        }
        Ok((Source::Gguf { file, arch: declared.unwrap_or(arch), config }, warnings))
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Source::Hf { ck, .. } => &ck.config,
            Source::Gguf { config, .. } => config,
        }
    }

    pub fn gguf(&self) -> Option<&GgufFile> {
        match self {
            Source::Gguf { file, .. } => Some(file),
            Source::Hf { .. } => None,
        }
    }

    fn spec(&self, hf: &str) -> Result<&TensorSpec> {
        match self {
            Source::Hf { specs, .. } => specs
                .iter()
                .find(|s| s.name == hf)
                .ok_or_else(|| Error::Invalid(format!("internal: `{hf}` is not in the weight contract"))),
            Source::Gguf { .. } => Err(Error::Invalid("internal: spec() on a GGUF source".into())),
        }
    }

    fn hf_f32(&self, hf: &str) -> Result<Vec<f32>> {
        match self {
            Source::Hf { ck, .. } => Ok(ck.read(self.spec(hf)?)?),
            Source::Gguf { .. } => unreachable_gguf(),
        }
    }

    /// With `perm`, row i of the matrix is the tensor's row `perm[i]` (reordered as ggml rows,
    /// before the repacking, which then writes each row once).
    fn gguf_matrix(&self, name: &str, rows: usize, cols: usize, perm: Option<&[usize]>) -> Result<Matrix> {
        let Source::Gguf { file, .. } = self else {
            return unreachable_gguf();
        };
        let (ty, info, bytes) = file.tensor_data(name)?;
        if info.numel() as usize != rows * cols || info.ne[0] as usize != cols {
            return Err(Error::Invalid(format!(
                "{}: tensor `{name}` has ggml dims {:?}, expected [{cols}, {rows}] from the metadata",
                file.path.display(),
                info.ne
            )));
        }
        let Some(perm) = perm else {
            return Ok(Matrix::from_ggml(rows, cols, ty, bytes, |read| file.release_bytes(read)));
        };
        let rb = ty.row_bytes(cols);
        debug_assert!(perm.len() == rows && perm.iter().all(|&r| r < rows));
        let mut reordered = Vec::with_capacity(bytes.len());
        for &r in perm {
            reordered.extend_from_slice(&bytes[r * rb..(r + 1) * rb]);
        }
        file.release_bytes(bytes);
        Ok(Matrix::from_ggml(rows, cols, ty, &reordered, |_| {}))
    }

    fn gguf_f32(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let Source::Gguf { file, .. } = self else {
            return unreachable_gguf();
        };
        let v = file.tensor_f32(name)?;
        if v.len() < n {
            return Err(Error::Invalid(format!(
                "{}: tensor `{name}` has {} values, expected {n}",
                file.path.display(),
                v.len()
            )));
        }
        Ok(v)
    }

    /// A 2-D linear weight `[rows = out, cols = in]` by HF name, named after its GGUF tensor.
    pub fn matrix(&self, hf: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let name = self.gguf_name_of(hf)?;
        let m = match self {
            Source::Hf { .. } => Matrix::from_f32(rows, cols, &self.hf_f32(hf)?),
            Source::Gguf { .. } => self.gguf_matrix(&name, rows, cols, None)?,
        };
        Ok(m.named(&name))
    }

    /// The GGUF tensor name of an HF weight name.
    fn gguf_name_of(&self, hf: &str) -> Result<String> {
        match gguf_name(hf) {
            Some(n) => Ok(n),
            // `g_proj` is the full-rank KDA gate or the MLA output gate, by layer type.
            None if hf.ends_with(".self_attn.g_proj.weight") => {
                let layer: usize = hf
                    .trim_start_matches("model.layers.")
                    .split('.')
                    .next()
                    .and_then(|x| x.parse().ok())
                    .ok_or_else(|| Error::Invalid(format!("internal: bad name `{hf}`")))?;
                let kda =
                    matches!(self.config(), ModelConfig::Kimi(c) if c.layers[layer].mixer == k3_config::Mixer::Kda);
                Ok(blk(layer, if kda { "ssm_g.weight" } else { "attn_gate.weight" }))
            }
            None => Err(Error::Invalid(format!("internal: no GGUF name for `{hf}`"))),
        }
    }

    /// Any small tensor (norm weights, biases, dt_bias, conv kernels [C, Kc]) as f32 in HF order.
    pub fn vector(&self, hf: &str, n: usize) -> Result<Vec<f32>> {
        match self {
            Source::Hf { .. } => self.hf_f32(hf),
            Source::Gguf { .. } => {
                let name = gguf_name(hf).ok_or_else(|| Error::Invalid(format!("internal: no GGUF name for `{hf}`")))?;
                Ok(self.gguf_f32(&name, n)?[..n].to_vec())
            }
        }
    }

    /// The token embedding as a matrix [V, C] (rows are looked up, never multiplied).
    pub fn embedding(&self, vocab: usize, hidden: usize) -> Result<Matrix> {
        self.matrix("model.embed_tokens.weight", vocab, hidden)
    }

    /// The LM head [V, C]; a tied Llama (SmolLM2) shares the loaded embedding's packed rows (an
    /// unpacked one is copied).
    pub fn lm_head(&self, vocab: usize, hidden: usize, embed: &Matrix) -> Result<Matrix> {
        let tied = match self.config() {
            ModelConfig::Llama(c) => c.tie_word_embeddings,
            ModelConfig::Kimi(_) => false,
        };
        if tied {
            return Ok(embed.clone());
        }
        self.matrix("lm_head.weight", vocab, hidden)
    }

    /// KDA's decay rate `exp(A_log)` for layer `i`, one value per head. GGUF stores
    /// `ssm_a = −exp(A_log)`, used as is (no exp/ln round trip).
    pub fn kda_decay_rate(&self, i: usize, heads: usize) -> Result<Vec<f32>> {
        match self {
            Source::Hf { .. } => Ok(self.hf_f32(&format!("model.layers.{i}.self_attn.A_log"))?[..heads]
                .iter()
                .map(|a| a.exp())
                .collect()),
            Source::Gguf { .. } => Ok(self.gguf_f32(&blk(i, "ssm_a"), heads)?[..heads].iter().map(|&v| -v).collect()),
        }
    }

    /// Absorbed MLA matrices for layer `i`: `k_b` [H·R, Dn] (row h·R + r is column r of head h's
    /// W_uk) and `v_b` [H·Dv, R] (head h's W_uv), from HF `kv_b_proj` or GGUF `attn_k_b`/`attn_v_b`.
    pub fn mla_absorbed(&self, i: usize, h: usize, r: usize, dn: usize, dv: usize) -> Result<(Matrix, Matrix)> {
        let split = |kv_b: &[f32]| {
            // kv_b [H·(Dn+Dv), R], rows grouped per head [k_nope^h ; v^h]
            let mut kb = vec![0f32; h * r * dn];
            let mut vb = vec![0f32; h * dv * r];
            for hh in 0..h {
                let base = hh * (dn + dv);
                for d in 0..dn {
                    for c in 0..r {
                        kb[(hh * r + c) * dn + d] = kv_b[(base + d) * r + c];
                    }
                }
                vb[hh * dv * r..(hh + 1) * dv * r].copy_from_slice(&kv_b[(base + dn) * r..(base + dn + dv) * r]);
            }
            (Matrix::from_f32(h * r, dn, &kb), Matrix::from_f32(h * dv, r, &vb))
        };
        match self {
            Source::Hf { .. } => Ok(split(&self.hf_f32(&format!("model.layers.{i}.self_attn.kv_b_proj.weight"))?)),
            Source::Gguf { file, .. } => {
                if file.tensor_info(&blk(i, "attn_k_b.weight")).is_some() {
                    Ok((
                        self.gguf_matrix(&blk(i, "attn_k_b.weight"), h * r, dn, None)?,
                        self.gguf_matrix(&blk(i, "attn_v_b.weight"), h * dv, r, None)?,
                    ))
                } else {
                    Ok(split(&self.gguf_f32(&blk(i, "attn_kv_b.weight"), h * (dn + dv) * r)?))
                }
            }
        }
    }

    /// Routed expert `e` of layer `i`: gate/up [F_e, Lt], down [Lt, F_e].
    pub fn expert(&self, i: usize, e: usize, part: ExpertPart, fe: usize, width: usize) -> Result<Matrix> {
        let (rows, cols) = if part == ExpertPart::Down { (width, fe) } else { (fe, width) };
        let stack = blk(
            i,
            match part {
                ExpertPart::Gate => "ffn_gate_exps.weight",
                ExpertPart::Up => "ffn_up_exps.weight",
                ExpertPart::Down => "ffn_down_exps.weight",
            },
        );
        let m = match self {
            Source::Hf { .. } => {
                let [w1, w3, w2] = k3_format::weights::expert_names(i, e);
                let name = match part {
                    ExpertPart::Gate => w1,
                    ExpertPart::Up => w3,
                    ExpertPart::Down => w2,
                };
                Matrix::from_f32(rows, cols, &self.hf_f32(&name)?)
            }
            Source::Gguf { file, .. } => {
                let name = &stack;
                let (ty, info, bytes) = file.tensor_data(name)?;
                if info.ne.len() != 3 || info.ne[0] as usize != cols || info.ne[1] as usize != rows {
                    return Err(Error::Invalid(format!(
                        "{}: tensor `{name}` has ggml dims {:?}, expected [{cols}, {rows}, E]",
                        file.path.display(),
                        info.ne
                    )));
                }
                let per = ty.row_bytes(cols) * rows;
                Matrix::new(rows, cols, ty, bytes[e * per..(e + 1) * per].to_vec())
            }
        };
        // Each expert of the stacked GGUF tensor calibrates on its own: `NAME#e`.
        Ok(m.named(&format!("{stack}#{e}")))
    }

    /// An AttnRes score vector `norm ⊙ proj` [C]: `prefix` is `model.layers.{i}.self_attention_res`,
    /// `model.layers.{i}.mlp_res` or `model.output_attn_res`.
    pub fn res_score(&self, prefix: &str, hidden: usize) -> Result<Vec<f32>> {
        match self {
            Source::Hf { .. } => {
                let n = self.hf_f32(&format!("{prefix}_norm.weight"))?;
                let p = self.hf_f32(&format!("{prefix}_proj.weight"))?;
                Ok(n.iter().zip(&p).map(|(a, b)| a * b).collect())
            }
            Source::Gguf { .. } => {
                let name = if prefix == "model.output_attn_res" {
                    "output_res_score.weight".to_string()
                } else {
                    let rest = prefix.strip_prefix("model.layers.").unwrap_or(prefix);
                    let (layer, point) = rest.split_once('.').unwrap_or((rest, ""));
                    let g =
                        if point == "self_attention_res" { "attn_res_score.weight" } else { "ffn_res_score.weight" };
                    format!("blk.{layer}.{g}")
                };
                Ok(self.gguf_f32(&name, hidden)?[..hidden].to_vec())
            }
        }
    }

    /// A Llama attention weight in HF row order. llama.cpp's converter permutes Q/K rows per head
    /// for its adjacent-pair RoPE (interop.md §6); undo that so one rotate-half RoPE serves both.
    pub fn llama_attn(&self, i: usize, which: &str, rows: usize, cols: usize, heads: usize) -> Result<Matrix> {
        let hf = format!("model.layers.{i}.self_attn.{which}_proj.weight");
        match self {
            Source::Gguf { .. } if which == "q" || which == "k" => {
                let hd = rows / heads;
                // GGUF row (h, i, j) = i·2 + j holds HF row (h, j, i) = j·hd/2 + i.
                let mut perm = vec![0usize; rows];
                for h in 0..heads {
                    for j in 0..2 {
                        for ii in 0..hd / 2 {
                            perm[h * hd + j * hd / 2 + ii] = h * hd + ii * 2 + j;
                        }
                    }
                }
                let name = self.gguf_name_of(&hf)?;
                Ok(self.gguf_matrix(&name, rows, cols, Some(&perm))?.named(&name))
            }
            _ => self.matrix(&hf, rows, cols),
        }
    }

    /// The storage type of an HF-named tensor in this source (F32 for safetensors).
    pub fn stored_type(&self, hf: &str) -> GgmlType {
        match self {
            Source::Hf { .. } => GgmlType::F32,
            Source::Gguf { file, .. } => gguf_name(hf)
                .and_then(|n| file.tensor_info(&n).map(|t| t.type_id))
                .and_then(GgmlType::from_id)
                .unwrap_or(GgmlType::F32),
        }
    }
}

fn unreachable_gguf<T>() -> Result<T> {
    Err(Error::Invalid("internal: GGUF accessor used on a safetensors source".into()))
}
