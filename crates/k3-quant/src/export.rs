//! Checkpoint → GGUF. The HF → GGUF naming and metadata live in `k3_format::gguf_map`; this file
//! applies the data transforms and chooses each tensor's type:
//! - llama-quantize leaves alone 1-D tensors, names not ending in `weight`, `*_norm.weight`, the
//!   MoE router (`ffn_gate_inp`) and the short-conv kernels (`ssm_conv1d*`): they stay F32;
//! - a tensor whose rows are not a multiple of the block falls back to F16, and we say so;
//! - for the 4-bit types the output head is written as Q8_0 (llama-quantize uses Q6_K, which
//!   K3-Mini does not write yet).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use k3_config::{KdaOutGate, Mixer, ModelConfig};
use k3_format::gguf::{GgufWriter, Value};
use k3_format::gguf_map::{blk, config_metadata, gguf_name, GgufArch};
use k3_format::{tensor_specs, Checkpoint};
use k3_kernels::quant::{iq4, q4_0, GgmlType};

use crate::tokenizer_meta::tokenizer_metadata;
use crate::{Error, Result};

/// The `--type` of `k3mini quantize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)] // ggml's names
pub enum QuantType {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    /// Q2_K everywhere it fits, the head in Q6_K (llama.cpp's Q2_K also raises some matrices
    /// to Q3_K / Q4_K; this one does not).
    Q2_K,
    /// Q3_K everywhere it fits, the head in Q6_K (llama.cpp's Q3_K_S).
    Q3_K,
    /// Q4_K everywhere it fits, the head in Q6_K (llama.cpp's Q4_K_S).
    Q4_K,
    /// Q5_K everywhere it fits, the head in Q6_K (llama.cpp's Q5_K_S).
    Q5_K,
    Q6_K,
    /// IQ4_NL everywhere it fits (4.5 bits a weight, Q4_0's size, a non-linear grid), the head
    /// in Q6_K.
    IQ4_NL,
    /// IQ4_XS everywhere it fits (4.25 bits a weight), the head in Q6_K.
    IQ4_XS,
}

impl QuantType {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => QuantType::F32,
            "f16" => QuantType::F16,
            "q8_0" => QuantType::Q8_0,
            "q4_0" => QuantType::Q4_0,
            "q4_1" => QuantType::Q4_1,
            "q2_k" => QuantType::Q2_K,
            "q3_k" | "q3_k_s" => QuantType::Q3_K,
            "q4_k" | "q4_k_s" => QuantType::Q4_K,
            "q5_k" | "q5_k_s" => QuantType::Q5_K,
            "q6_k" => QuantType::Q6_K,
            "iq4_nl" => QuantType::IQ4_NL,
            "iq4_xs" => QuantType::IQ4_XS,
            other => {
                return Err(Error::Invalid(format!(
                "--type `{other}` is not supported; allowed: f32, f16, q8_0, q4_0, q4_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs"
            )))
            }
        })
    }

    /// Whether `--calib` can importance-weight this type (its matrices' type has a weighted
    /// quantizer: Q4_0, IQ4_NL, IQ4_XS).
    pub fn calibrates(self) -> bool {
        weighted_quantizer(self.ggml()).is_some()
    }

    pub fn ggml(self) -> GgmlType {
        match self {
            QuantType::F32 => GgmlType::F32,
            QuantType::F16 => GgmlType::F16,
            QuantType::Q8_0 => GgmlType::Q8_0,
            QuantType::Q4_0 => GgmlType::Q4_0,
            QuantType::Q4_1 => GgmlType::Q4_1,
            QuantType::Q2_K => GgmlType::Q2_K,
            QuantType::Q3_K => GgmlType::Q3_K,
            QuantType::Q4_K => GgmlType::Q4_K,
            QuantType::Q5_K => GgmlType::Q5_K,
            QuantType::Q6_K => GgmlType::Q6_K,
            QuantType::IQ4_NL => GgmlType::IQ4_NL,
            QuantType::IQ4_XS => GgmlType::IQ4_XS,
        }
    }

    /// The type of the output head (llama-quantize keeps it at higher precision for 4-bit types).
    fn head(self) -> GgmlType {
        match self {
            QuantType::Q4_0 | QuantType::Q4_1 => GgmlType::Q8_0,
            QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::IQ4_NL
            | QuantType::IQ4_XS => GgmlType::Q6_K,
            other => other.ggml(),
        }
    }

    /// `general.file_type` (llama_ftype).
    pub fn ftype(self) -> u32 {
        match self {
            QuantType::F32 => 0,
            QuantType::F16 => 1,
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q8_0 => 7,
            QuantType::Q2_K => 10,
            QuantType::Q3_K => 11,
            QuantType::Q4_K => 14,
            QuantType::Q5_K => 16,
            QuantType::Q6_K => 18,
            QuantType::IQ4_NL => 25,
            QuantType::IQ4_XS => 30,
        }
    }
}

/// What an export did.
#[derive(Debug, Clone)]
pub struct ExportReport {
    pub arch: GgufArch,
    pub tensors: usize,
    pub bytes: u64,
    /// Tensors kept in F32 by llama-quantize's rules.
    pub kept_f32: usize,
    /// "name: rows of N are not a multiple of 32 (Q4_0) → F16" lines.
    pub fallbacks: Vec<String>,
    pub notes: Vec<String>,
}

/// llama-quantize's `tensor_allows_quantization` for the tensors our architectures have.
fn allows_quantization(name: &str, ndim: usize) -> bool {
    ndim >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && !name.contains("ssm_conv1d")
}

/// One output tensor: GGUF name, PyTorch-order shape, f32 data.
type Out = (String, Vec<usize>, Vec<f32>);

/// Reorder Llama Q/K rows per head for llama.cpp's adjacent-pair RoPE (its converter's `permute`).
fn llama_permute(w: &[f32], heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..hd / 2 {
                let src = h * hd + j * hd / 2 + i;
                let dst = h * hd + i * 2 + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// All GGUF tensors of a checkpoint, transformed, in the contract's order.
fn gguf_tensors(ck: &Checkpoint, arch: GgufArch) -> Result<Vec<Out>> {
    let cfg = &ck.config;
    let mut data: HashMap<String, (Vec<usize>, Vec<f32>)> = HashMap::new();
    for (s, d) in ck.read_all()? {
        data.insert(s.name.clone(), (s.shape, d));
    }
    let take = |data: &mut HashMap<String, (Vec<usize>, Vec<f32>)>, n: &str| {
        data.remove(n).ok_or_else(|| Error::Invalid(format!("internal: tensor `{n}` read twice or missing")))
    };
    let mut out: Vec<Out> = Vec::new();
    for spec in tensor_specs(cfg) {
        let name = spec.name.as_str();
        if !data.contains_key(name) {
            continue; // consumed together with a partner (expert stacks, AttnRes pairs)
        }
        let layer: Option<usize> =
            name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()).and_then(|x| x.parse().ok());
        let (shape, d) = take(&mut data, name)?;
        match (cfg, name) {
            (ModelConfig::Llama(c), n)
                if n.ends_with("self_attn.q_proj.weight") || n.ends_with("self_attn.k_proj.weight") =>
            {
                let heads = if n.ends_with("q_proj.weight") { c.num_attention_heads } else { c.num_key_value_heads };
                let g = gguf_name(n).ok_or_else(|| Error::Invalid(format!("no GGUF name for {n}")))?;
                out.push((g, shape.clone(), llama_permute(&d, heads, shape[0], shape[1])));
            }
            (ModelConfig::Kimi(c), n) => {
                let i = layer.unwrap_or(0);
                if n.ends_with("self_attn.A_log") {
                    // llama.cpp folds −exp(A_log) at conversion; kimi-linear keeps [1,1,H,1], kimi-k3 [H].
                    out.push((blk(i, "ssm_a"), shape, d.iter().map(|a| -a.exp()).collect()));
                } else if n.ends_with("_conv1d.weight") {
                    let g = gguf_name(n).ok_or_else(|| Error::Invalid(format!("no GGUF name for {n}")))?;
                    out.push((g, vec![1, shape[0], 1, shape[2]], d)); // [C,1,K] → numpy (1, C, 1, K)
                } else if n.ends_with("kv_b_proj.weight") {
                    let m = &c.mla;
                    let (h, r, dn, dv) = (m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
                    let (mut kb, mut vb) = (vec![0f32; h * r * dn], vec![0f32; h * dv * r]);
                    for hh in 0..h {
                        let base = hh * (dn + dv);
                        for x in 0..dn {
                            for cc in 0..r {
                                kb[(hh * r + cc) * dn + x] = d[(base + x) * r + cc];
                                // k_b [H, R, Dn] (transposed)
                            }
                        }
                        vb[hh * dv * r..(hh + 1) * dv * r].copy_from_slice(&d[(base + dn) * r..(base + dn + dv) * r]);
                    }
                    out.push((blk(i, "attn_k_b.weight"), vec![h, r, dn], kb));
                    out.push((blk(i, "attn_v_b.weight"), vec![h, dv, r], vb));
                } else if n.contains(".experts.") {
                    // Emit the three stacks [E, F_e, Lt] / [E, Lt, F_e] once, at expert 0's w1.
                    let e = c.moe.num_experts;
                    let mut stacks: [Vec<f32>; 3] = Default::default();
                    let mut first = Some((shape, d));
                    for x in 0..e {
                        let names = k3_format::weights::expert_names(i, x); // w1, w3, w2
                        for (k, nm) in names.iter().enumerate() {
                            let (_, v) = match first.take() {
                                Some(f) if x == 0 && k == 0 => f,
                                _ => take(&mut data, nm)?,
                            };
                            stacks[k].extend(v);
                        }
                    }
                    let (fe, l) = (c.moe.intermediate_size, c.moe.latent.map_or(c.hidden_size, |l| l.dim));
                    let [gate, up, down] = stacks;
                    out.push((blk(i, "ffn_gate_exps.weight"), vec![e, fe, l], gate));
                    out.push((blk(i, "ffn_up_exps.weight"), vec![e, fe, l], up));
                    out.push((blk(i, "ffn_down_exps.weight"), vec![e, l, fe], down));
                } else if let Some(prefix) = n.strip_suffix("_res_norm.weight") {
                    let (_, proj) = take(&mut data, &format!("{prefix}_res_proj.weight"))?;
                    let fused: Vec<f32> = d.iter().zip(&proj).map(|(a, b)| a * b).collect();
                    let g = if n.starts_with("model.output_attn_res") {
                        "output_res_score.weight".to_string()
                    } else if n.ends_with("self_attention_res_norm.weight") {
                        blk(i, "attn_res_score.weight")
                    } else {
                        blk(i, "ffn_res_score.weight")
                    };
                    out.push((g, vec![d.len()], fused));
                } else if n.ends_with("self_attn.g_proj.weight") {
                    let kda = c.layers[i].mixer == Mixer::Kda;
                    debug_assert!(!kda || c.kda.out_gate == KdaOutGate::FullRank);
                    out.push((blk(i, if kda { "ssm_g.weight" } else { "attn_gate.weight" }), shape, d));
                } else {
                    let g = gguf_name(n)
                        .ok_or_else(|| Error::Invalid(format!("`{n}` has no GGUF name in `{}`", arch.name())))?;
                    out.push((g, shape, d));
                }
            }
            (_, n) => {
                let g = gguf_name(n)
                    .ok_or_else(|| Error::Invalid(format!("`{n}` has no GGUF name in `{}`", arch.name())))?;
                out.push((g, shape, d));
            }
        }
    }
    Ok(out)
}

/// The type for rows that do not fit `ty`'s block: IQ4_NL for IQ4_XS (llama-quantize's choice),
/// else Q8_0, when they fit a block of 32; else F16.
fn fallback(ty: GgmlType, ne0: usize) -> GgmlType {
    if ne0.is_multiple_of(32) && ty == GgmlType::IQ4_XS {
        GgmlType::IQ4_NL
    } else if ne0.is_multiple_of(32) {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    }
}

/// Quantize the checkpoint in `dir` to `out` (atomically). Returns what was written.
pub fn export_gguf(dir: &Path, qt: QuantType, out: &Path) -> Result<ExportReport> {
    export_gguf_calibrated(dir, qt, out, None)
}

/// Per-element weights for importance-weighted quantization of `data` (a [.., cols] tensor):
/// w = imp[col] · sqrt(σ² + x²), σ² the tensor row's mean square (llama.cpp's Q4_0 rule).
fn element_weights(data: &[f32], imp: &[f32]) -> Vec<f32> {
    let cols = imp.len();
    let mut w = Vec::with_capacity(data.len());
    for row in data.chunks_exact(cols) {
        let sigma2 = row.iter().map(|v| v * v).sum::<f32>() / cols as f32;
        w.extend(row.iter().zip(imp).map(|(x, i)| i * (sigma2 + x * x).sqrt()));
    }
    w
}

/// A quantizer of `x` under one weight per element of it.
type WeightedQuantizer = fn(&[f32], &[f32]) -> Vec<u8>;

/// The importance-weighted quantizer of `ty`, where there is one.
fn weighted_quantizer(ty: GgmlType) -> Option<WeightedQuantizer> {
    match ty {
        GgmlType::Q4_0 => Some(q4_0::quantize_weighted),
        GgmlType::IQ4_NL => Some(iq4::quantize_nl_weighted),
        GgmlType::IQ4_XS => Some(iq4::quantize_xs_weighted),
        _ => None,
    }
}

/// `ty` (Q4_0, IQ4_NL or IQ4_XS) of `data` [.., cols] weighted by calibration, when `importance`
/// has the tensor: one vector [cols] under `name`, or one per routed expert under `name#e` (a
/// stacked [E, rows, cols] tensor; an expert calibration never reached gets uniform column
/// weights). `None` for the other types.
fn calibrated_quant(
    ty: GgmlType,
    name: &str,
    shape: &[usize],
    data: &[f32],
    importance: &BTreeMap<String, Vec<f32>>,
) -> Option<Vec<u8>> {
    let quantize = weighted_quantizer(ty)?;
    let cols = *shape.last()?;
    if let Some(imp) = importance.get(name).filter(|v| v.len() == cols) {
        return Some(quantize(data, &element_weights(data, imp)));
    }
    if shape.len() == 3 && importance.contains_key(&format!("{name}#0")) {
        let per = shape[1] * cols;
        let ones = vec![1.0f32; cols];
        let mut out = Vec::new();
        for (e, chunk) in data.chunks_exact(per).enumerate() {
            let imp = importance.get(&format!("{name}#{e}")).filter(|v| v.len() == cols).unwrap_or(&ones);
            out.extend(quantize(chunk, &element_weights(chunk, imp)));
        }
        return Some(out);
    }
    None
}

/// [`export_gguf`], with Q4_0, IQ4_NL and IQ4_XS tensors importance-weighted from calibration sums
/// (`k3_infer::calib`: mean x² per input column, by GGUF tensor name) when given.
pub fn export_gguf_calibrated(
    dir: &Path,
    qt: QuantType,
    out: &Path,
    importance: Option<&BTreeMap<String, Vec<f32>>>,
) -> Result<ExportReport> {
    let ck = Checkpoint::open(dir)?;
    let cfg = ck.config.clone();
    let arch = GgufArch::for_config(&cfg);
    let mut w = GgufWriter::new();
    w.kv("general.name", Value::Str(dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()));
    for (k, v) in config_metadata(&cfg)? {
        w.kv(&k, v);
    }
    w.kv("general.file_type", Value::U32(qt.ftype()));
    w.kv("general.quantization_version", Value::U32(2));
    let (bos, eos, pad) = match &cfg {
        ModelConfig::Kimi(c) => (c.bos_token_id, c.eos_token_id.first().copied(), c.pad_token_id),
        ModelConfig::Llama(c) => (c.bos_token_id, c.eos_token_id.first().copied(), c.pad_token_id),
    };
    let mut notes = Vec::new();
    let tok = tokenizer_metadata(dir, cfg.vocab_size(), (bos, eos, pad))?;
    if tok.iter().any(|(k, v)| k == "tokenizer.ggml.model" && v.as_str() == Some("none")) {
        notes.push(
            "no tokenizer.json in the checkpoint: the GGUF has no vocabulary (tokenizer.ggml.model = none)".into(),
        );
    }
    for (k, v) in tok {
        w.kv(&k, v);
    }
    if let ModelConfig::Kimi(c) = &cfg {
        if c.count_mixer(Mixer::Mla) == 0 || c.count_mixer(Mixer::Kda) == 0 {
            notes.push("no MLA or no KDA layer: llama.cpp 0c1e570 aborts on such a model (an empty cache buffer); k3mini runs it".into());
        }
    }
    let target = qt.ggml();
    let (mut kept, mut fallbacks, mut bytes, mut calibrated) = (0, Vec::new(), 0u64, 0usize);
    let tensors = gguf_tensors(&ck, arch)?;
    let n = tensors.len();
    for (name, shape, data) in tensors {
        let ne0 = *shape.last().unwrap_or(&1);
        let mut ty = if qt == QuantType::F32 || !allows_quantization(&name, shape.len()) {
            if qt != QuantType::F32 {
                kept += 1;
            }
            GgmlType::F32
        } else if name == "output.weight" {
            qt.head()
        } else {
            target
        };
        if ne0 % ty.block_elems() != 0 {
            let to = fallback(ty, ne0);
            fallbacks.push(format!(
                "{name}: rows of {ne0} are not a multiple of {}'s block of {} → {}",
                ty.name(),
                ty.block_elems(),
                to.name()
            ));
            ty = to;
        }
        let weighted = importance.and_then(|imp| calibrated_quant(ty, &name, &shape, &data, imp));
        calibrated += usize::from(weighted.is_some());
        let enc = weighted.unwrap_or_else(|| ty.quantize_row(&data));
        bytes += enc.len() as u64;
        w.tensor(&name, &shape, ty, enc)?;
    }
    if matches!(qt, QuantType::Q4_0 | QuantType::Q4_1) {
        notes.push("output.weight written as Q8_0 (llama-quantize would use Q6_K)".into());
    }
    if importance.is_some() {
        notes.push(format!(
            "{calibrated} tensors importance-weighted from calibration; the rest (never multiplied in calibration, \
             or a type other than Q4_0 / IQ4_NL / IQ4_XS) quantized as usual"
        ));
    }
    w.write(out)?;
    Ok(ExportReport { arch, tensors: n, bytes, kept_f32: kept, fallbacks, notes })
}

/// Re-quantize an existing GGUF (llama-quantize's `--allow-requantize`): every tensor is
/// dequantized to f32 and re-encoded under the same rules; metadata is copied.
pub fn requantize_gguf(input: &Path, qt: QuantType, out: &Path) -> Result<ExportReport> {
    let f = k3_format::gguf::GgufFile::open(input)?;
    let arch = f.arch().and_then(GgufArch::from_name).ok_or_else(|| {
        Error::Invalid(format!("{}: architecture `{}` is not supported", input.display(), f.arch().unwrap_or("?")))
    })?;
    let mut w = GgufWriter::new();
    for (k, v) in &f.kv {
        if k != "general.file_type" && k != "general.alignment" {
            w.kv(k, v.clone());
        }
    }
    w.kv("general.file_type", Value::U32(qt.ftype()));
    let (mut kept, mut fallbacks, mut bytes) = (0, Vec::new(), 0u64);
    let mut notes = vec![format!("re-quantized from {}: errors add up on already-quantized weights", input.display())];
    let tied = f.tensor_info("output.weight").is_none();
    for t in &f.tensors {
        let data = f.tensor_f32(&t.name)?;
        let shape = t.shape();
        let ne0 = t.ne.first().copied().unwrap_or(1) as usize;
        // A tied embedding is also the output head: keep it as a head type, as llama-quantize does.
        let is_head = t.name == "output.weight" || (tied && t.name == "token_embd.weight");
        let mut ty = if qt == QuantType::F32 || !allows_quantization(&t.name, t.ne.len()) {
            kept += usize::from(qt != QuantType::F32);
            GgmlType::F32
        } else if is_head {
            qt.head()
        } else {
            qt.ggml()
        };
        if !ne0.is_multiple_of(ty.block_elems()) {
            let to = fallback(ty, ne0);
            fallbacks.push(format!(
                "{}: rows of {ne0} are not a multiple of {}'s block → {}",
                t.name,
                ty.name(),
                to.name()
            ));
            ty = to;
        }
        let enc = ty.quantize_row(&data);
        bytes += enc.len() as u64;
        w.tensor(&t.name, &shape, ty, enc)?;
    }
    if matches!(qt, QuantType::Q4_0 | QuantType::Q4_1) {
        notes.push("the output head written as Q8_0 (llama-quantize would use Q6_K)".into());
    }
    w.write(out)?;
    Ok(ExportReport { arch, tensors: f.tensors.len(), bytes, kept_f32: kept, fallbacks, notes })
}
