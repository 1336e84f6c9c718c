//! `tokenizer.ggml.*` metadata from an HF `tokenizer.json` (+ `tokenizer_config.json`), for
//! byte-level BPE tokenizers (ours and SmolLM2's), as llama.cpp's converter writes it.

use std::path::Path;

use k3_format::gguf::Value;
use serde_json::Value as J;

use crate::{Error, Result};

fn bad(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Invalid(format!("{}: {msg}", path.display()))
}

/// Metadata for the tokenizer in `dir` (or `tokenizer.ggml.model = "none"` when there is none).
/// `bos` / `eos` / `pad` come from the model config when the tokenizer config does not say.
pub fn tokenizer_metadata(
    dir: &Path,
    vocab_size: usize,
    ids: (Option<u32>, Option<u32>, Option<u32>),
) -> Result<Vec<(String, Value)>> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        // No vocabulary; the special ids still travel so the config round-trips.
        let mut m = vec![("tokenizer.ggml.model".to_string(), Value::Str("none".into()))];
        for (k, v) in [("bos_token_id", ids.0), ("eos_token_id", ids.1), ("padding_token_id", ids.2)] {
            if let Some(v) = v {
                m.push((format!("tokenizer.ggml.{k}"), Value::U32(v)));
            }
        }
        return Ok(m);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| bad(&path, e))?;
    let j: J = serde_json::from_str(&text).map_err(|e| bad(&path, e))?;
    let model = &j["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(bad(&path, format!("only BPE tokenizers can be exported to GGUF, this one is {}", model["type"])));
    }
    let vocab = model["vocab"].as_object().ok_or_else(|| bad(&path, "model.vocab is missing"))?;
    let mut tokens = vec![String::new(); vocab_size];
    let mut types = vec![1i32; vocab_size]; // normal
    let mut filled = vec![false; vocab_size];
    let mut put = |tok: &str, id: u64, ty: i32| -> Result<()> {
        let id = id as usize;
        if id >= vocab_size {
            return Err(bad(&path, format!("token `{tok}` has id {id}, outside the model's vocab_size {vocab_size}")));
        }
        tokens[id] = tok.to_string();
        types[id] = ty;
        filled[id] = true;
        Ok(())
    };
    for (tok, id) in vocab {
        put(tok, id.as_u64().ok_or_else(|| bad(&path, "non-integer id in model.vocab"))?, 1)?;
    }
    for t in j["added_tokens"].as_array().into_iter().flatten() {
        let content = t["content"].as_str().unwrap_or_default();
        let id = t["id"].as_u64().ok_or_else(|| bad(&path, "added token without id"))?;
        put(content, id, if t["special"].as_bool() == Some(true) { 3 } else { 4 })?;
    }
    for (i, f) in filled.iter().enumerate() {
        if !f {
            tokens[i] = format!("[PAD{i}]");
            types[i] = 5; // unused
        }
    }
    let merges: Vec<String> = model["merges"]
        .as_array()
        .ok_or_else(|| bad(&path, "model.merges is missing"))?
        .iter()
        .map(|m| match m {
            J::String(s) => Ok(s.clone()),
            J::Array(p) if p.len() == 2 => {
                Ok(format!("{} {}", p[0].as_str().unwrap_or(""), p[1].as_str().unwrap_or("")))
            }
            _ => Err(bad(&path, "a merge is neither \"a b\" nor [a, b]")),
        })
        .collect::<Result<_>>()?;
    let pre_text = j["pre_tokenizer"].to_string();
    let pre = if pre_text.contains("\"Digits\"") { "smollm" } else { "gpt-2" };
    let cfg: J = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(J::Null);
    let find = |key: &str| -> Option<u32> {
        let s = cfg[key].as_str().or_else(|| cfg[key]["content"].as_str())?;
        tokens.iter().position(|t| t == s).map(|i| i as u32)
    };
    let mut m = vec![
        ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::Str(pre.into())),
        ("tokenizer.ggml.tokens".into(), Value::str_array(tokens.clone())),
        ("tokenizer.ggml.token_type".into(), Value::i32_array(types)),
        ("tokenizer.ggml.merges".into(), Value::str_array(merges)),
    ];
    let (bos, eos, pad) = (find("bos_token").or(ids.0), find("eos_token").or(ids.1), find("pad_token").or(ids.2));
    if let Some(b) = bos {
        m.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(b)));
    }
    if let Some(e) = eos {
        m.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(e)));
    }
    if let Some(p) = pad {
        m.push(("tokenizer.ggml.padding_token_id".into(), Value::U32(p)));
    }
    m.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(cfg["add_bos_token"].as_bool().unwrap_or(false))));
    if let Some(t) = cfg["chat_template"].as_str() {
        m.push(("tokenizer.chat_template".into(), Value::Str(t.into())));
    }
    Ok(m)
}
