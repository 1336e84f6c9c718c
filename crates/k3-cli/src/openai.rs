//! A teacher behind an OpenAI-compatible HTTP endpoint (how K3 itself is reached): a capability
//! probe, and teacher-forced top-k log-probabilities on given token windows.
//!
//! Endpoints differ in what they return (`../shared/docs/interop.md` §7): vLLM's `prompt_logprobs`
//! (keyed by id), legacy `/v1/completions` with `echo` + `logprobs` (keyed by token *string*), chat
//! `logprobs` (generated tokens only). `llama-cpp-python` 0.3.36 shifts echoed prompt log-probs by
//! one position and drops the first. So the probe measures, on a near-certain continuation, whether
//! entry i of `top_logprobs` predicts token i (`Aligned`), token i + 1 (`ShiftedByOne`), or neither
//! (`Unusable`), and the capture maps entries to positions accordingly or refuses.
//!
//! Requests retry with exponential backoff (transport errors, 408, 429, 5xx; `Retry-After` is
//! honoured) and are spaced to `--max-rps`. `http://` and `https://` (rustls, with the Mozilla
//! root certificates built in: no system certificate store is read).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k3_data::signals::TopK;
use k3_data::tok::Tok;
use serde::Serialize;
use serde_json::{json, Value};

/// A token's text and the top-k entries (text, log-prob; best first) the server gave with it.
pub type EchoEntry = (String, Option<Vec<(String, f32)>>);

pub struct Endpoint {
    pub base: String,
    pub model: String,
    api_key: Option<String>,
    agent: ureq::Agent,
    pub max_retries: u32,
    min_interval: Duration,
    last: Option<Instant>,
    pub requests: u64,
    pub retries: u64,
}

impl Endpoint {
    /// `url` is the server root or its `/v1`; `model` defaults to the first of `/v1/models`.
    pub fn connect(url: &str, model: Option<&str>, api_key: Option<String>, max_rps: f64) -> Result<Self> {
        if !url.starts_with("http://") && !url.starts_with("https://") {
            bail!("{url}: an OpenAI-compatible endpoint URL starts with http:// or https://");
        }
        let base = url.trim_end_matches('/').trim_end_matches("/v1").to_string();
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(10))
            .timeout(Duration::from_secs(600))
            .build();
        let min_interval = if max_rps > 0.0 { Duration::from_secs_f64(1.0 / max_rps) } else { Duration::ZERO };
        let mut e = Self {
            base,
            model: String::new(),
            api_key,
            agent,
            max_retries: 6,
            min_interval,
            last: None,
            requests: 0,
            retries: 0,
        };
        e.model = match model {
            Some(m) => m.to_string(),
            None => {
                let v = e.call("GET", "/v1/models", None)?;
                v["data"][0]["id"]
                    .as_str()
                    .with_context(|| format!("{}/v1/models lists no model; pass --model", e.base))?
                    .to_string()
            }
        };
        Ok(e)
    }

    fn call(&mut self, method: &str, path: &str, body: Option<&Value>) -> Result<Value> {
        let url = format!("{}{path}", self.base);
        let mut delay = Duration::from_millis(500);
        let mut attempt = 0;
        loop {
            if let Some(t) = self.last {
                let since = t.elapsed();
                if since < self.min_interval {
                    std::thread::sleep(self.min_interval - since);
                }
            }
            self.last = Some(Instant::now());
            self.requests += 1;
            let mut req = self.agent.request(method, &url).set("Content-Type", "application/json");
            if let Some(k) = &self.api_key {
                req = req.set("Authorization", &format!("Bearer {k}"));
            }
            let res = match body {
                Some(b) => req.send_string(&b.to_string()),
                None => req.call(),
            };
            let (retry_after, why) = match res {
                Ok(r) => {
                    let text = r.into_string().with_context(|| format!("reading the response of {url}"))?;
                    return serde_json::from_str(&text)
                        .with_context(|| format!("{url}: the response is not JSON: {}", &text[..text.len().min(200)]));
                }
                Err(ureq::Error::Status(code, r)) if code == 408 || code == 429 || code >= 500 => {
                    let ra = r.header("Retry-After").and_then(|s| s.trim().parse::<f64>().ok());
                    (ra, format!("HTTP {code}"))
                }
                Err(ureq::Error::Status(code, r)) => {
                    let text = r.into_string().unwrap_or_default();
                    bail!("{url}: HTTP {code}: {}", &text[..text.len().min(500)]);
                }
                Err(e) => (None, e.to_string()),
            };
            attempt += 1;
            if attempt > self.max_retries {
                bail!("{url}: gave up after {} attempts: {why}", attempt);
            }
            self.retries += 1;
            let wait = retry_after.map_or(delay, |s| Duration::from_secs_f64(s.clamp(0.0, 300.0)));
            eprintln!("warning: {url}: {why}; retrying in {:.1}s", wait.as_secs_f64());
            std::thread::sleep(wait);
            delay = (delay * 2).min(Duration::from_secs(30));
        }
    }

    pub fn post(&mut self, path: &str, body: &Value) -> Result<Value> {
        self.call("POST", path, Some(body))
    }

    /// Legacy completions with `echo` + `logprobs`: per prompt position (token string, top-k map).
    pub fn echo(&mut self, prompt: &str, k: usize) -> Result<Vec<EchoEntry>> {
        let body = json!({"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                          "echo": true, "logprobs": k});
        let v = self.post("/v1/completions", &body)?;
        let lp = &v["choices"][0]["logprobs"];
        let tokens = lp["tokens"]
            .as_array()
            .context("the response has no choices[0].logprobs.tokens (echo + logprobs unsupported)")?;
        let tops = lp["top_logprobs"].as_array().context("the response has no choices[0].logprobs.top_logprobs")?;
        Ok(tokens
            .iter()
            .zip(tops.iter().chain(std::iter::repeat(&Value::Null)))
            .map(|(t, top)| (t.as_str().unwrap_or_default().to_string(), parse_top(top)))
            .collect())
    }
}

/// Pad to k with "no information" entries far below the top-1 (the store needs k); the tail is
/// the mass the entries leave.
fn pad_topk(tids: &mut Vec<u32>, lps: &mut Vec<f32>, k: usize) -> TopK {
    let mut pad = 0u32;
    while tids.len() < k {
        if !tids.contains(&pad) {
            tids.push(pad);
            lps.push(lps.first().copied().unwrap_or(0.0) - 15.9);
        }
        pad += 1;
    }
    let kept: f64 = lps.iter().map(|&l| (l as f64).exp()).sum();
    let tail = (1.0 - kept).max(0.0);
    TopK {
        ids: std::mem::take(tids),
        logprobs: std::mem::take(lps),
        tail_logmass: if tail > 0.0 { tail.ln() as f32 } else { f32::NEG_INFINITY },
    }
}

/// A legacy-completions `top_logprobs` entry ({text: log-prob}) as (text, log-prob), best first.
pub fn parse_top(v: &Value) -> Option<Vec<(String, f32)>> {
    let mut top: Vec<(String, f32)> =
        v.as_object()?.iter().filter_map(|(s, l)| Some((s.clone(), l.as_f64()? as f32))).collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    Some(top)
}

/// A chat message's separate reasoning text and the field it came in (`reasoning_content`, as
/// vLLM and DeepSeek send it, or `reasoning`).
pub fn reasoning(msg: &Value) -> Option<(&'static str, &str)> {
    ["reasoning_content", "reasoning"].into_iter().find_map(|f| Some((f, msg.get(f)?.as_str()?)))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Alignment {
    /// Entry i is the distribution that predicted token i.
    Aligned,
    /// Entry i is the distribution after token i (llama-cpp-python 0.3.36).
    ShiftedByOne,
    Unusable,
}

#[derive(Debug, Serialize)]
pub struct Probe {
    pub endpoint: String,
    pub model: String,
    /// `/v1/completions` with echo returns per-token log-probs of the prompt.
    pub echo_logprobs: bool,
    /// vLLM's `prompt_logprobs` (top-k keyed by id).
    pub prompt_logprobs: bool,
    /// How echoed top-k entries are keyed: "string" or "id".
    pub top_logprobs_keys: Option<String>,
    /// Entries returned when asking for 20.
    pub top_logprobs_returned: usize,
    /// `/v1/chat/completions` returns `logprobs.content` with `top_logprobs`.
    pub chat_logprobs: bool,
    /// The chat message carries separate reasoning text, and under which field.
    pub reasoning_field: Option<String>,
    pub alignment: Alignment,
    /// What the alignment test saw.
    pub evidence: String,
}

/// A prompt whose continuation a working model predicts almost surely.
const COUNTING: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22";

/// Decide the alignment from an echoed near-certain text: count positions in its second half
/// where the entry gives the token at i (aligned) or at i + 1 (shifted) a log-probability above −1.
pub fn alignment(echo: &[EchoEntry]) -> (Alignment, String) {
    let n = echo.len();
    let (mut same, mut next, mut total) = (0, 0, 0);
    for i in n / 2..n.saturating_sub(1) {
        let Some(top) = &echo[i].1 else { continue };
        total += 1;
        let lp = |tok: &str| top.iter().find(|(s, _)| s == tok).map(|x| x.1);
        if lp(&echo[i].0).is_some_and(|l| l > -1.0) {
            same += 1;
        }
        if lp(&echo[i + 1].0).is_some_and(|l| l > -1.0) {
            next += 1;
        }
    }
    let evidence = format!(
        "on a counting prompt, {same}/{total} entries give their own token p > e^-1 and {next}/{total} give the next token p > e^-1"
    );
    let a = if total >= 4 && same * 10 >= total * 8 && next * 2 < total {
        Alignment::Aligned
    } else if total >= 4 && next * 10 >= total * 8 && same * 2 < total {
        Alignment::ShiftedByOne
    } else {
        Alignment::Unusable
    };
    (a, evidence)
}

pub fn probe(e: &mut Endpoint) -> Result<Probe> {
    let echo = e.echo(COUNTING, 20);
    let (echo_logprobs, keys, returned, (align, evidence)) = match &echo {
        Ok(v) if v.iter().any(|x| x.1.is_some()) => {
            let returned = v.iter().filter_map(|x| x.1.as_ref().map(Vec::len)).max().unwrap_or(0);
            let all_numeric = v.iter().filter_map(|x| x.1.as_ref()).flatten().all(|(s, _)| s.parse::<u32>().is_ok());
            (true, Some(if all_numeric { "id" } else { "string" }.to_string()), returned, alignment(v))
        }
        Ok(_) => (false, None, 0, (Alignment::Unusable, "echo returned no top_logprobs".into())),
        Err(err) => (false, None, 0, (Alignment::Unusable, format!("echo + logprobs failed: {err:#}"))),
    };
    let pl = e.post(
        "/v1/completions",
        &json!({"model": e.model, "prompt": COUNTING, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 5}),
    );
    let prompt_logprobs = pl.as_ref().is_ok_and(|v| v["choices"][0]["prompt_logprobs"].is_array());
    let chat = e.post(
        "/v1/chat/completions",
        &json!({"model": e.model, "messages": [{"role": "user", "content": "Count from 1 to 5."}],
                "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 3}),
    );
    let (chat_logprobs, reasoning_field) = match &chat {
        Ok(v) => {
            let r = reasoning(&v["choices"][0]["message"]).map(|(field, _)| field.to_string());
            (v["choices"][0]["logprobs"]["content"][0]["top_logprobs"].is_array(), r)
        }
        Err(_) => (false, None),
    };
    Ok(Probe {
        endpoint: e.base.clone(),
        model: e.model.clone(),
        echo_logprobs,
        prompt_logprobs,
        top_logprobs_keys: keys,
        top_logprobs_returned: returned,
        chat_logprobs,
        reasoning_field,
        alignment: align,
        evidence,
    })
}

/// Teacher-forced capture through an endpoint's echoed `top_logprobs`, mapped back to ids with the
/// teacher's tokenizer.
pub struct EndpointTeacher {
    pub endpoint: Endpoint,
    pub alignment: Alignment,
    /// The server takes token ids as the prompt and returns vLLM's id-keyed `prompt_logprobs`:
    /// then windows go by id (no text, no retokenization, no alignment question).
    pub by_ids: bool,
    /// Each token's text, by id.
    pieces: Vec<String>,
    /// Token text → id (the lowest id when several decode to the same text).
    by_text: HashMap<String, u32>,
    /// Texts several ids share (keys that cannot be mapped back exactly).
    pub ambiguous_texts: usize,
    /// Returned top-k entries whose text is no token (dropped; their mass joins the tail).
    pub unmapped_entries: u64,
    /// Windows skipped because the server tokenized the text differently.
    pub retokenized_windows: u64,
}

impl EndpointTeacher {
    pub fn new(endpoint: Endpoint, alignment: Alignment, by_ids: bool, tok: &Tok) -> Result<Self> {
        if alignment == Alignment::Unusable && !by_ids {
            bail!(
                "{}: the probe found the echoed log-probabilities unusable (no echo + logprobs, or entries that match \
                 neither their own token nor the next); run `k3mini teacher probe` for details",
                endpoint.base
            );
        }
        let mut pieces = Vec::with_capacity(tok.vocab_size);
        let mut by_text = HashMap::new();
        let mut ambiguous_texts = 0;
        for id in 0..tok.vocab_size as u32 {
            let s = tok.inner.decode(&[id], false).unwrap_or_default();
            match by_text.entry(s.clone()) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(id);
                }
                std::collections::hash_map::Entry::Occupied(_) => ambiguous_texts += 1,
            }
            pieces.push(s);
        }
        Ok(Self {
            endpoint,
            alignment,
            by_ids,
            pieces,
            by_text,
            ambiguous_texts,
            unmapped_entries: 0,
            retokenized_windows: 0,
        })
    }

    /// The top-k after each of `ids[..n−1]` (teacher-forced), `ids` holding one token more than the
    /// positions wanted. By id when the server has `prompt_logprobs`, else through echoed text.
    pub fn window_with_next(&mut self, ids: &[u32], k: usize) -> Result<Option<Vec<TopK>>> {
        if self.by_ids {
            self.window_ids(ids, k).map(Some)
        } else {
            self.window(&ids[..ids.len() - 1], k)
        }
    }

    /// vLLM: the prompt as token ids with `prompt_logprobs`; entry i + 1 is the distribution
    /// after token i, keyed by token id ({"id": {"logprob": …, "rank": …, "decoded_token": …}}).
    fn window_ids(&mut self, ids: &[u32], k: usize) -> Result<Vec<TopK>> {
        let body = json!({"model": self.endpoint.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                          "prompt_logprobs": k});
        let v = self.endpoint.post("/v1/completions", &body)?;
        let pl = v["choices"][0]["prompt_logprobs"]
            .as_array()
            .with_context(|| format!("{}: the response has no choices[0].prompt_logprobs", self.endpoint.base))?;
        if pl.len() != ids.len() {
            bail!(
                "{}: prompt_logprobs has {} entries for a prompt of {} ids (the server re-tokenized the ids?)",
                self.endpoint.base,
                pl.len(),
                ids.len()
            );
        }
        let mut out = Vec::with_capacity(ids.len() - 1);
        for (t, entry) in pl.iter().enumerate().skip(1) {
            let obj = entry
                .as_object()
                .with_context(|| format!("{}: prompt_logprobs[{t}] is not an object", self.endpoint.base))?;
            let mut top: Vec<(u32, f32)> = obj
                .iter()
                .filter_map(|(id, x)| {
                    let lp = x.get("logprob").and_then(Value::as_f64).or_else(|| x.as_f64())?;
                    Some((id.parse::<u32>().ok()?, lp as f32))
                })
                .filter(|(id, _)| (*id as usize) < self.pieces.len())
                .collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            top.truncate(k);
            let (mut tids, mut lps): (Vec<u32>, Vec<f32>) = top.into_iter().unzip();
            out.push(pad_topk(&mut tids, &mut lps, k));
        }
        Ok(out)
    }

    /// The top-k after each of `ids` (teacher-forced). `None` when the server tokenizes the text
    /// differently from our ids. A shifted server returns no entry after the first token; that
    /// position comes from a second, one-token request's generated-token distribution.
    pub fn window(&mut self, ids: &[u32], k: usize) -> Result<Option<Vec<TopK>>> {
        let text: String = ids.iter().map(|&i| self.pieces[i as usize].as_str()).collect();
        let echo = self.endpoint.echo(&text, k)?;
        if echo.len() < ids.len() || echo.iter().zip(ids).any(|(e, &i)| e.0 != self.pieces[i as usize]) {
            self.retokenized_windows += 1;
            return Ok(None);
        }
        // The entry holding the distribution after token t is t (shifted) or t + 1 (aligned).
        let shift = usize::from(self.alignment != Alignment::ShiftedByOne);
        let mut out = Vec::with_capacity(ids.len());
        for t in 0..ids.len() {
            let top = match echo.get(t + shift).and_then(|x| x.1.clone()) {
                Some(top) => top,
                None if t == 0 => match self.next_token_topk(&self.pieces[ids[0] as usize].clone(), k)? {
                    Some(top) => top,
                    None => {
                        self.retokenized_windows += 1;
                        return Ok(None);
                    }
                },
                None => {
                    self.retokenized_windows += 1;
                    return Ok(None);
                }
            };
            out.push(self.entries_to_topk(&top, k));
        }
        Ok(Some(out))
    }

    /// The id of a returned token text.
    pub fn id_of(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }

    /// Returned (text, log-prob) entries, best first, as a store position of exactly k ids.
    pub fn entries_to_topk(&mut self, entries: &[(String, f32)], k: usize) -> TopK {
        let (mut tids, mut lps) = (Vec::new(), Vec::new());
        for (s, l) in entries.iter().take(k) {
            match self.by_text.get(s) {
                Some(&id) if !tids.contains(&id) => {
                    tids.push(id);
                    lps.push(*l);
                }
                _ => self.unmapped_entries += 1,
            }
        }
        pad_topk(&mut tids, &mut lps, k)
    }

    /// The distribution after a one-token prompt: the generated token's `top_logprobs`.
    fn next_token_topk(&mut self, piece: &str, k: usize) -> Result<Option<Vec<(String, f32)>>> {
        let body = json!({"model": self.endpoint.model, "prompt": piece, "max_tokens": 1, "temperature": 0,
                          "logprobs": k});
        let v = self.endpoint.post("/v1/completions", &body)?;
        if v["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n != 1) {
            return Ok(None);
        }
        Ok(parse_top(&v["choices"][0]["logprobs"]["top_logprobs"][0]))
    }
}
