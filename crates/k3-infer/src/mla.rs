//! Multi-head latent attention in its absorbed form (architecture.md §2(a)): the cache holds only
//! `[RMSNorm(c_kv) ; k_r]` per token (R + Dr values), queries are absorbed into the latent space
//! through W_uk, and W_uv maps the attended latent back per head. A long prefill instead expands
//! per-head keys and values from the cache when that takes fewer multiply-adds
//! ([`prefill_expands`]). NoPE, optional q LoRA and the K3 output gate. Dims: T new tokens,
//! S cached, C hidden, H heads, Dn/Dr/Dv, R = kv_lora_rank.

use k3_config::MlaConfig;
use k3_kernels::threads::{par_rows, Pool, SendPtr};
use k3_kernels::{attention, ops, simd};

use crate::kv::KvRows;
use crate::linear::{Compute, Matrix};
use crate::source::Source;
use crate::Result;

/// Transformers and Moonshot use eps 1e-6 in the two latent RMSNorms (llama.cpp: rms_norm_eps).
const LATENT_EPS: f32 = 1e-6;

pub enum QProj {
    Plain(Matrix),
    Lora { a: Matrix, a_bias: Option<Vec<f32>>, norm: Vec<f32>, b: Matrix },
}

pub struct Mla {
    q: QProj,
    kv_a: Matrix,
    kv_a_bias: Option<Vec<f32>>,
    kv_norm: Vec<f32>,
    k_b: Matrix, // [H·R, Dn]: head h's W_ukᵀ in rows h·R..(h+1)·R
    v_b: Matrix, // [H·Dv, R]: head h's W_uv in rows h·Dv..(h+1)·Dv
    /// f32 copies for decompressing the cache in long prefills: [H, Dn, R] (W_uk per head) and
    /// [H, R, Dv] (W_uvᵀ per head).
    k_up: Vec<f32>,
    v_up: Vec<f32>,
    o: Matrix,
    o_bias: Option<Vec<f32>>,
    gate: Option<Matrix>,
    h: usize,
    dn: usize,
    dr: usize,
    dv: usize,
    r: usize,
    /// rms_norm_eps, which llama.cpp uses for the latent norms too.
    eps: f32,
}

/// Whether the fast path runs a prefill of `t` tokens after `past` over decompressed keys and
/// values rather than in latent space: when it takes fewer multiply-adds. Per visible (query,
/// key, head) the latent form costs 2R + Dr and the decompressed one (Dn + Dr) + Dv, which first
/// costs R·(Dn + Dv) per cached position and head.
pub fn prefill_expands(cfg: &MlaConfig, t: usize, past: usize) -> bool {
    expansion_pays([cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim], t, past)
}

fn expansion_pays([r, dr, dn, dv]: [usize; 4], t: usize, past: usize) -> bool {
    let pairs = t * past + t * (t + 1) / 2;
    let saved = (2 * r + dr).saturating_sub(dn + dr + dv);
    t > 1 && pairs * saved > (past + t) * r * (dn + dv)
}

fn add_bias(y: &mut [f32], b: &Option<Vec<f32>>) {
    if let Some(b) = b {
        for row in y.chunks_exact_mut(b.len()) {
            ops::axpy(row, 1.0, b);
        }
    }
}

impl Mla {
    pub fn load(src: &Source, i: usize, hidden: usize, cfg: &MlaConfig, eps: f64) -> Result<Self> {
        let p = format!("model.layers.{i}.self_attn");
        let (h, qk) = (cfg.num_heads, cfg.qk_head_dim());
        let bias = |name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            if cfg.attention_bias {
                Ok(Some(src.vector(&format!("{p}.{name}.bias"), n)?))
            } else {
                Ok(None)
            }
        };
        let q = match cfg.q_lora_rank {
            None => QProj::Plain(src.matrix(&format!("{p}.q_proj.weight"), h * qk, hidden)?),
            Some(rq) => QProj::Lora {
                a: src.matrix(&format!("{p}.q_a_proj.weight"), rq, hidden)?,
                a_bias: bias("q_a_proj", rq)?,
                norm: src.vector(&format!("{p}.q_a_layernorm.weight"), rq)?,
                b: src.matrix(&format!("{p}.q_b_proj.weight"), h * qk, rq)?,
            },
        };
        let (r, dr) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim);
        let (k_b, v_b) = src.mla_absorbed(i, h, r, cfg.qk_nope_head_dim, cfg.v_head_dim)?;
        let (dn, dv) = (cfg.qk_nope_head_dim, cfg.v_head_dim);
        let (mut k_up, mut v_up) = (vec![0f32; h * dn * r], vec![0f32; h * r * dv]);
        let mut w = vec![0f32; dn.max(r)];
        for hh in 0..h {
            for c in 0..r {
                k_b.row_into(hh * r + c, &mut w[..dn]); // row h·R + c of k_b: head h's W_ukᵀ row c
                for (d, &x) in w[..dn].iter().enumerate() {
                    k_up[(hh * dn + d) * r + c] = x;
                }
            }
            for o in 0..dv {
                v_b.row_into(hh * dv + o, &mut w[..r]);
                for (c, &x) in w[..r].iter().enumerate() {
                    v_up[(hh * r + c) * dv + o] = x;
                }
            }
        }
        Ok(Self {
            k_up,
            v_up,
            q,
            kv_a: src.matrix(&format!("{p}.kv_a_proj_with_mqa.weight"), r + dr, hidden)?,
            kv_a_bias: bias("kv_a_proj_with_mqa", r + dr)?,
            kv_norm: src.vector(&format!("{p}.kv_a_layernorm.weight"), r)?,
            k_b,
            v_b,
            o: src.matrix(&format!("{p}.o_proj.weight"), hidden, h * cfg.v_head_dim)?,
            o_bias: bias("o_proj", hidden)?,
            gate: if cfg.output_gate {
                Some(src.matrix(&format!("{p}.g_proj.weight"), h * cfg.v_head_dim, hidden)?)
            } else {
                None
            },
            h,
            dn: cfg.qk_nope_head_dim,
            dr,
            dv: cfg.v_head_dim,
            r,
            eps: eps as f32,
        })
    }

    fn expands(&self, t: usize, past: usize) -> bool {
        expansion_pays([self.r, self.dr, self.dn, self.dv], t, past)
    }

    /// Values cached per token (R + Dr).
    pub fn cache_width(&self) -> usize {
        self.r + self.dr
    }

    /// # Shapes
    /// x: [T, C] (after `input_layernorm`); cache: [S, R + Dr] (grows by T) → [T, C]
    pub fn forward(&self, x: &[f32], t: usize, cache: &mut KvRows, cx: Compute) -> Vec<f32> {
        let (q, ckv, gate_v) = self.project(x, t, cx);
        let att = self.attend(&q, &ckv, t, cache, cx);
        self.output(att, gate_v, t, cx)
    }

    /// One token for each of B sequences (a batched decode step): the projections and o_proj
    /// over all B rows at once (each weight read once for the batch), W_uk and W_uv as one
    /// product each over the B rows, and each row attending to its own sequence's cache.
    ///
    /// # Shapes
    /// x: [B, C]; caches: B, cache b [S_b, R + Dr] (grows by one row) → [B, C]
    pub fn decode_batch(&self, x: &[f32], caches: &mut [&mut KvRows], cx: Compute) -> Vec<f32> {
        let nb = caches.len();
        let (q, ckv, gate_v) = self.project(x, nb, cx);
        let (qw, cw) = (self.h * (self.dn + self.dr), self.r + self.dr);
        let att = if cx.exact {
            // The reference, a sequence at a time.
            let mut att = Vec::with_capacity(nb * self.h * self.dv);
            for (b, cache) in caches.iter_mut().enumerate() {
                att.extend(self.attend(&q[b * qw..(b + 1) * qw], &ckv[b * cw..(b + 1) * cw], 1, cache, cx));
            }
            att
        } else {
            for (b, cache) in caches.iter_mut().enumerate() {
                cache.push(&ckv[b * cw..(b + 1) * cw], true);
            }
            let scale = self.scale();
            let (h, r, dr) = (self.h, self.r, self.dr);
            self.latent_attend(&q, nb, 1, cx, |b, _, qb, lat| {
                let past = caches[b].len() / cw - 1;
                attention::mla_attend_block(lat, qb, caches[b].rows(), h, r, dr, past, scale, true, cx.threads);
            })
        };
        self.output(att, gate_v, nb, cx)
    }

    fn scale(&self) -> f32 {
        1.0 / ((self.dn + self.dr) as f32).sqrt()
    }

    /// The projections of x at once (one activation quantization, one pool job): q (through
    /// its LoRA when there is one), the latent rows `[RMSNorm(c_kv) ; k_r]` (k_r shared by all
    /// heads, no rotary: NoPE) and the output gate's input.
    ///
    /// # Shapes
    /// x: [T, C] → q [T, H·(Dn+Dr)], ckv [T, R + Dr], gate [T, H·Dv]
    fn project(&self, x: &[f32], t: usize, cx: Compute) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
        let (r, dr) = (self.r, self.dr);
        let latent_eps = if cx.exact { LATENT_EPS } else { self.eps };
        let q_in = match &self.q {
            QProj::Plain(m) => m,
            QProj::Lora { a, .. } => a,
        };
        let mut ms = vec![q_in, &self.kv_a];
        ms.extend(self.gate.as_ref());
        let mut outs = Matrix::apply_many(&ms, x, t, cx).into_iter();
        let (q_out, mut ckv) = (outs.next().expect("q"), outs.next().expect("kv_a")); // ckv: [T, R+Dr]
        let gate_v = outs.next();
        let q = match &self.q {
            QProj::Plain(_) => q_out,
            QProj::Lora { a_bias, norm, b, .. } => {
                let mut qa = q_out;
                add_bias(&mut qa, a_bias);
                let mut qn = vec![0f32; qa.len()];
                ops::rmsnorm(&mut qn, &qa, norm, latent_eps);
                b.apply(&qn, t, cx)
            }
        }; // [T, H·(Dn+Dr)]
        add_bias(&mut ckv, &self.kv_a_bias);
        for row in ckv.chunks_exact_mut(r + dr) {
            let c = row[..r].to_vec();
            ops::rmsnorm(&mut row[..r], &c, &self.kv_norm, latent_eps);
        }
        (q, ckv, gate_v)
    }

    /// The output gate (from the mixer input) and o_proj.
    ///
    /// # Shapes
    /// att: [T, H·Dv] → [T, C]
    fn output(&self, mut att: Vec<f32>, gate_v: Option<Vec<f32>>, t: usize, cx: Compute) -> Vec<f32> {
        if let Some(gv) = gate_v {
            for (a, b) in att.iter_mut().zip(&gv) {
                *a *= ops::sigmoid(*b);
            }
        }
        let mut y = self.o.apply(&att, t, cx);
        add_bias(&mut y, &self.o_bias);
        y
    }

    /// Append T latent rows to one sequence's cache, then attend its T queries to it (causal).
    /// Rows in f16 as llama.cpp keeps this cache, or f32 in the exact mode.
    ///
    /// # Shapes
    /// q: [T, H·(Dn+Dr)], ckv: [T, R + Dr]; cache: [S, R + Dr] → [T, H·Dv]
    fn attend(&self, q: &[f32], ckv: &[f32], t: usize, cache: &mut KvRows, cx: Compute) -> Vec<f32> {
        let (h, dn, dr, dv, r) = (self.h, self.dn, self.dr, self.dv, self.r);
        let qk = dn + dr;
        let past = cache.len() / (r + dr);
        cache.push(ckv, !cx.exact);
        let cache = cache.rows();
        let scale = self.scale();
        let mut att = vec![0f32; t * h * dv];
        if cx.exact {
            // The reference: one query at a time, heads against the cache one after another.
            let (mut q_abs, mut q_r, mut lat) = (vec![0f32; h * r], vec![0f32; h * dr], vec![0f32; h * r]);
            let all = cache.to_f32(); // borrowed: the exact mode keeps an f32 cache
            for tt in 0..t {
                let qrow = &q[tt * h * qk..(tt + 1) * h * qk];
                for hh in 0..h {
                    // q̃ = W_ukᵀ q_nope: rows h·R..h·R+R of k_b dotted with q_nope^h
                    let qn = &qrow[hh * qk..hh * qk + dn];
                    self.k_b.matmul_rows(hh * r, (hh + 1) * r, qn, 1, &mut q_abs[hh * r..(hh + 1) * r], cx.single());
                    q_r[hh * dr..(hh + 1) * dr].copy_from_slice(&qrow[hh * qk + dn..(hh + 1) * qk]);
                }
                let visible = &all[..(past + tt + 1) * (r + dr)]; // causal
                attention::mla_attend(&mut lat, &q_abs, &q_r, visible, r, dr, scale, false, cx.threads);
                for hh in 0..h {
                    let y = &mut att[(tt * h + hh) * dv..(tt * h + hh + 1) * dv];
                    self.v_b.matmul_rows(hh * dv, (hh + 1) * dv, &lat[hh * r..(hh + 1) * r], 1, y, cx.single());
                }
            }
        } else if self.expands(t, past) {
            // Long prefill: keys and values per head from the latent cache, then ordinary
            // attention with Dn + Dr-wide keys and Dv-wide values (fewer products per query-key
            // pair than in latent space, once the prompt is long enough to repay the expansion).
            // One head at a time, so the expanded keys and values held are one head's (at 32K
            // positions ~42 MB instead of ~335 MB for all eight of the bench model's heads).
            let s = past + t;
            let w = r + dr;
            // The cache transposed, [R + Dr, S]: a head's keys come out as columns, [Dn + Dr, S]
            // (k_nope = W_uk c, then k_r shared by every head), so scores are a plain A·B product.
            let mut ct = vec![0f32; w * s];
            let mut row = vec![0f32; w];
            for j in 0..s {
                cache.widen(j * w, &mut row);
                for (c, &x) in row.iter().enumerate() {
                    ct[c * s + j] = x;
                }
            }
            let (mut kt, mut vc) = (vec![0f32; qk * s], vec![0f32; s * dv]); // [Dn + Dr, S], [S, Dv]
            let (mut qh, mut oh) = (vec![0f32; t * qk], vec![0f32; t * dv]); // [T, Dn + Dr], [T, Dv]
            for hh in 0..h {
                kt.fill(0.0);
                let wk = &self.k_up[hh * dn * r..(hh + 1) * dn * r];
                par_rows(&mut kt[..dn * s], s, cx.threads, |d0, band| {
                    let rows = band.len() / s;
                    simd::matmul_acc_strided(band, s, &wk[d0 * r..], r, &ct, s, rows, r, s);
                });
                kt[dn * s..].copy_from_slice(&ct[r * s..]);
                vc.fill(0.0);
                let wv = &self.v_up[hh * r * dv..(hh + 1) * r * dv];
                par_rows(&mut vc, dv, cx.threads, |s0, band| {
                    let rows = band.len() / dv;
                    let mut lat = vec![0f32; rows * w];
                    cache.widen(s0 * w, &mut lat);
                    simd::matmul_acc_strided(band, dv, &lat, w, wv, dv, rows, r, dv);
                });
                for (tt, dst) in qh.chunks_exact_mut(qk).enumerate() {
                    dst.copy_from_slice(&q[(tt * h + hh) * qk..(tt * h + hh + 1) * qk]);
                }
                let heads = attention::Heads { hq: 1, hkv: 1, dk: qk, dv };
                let keys = attention::Keys::Columns { data: &kt, n: s };
                attention::attend_blocked(
                    &mut oh,
                    &qh,
                    keys,
                    attention::Rows::F32(&vc),
                    heads,
                    past,
                    false,
                    cx.threads,
                );
                for (tt, src) in oh.chunks_exact(dv).enumerate() {
                    att[(tt * h + hh) * dv..(tt * h + hh + 1) * dv].copy_from_slice(src);
                }
            }
        } else {
            // Blocks of up to 16 queries, all heads at once, against the latent cache in one pass.
            att = self.latent_attend(q, t, 16, cx, |_, t0, qb, lat| {
                attention::mla_attend_block(lat, qb, cache, h, r, dr, past + t0, scale, true, cx.threads);
            });
        }
        att
    }

    /// Attention in latent space for T query rows: q̃ = W_ukᵀ q_nope for every row of a head at
    /// once, then blocks of up to `qb_rows` rows `[q̃ ; q_r]`, all heads at once, handed to
    /// `attend(block, t0, qb, lat)` (rows t0.., [nq, H, R + Dr] → [nq, H, R]) against whatever
    /// cache those rows see, then the values per head for every row through W_uv.
    ///
    /// # Shapes
    /// q: [T, H·(Dn+Dr)] → [T, H·Dv]
    fn latent_attend(
        &self,
        q: &[f32],
        t: usize,
        qb_rows: usize,
        cx: Compute,
        mut attend: impl FnMut(usize, usize, &[f32], &mut [f32]),
    ) -> Vec<f32> {
        let (h, dn, dr, dv, r) = (self.h, self.dn, self.dr, self.dv, self.r);
        let qk = dn + dr;
        let qabs = per_head_products(&self.k_b, h, q, t, qk, cx); // [H, T, R]
        let mut qb = vec![0f32; qb_rows.min(t) * h * (r + dr)]; // one row when decoding
        let mut lat = vec![0f32; t * h * r]; // [T, H, R]
        for (block, t0) in (0..t).step_by(qb_rows).enumerate() {
            let nq = qb_rows.min(t - t0);
            for i in 0..nq {
                for hh in 0..h {
                    let dst = (i * h + hh) * (r + dr);
                    let src = (hh * t + t0 + i) * r;
                    qb[dst..dst + r].copy_from_slice(&qabs[src..src + r]);
                    let src = (t0 + i) * h * qk + hh * qk + dn;
                    qb[dst + r..dst + r + dr].copy_from_slice(&q[src..src + dr]);
                }
            }
            attend(block, t0, &qb[..nq * h * (r + dr)], &mut lat[t0 * h * r..(t0 + nq) * h * r]);
        }
        // The values, per head for every row: [T, R] · v_bᵀ → [T, Dv].
        let vals = per_head_products(&self.v_b, h, &lat, t, r, cx); // [H, T, Dv]
        let mut att = vec![0f32; t * h * dv];
        for hh in 0..h {
            for tt in 0..t {
                let (row, src) = (tt * h + hh, (hh * t + tt) * dv);
                att[row * dv..(row + 1) * dv].copy_from_slice(&vals[src..src + dv]);
            }
        }
        att
    }
}

/// `y_h = M_h x_h` for every head h over T tokens, M_h being rows h·rows..(h+1)·rows of the
/// stacked `m` [H·rows, cols] and x_h the first `cols` values of head h's `stride`-wide slice of
/// x [T, H, stride]: one pool job, each thread a run of consecutive heads, so its matrices are
/// one run of memory that the prefetchers follow (a head's matrix is small, 256 × 128 at the
/// bench shape). With eight separate allocations and a head a task from the shared counter,
/// these two products took ~220 µs of a decoded token at 2 threads on the Zen 4 host, ~8 GB/s.
///
/// # Shapes
/// x: [T, H, stride] → [H, T, rows]
fn per_head_products(m: &Matrix, h: usize, x: &[f32], t: usize, stride: usize, cx: Compute) -> Vec<f32> {
    let (rows, cols) = (m.rows / h.max(1), m.cols);
    let mut y = vec![0f32; h * t * rows];
    let base = SendPtr(y.as_mut_ptr());
    let tasks = cx.threads.clamp(1, h.max(1));
    Pool::global().run(cx.threads, tasks, &|i| {
        for hh in i * h / tasks..(i + 1) * h / tasks {
            let xh: Vec<f32> = (0..t).flat_map(|tt| &x[(tt * h + hh) * stride..][..cols]).copied().collect();
            // SAFETY: head hh alone writes its [T, rows] block of y, which outlives this job.
            let yh = unsafe { std::slice::from_raw_parts_mut(base.get().add(hh * t * rows), t * rows) };
            m.matmul_rows(hh * rows, (hh + 1) * rows, &xh, t, yh, cx.single());
        }
    });
    y
}
