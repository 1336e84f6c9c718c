//! Softmax attention over a cache: MLA in its absorbed (latent, MQA) form and GQA for Llama.

/// Absorbed MLA for one query token (architecture.md §2(a)): for each head,
/// `score_j = (q̃ · c_j + q_r · k_r_j) · scale`, `out = Σ_j softmax(score)_j · c_j` (in latent space).
///
/// With `f16_kq`, the query is rounded to f16 before the scores and the probabilities before the
/// weighted sum, as llama.cpp's (non-flash) attention does against its f16 cache; the cache rows
/// then hold f16-representable values.
///
/// # Shapes
/// q_abs: [H, R]; q_r: [H, Dr]; cache: [S, R + Dr] rows `[c_j ; k_r_j]`; out: [H, R]
#[allow(clippy::too_many_arguments)]
pub fn mla_attend_ref(
    out: &mut [f32],
    q_abs: &[f32],
    q_r: &[f32],
    cache: &[f32],
    r: usize,
    dr: usize,
    scale: f32,
    f16_kq: bool,
) {
    let h = q_abs.len() / r;
    let s = cache.len() / (r + dr);
    let mut scores = vec![0f32; s];
    let round = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| if f16_kq { round_f16(x) } else { x }).collect() };
    for hh in 0..h {
        let (qa, qr) = (round(&q_abs[hh * r..(hh + 1) * r]), round(&q_r[hh * dr..(hh + 1) * dr]));
        for (j, sc) in scores.iter_mut().enumerate() {
            let row = &cache[j * (r + dr)..(j + 1) * (r + dr)];
            *sc = (crate::ops::dot(&qa, &row[..r]) + crate::ops::dot(&qr, &row[r..])) * scale;
        }
        crate::ops::softmax_inplace(&mut scores);
        if f16_kq {
            scores.iter_mut().for_each(|p| *p = round_f16(*p));
        }
        let o = &mut out[hh * r..(hh + 1) * r];
        o.iter_mut().for_each(|x| *x = 0.0);
        for (j, &p) in scores.iter().enumerate() {
            crate::ops::axpy(o, p, &cache[j * (r + dr)..j * (r + dr) + r]);
        }
    }
}

/// Round to the nearest f16 value (ties to even), as an f32.
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Causal GQA for T new queries at absolute positions `past..past+T` over a K/V cache holding
/// `past + T` positions.
///
/// `f16_kq` rounds the query and the probabilities to f16 as llama.cpp does against its f16 cache.
///
/// # Shapes
/// q: [T, Hq, D]; kc, vc: [S, Hkv, D]; out: [T, Hq, D]
#[allow(clippy::too_many_arguments)]
pub fn gqa_attend_ref(
    out: &mut [f32],
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    hq: usize,
    hkv: usize,
    d: usize,
    past: usize,
    f16_kq: bool,
) {
    let t = q.len() / (hq * d);
    let scale = 1.0 / (d as f32).sqrt();
    let group = hq / hkv;
    for r in 0..t {
        let n = past + r + 1; // causal: positions 0..=past+r
        let mut scores = vec![0f32; n];
        for hh in 0..hq {
            let kvh = hh / group;
            let qv: Vec<f32> = q[(r * hq + hh) * d..(r * hq + hh + 1) * d]
                .iter()
                .map(|&x| if f16_kq { round_f16(x) } else { x })
                .collect();
            for (j, sc) in scores.iter_mut().enumerate() {
                *sc = crate::ops::dot(&qv, &kc[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d]) * scale;
            }
            crate::ops::softmax_inplace(&mut scores);
            if f16_kq {
                scores.iter_mut().for_each(|p| *p = round_f16(*p));
            }
            let o = &mut out[(r * hq + hh) * d..(r * hq + hh + 1) * d];
            o.iter_mut().for_each(|x| *x = 0.0);
            for (j, &p) in scores.iter().enumerate() {
                crate::ops::axpy(o, p, &vc[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d]);
            }
        }
    }
}
