//! The integer products against ggml's references: every layout on every path this CPU has.

use super::acts::round_even_small;
use super::*;
use crate::hugebuf::Place;
use crate::testing::Rng;

/// One activation row's arrays, owned.
struct Row {
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    s16: Vec<f32>,
    hs: Vec<f32>,
    offs: Vec<i32>,
}

impl Row {
    fn new(nb: usize) -> Row {
        let f = || vec![0f32; nb];
        Row { qs: vec![0; nb * BLOCK], d: f(), s: f(), s16: f(), hs: vec![0.0; 2 * nb], offs: vec![0; 2 * nb] }
    }

    fn out(&mut self) -> RowOut<'_> {
        RowOut {
            qs: &mut self.qs,
            d: &mut self.d,
            s: &mut self.s,
            s16: &mut self.s16,
            hs: &mut self.hs,
            offs: &mut self.offs,
        }
    }
}

#[test]
fn the_simd_quantizer_gives_the_reference_bits() {
    let mut rng = Rng::new(21);
    // 49 blocks: three of the AVX-512 quantizer's 16-block steps and one block after them.
    let (t, cols) = (37, 1568);
    let mut x = rng.normals(t * cols, 2.0);
    x[..32].fill(0.0); // an all-zero block
    x[40] = 1e-30;
    let nb = cols / BLOCK;
    for threads in [1, 2] {
        let a = QActs::quantize_threads(&x, t, cols, threads);
        for r in 0..t {
            let mut row = Row::new(nb);
            quantize_row_ref(&x[r * cols..(r + 1) * cols], row.out());
            let Row { qs, d, s, s16, hs, offs } = row;
            assert_eq!(&a.qs[r * a.nbp * BLOCK..r * a.nbp * BLOCK + cols], &qs[..], "codes, row {r}");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.d[r * a.nbp..r * a.nbp + nb]), bits(&d), "d, row {r}");
            assert_eq!(bits(&a.s[r * a.nbp..r * a.nbp + nb]), bits(&s), "s, row {r}");
            assert_eq!(bits(&a.s16[r * a.nbp..r * a.nbp + nb]), bits(&s16), "s16, row {r}");
            assert_eq!(bits(&a.hs[2 * r * a.nbp..2 * r * a.nbp + 2 * nb]), bits(&hs), "hs, row {r}");
            assert_eq!(&a.offs[2 * r * a.nbp..2 * (r * a.nbp + nb)], &offs[..], "offs, row {r}");
            for b in 0..nb {
                let half =
                    |h: usize| qs[b * BLOCK + 16 * h..b * BLOCK + 16 * h + 16].iter().map(|&q| q as i32).sum::<i32>();
                assert_eq!(hs[2 * b], d[b] * half(0) as f32, "hs, row {r} block {b}");
                assert_eq!(hs[2 * b + 1], d[b] * half(1) as f32, "hs, row {r} block {b}");
                let sum = half(0) + half(1);
                assert_eq!(offs[2 * b..2 * b + 2], [-8 * sum, -128 * sum], "offs, row {r} block {b}");
            }
        }
    }
}

/// Each SIMD quantizer this CPU has, called directly (the engine takes only the best one), gives
/// the reference's bits, also on an all-zero block, a tiny value and evenly spaced values.
#[test]
#[cfg(target_arch = "x86_64")]
fn every_simd_quantizer_gives_the_reference_bits() {
    for cols in [320, 1024, 1568] {
        every_simd_quantizer_gives_the_reference_bits_at(cols);
    }
}

/// One row of `cols` with the special blocks both in a 16-block step and after the last one.
#[cfg(target_arch = "x86_64")]
fn every_simd_quantizer_gives_the_reference_bits_at(cols: usize) {
    let mut rng = Rng::new(23 + cols as u64);
    let nb = cols / BLOCK;
    let mut x = rng.normals(cols, 2.0);
    for at in [0, (nb - 5) * BLOCK] {
        x[at..at + 32].fill(0.0);
        x[at + 40] = 1e-30;
        // evenly spaced
        x[at + 64..at + 96].copy_from_slice(&std::array::from_fn::<f32, 32, _>(|i| (i as f32 - 15.5) * 0.5));
        x[at + 100] = 3e7; // d past f16's largest: infinite, as ggml stores it
        x[at + 128..at + 160].iter_mut().for_each(|v| *v *= 1e-6); // d an f16 subnormal
    }
    type Quantizer = unsafe fn(&[f32], RowOut);
    let mut paths: Vec<(&str, Quantizer)> = Vec::new();
    if Isa::Avx2.supported() {
        paths.push(("avx2", super::x86::quantize_row256));
    }
    if Isa::Avx512.supported() {
        paths.push(("avx512", super::x86::quantize_row512));
    }
    let run = |f: Quantizer| {
        let mut row = Row::new(nb);
        unsafe { f(&x, row.out()) };
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        (row.qs, bits(&row.d), bits(&row.s), bits(&row.s16), bits(&row.hs), row.offs)
    };
    let want = run(quantize_row_ref);
    for (name, f) in paths {
        assert_eq!(run(f), want, "{name} quantizer, {cols} columns");
    }
}

#[test]
fn selected_rows_are_those_rows_quantized() {
    // A mixture's experts take their tokens' rows of one quantized input: each selection must
    // hold exactly what quantizing the gathered rows gives, padding included (an odd block
    // count; 20 rows, past the AMX tiles' 16, pad to 32 rows; 3 rows do not pad).
    let mut rng = Rng::new(23);
    let (t, cols) = (40, 96);
    let x = rng.normals(t * cols, 1.5);
    let all = QActs::quantize(&x, t, cols);
    let pick: Vec<usize> = (0..20).map(|i| (i * 7 + 3) % t).collect();
    for rows in [vec![5, 0, 39], pick, (0..t).collect()] {
        let gathered: Vec<f32> = rows.iter().flat_map(|&r| x[r * cols..(r + 1) * cols].iter().copied()).collect();
        let (got, want) = (all.select_rows(&rows), QActs::quantize(&gathered, rows.len(), cols));
        assert_eq!((got.t, got.nbp), (want.t, want.nbp));
        assert!(got.qs == want.qs && got.d == want.d && got.s == want.s, "{} rows", rows.len());
        assert!(got.s16 == want.s16 && got.hs == want.hs && got.offs == want.offs, "{} rows", rows.len());
    }
}

#[test]
fn the_vectorisable_rounding_is_round_ties_even() {
    let mut rng = Rng::new(3);
    let ties = (-255..=255).map(|i| i as f32 * 0.5);
    let near = ties.clone().flat_map(|x| [x.next_up(), x.next_down()]);
    let random = (0..10_000).map(|_| rng.normal() * 60.0);
    for x in ties.chain(near).chain(random).filter(|x| x.abs() <= 127.5) {
        assert_eq!(round_even_small(x), x.round_ties_even(), "x = {x}");
    }
}

/// Every path this CPU has, every tile shape remainder, against ggml's scalar references.
/// A prefill longer than one of the unpacked path's token blocks (rows16::ACT_BLOCK_BYTES: 1 MiB
/// of activation codes, 512 tokens of 2048 columns): every token is still computed, in its own
/// place. A token skipped or written to another's place is off by its whole value, far outside
/// the tolerance (which long rows need for the summation order of each path).
#[test]
fn long_prefills_cross_token_blocks() {
    let mut rng = Rng::new(23);
    let (rows, cols, t) = (32, 2048, 520);
    let x = rng.normals(t * cols, 1.5);
    let a = QActs::quantize(&x, t, cols);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL] {
        let w = rng.normals(rows * cols, 0.4);
        let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
        let want = gemm_ref(ty, &data, rows, cols, &x, t);
        let p = Packed::pack_as(ty, rows, cols, &data, Layout::Rows16, Place::Heap).expect("a 16-row type");
        for isa in Isa::available() {
            let mut got = vec![f32::NAN; rows * t];
            gemm_rows(isa, &p, &a, 0, rows, &mut got);
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!((g - e).abs() <= 2e-3 * (1.0 + e.abs()), "{} {} elem {i}: {g} vs {e}", ty.name(), isa.name());
            }
        }
    }
}

/// The VNNI tiles start each block's integer sums from the activations' offset terms
/// (`QActs::offs`: −8·Σq for Q4_0, −128·Σq for Q8_0 and IQ4_NL, whose tiles take code + 128)
/// where the AVX-512 BW tiles add −8·s in f32 (Q4_0) or take signed codes (Q8_0, IQ4_NL): both
/// round d_x·(the signed dot) once, so they give the same bits, for every token count's tile
/// (Q4_0: one token with the high nibbles in place, two and three in two sets of sums, four and
/// more in one) and through both output layouts (rows one float apart take one masked store a
/// group; rows a token apart, scalar ones), partial row groups and odd block counts included;
/// IQ4_NL's lookups by vpermb (AVX-512 VBMI) and by vpshufb alike.
#[test]
fn vnni_tiles_fold_code_offsets_into_the_same_bits() {
    if !(Isa::Avx512Vnni.supported() && Isa::Avx512.supported()) {
        eprintln!("skipped: this CPU lacks AVX-512 VNNI");
        return;
    }
    let mut rng = Rng::new(31);
    for (ty, (rows, cols)) in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::IQ4_NL]
        .into_iter()
        .flat_map(|ty| [(80, 1024), (37, 224), (256, 96)].map(|shape| (ty, shape)))
    {
        let w = rng.normals(rows * cols, 0.4);
        let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
        let p = Packed::pack_as(ty, rows, cols, &data, Layout::Rows16, Place::Heap).expect("a 16-row type");
        for t in [1, 2, 3, 4, 7, 8, 11] {
            let a = QActs::quantize(&rng.normals(t * cols, 1.5), t, cols);
            let run = |isa: Isa, token_major: bool| {
                let mut y = vec![f32::NAN; rows * t];
                // SAFETY: y holds [T, rows] (token-major) or [rows, T], every element its own.
                unsafe {
                    let out = if token_major {
                        OutMat::token_major(y.as_mut_ptr(), 0, rows)
                    } else {
                        OutMat { ptr: y.as_mut_ptr(), rs: t, cs: 1 }
                    };
                    gemm_rows_out(isa, &p, &a, 0, rows, out);
                }
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            for token_major in [true, false] {
                let bw = run(Isa::Avx512, token_major);
                // IQ4_NL's codes by vpermb where the CPU has VBMI, and by vpshufb (the VNNI
                // CPUs without it); other tests may run either meanwhile, both exact.
                for vbmi in [true, false] {
                    set_vbmi(vbmi);
                    let vnni = run(Isa::Avx512Vnni, token_major);
                    set_vbmi(true);
                    let name = ty.name();
                    assert!(
                        vnni == bw,
                        "{name} {rows} x {cols}, T = {t}, token-major {token_major}, VBMI {vbmi}: VNNI and BW bits differ"
                    );
                }
            }
        }
    }
}

#[test]
fn every_isa_matches_ggml_vec_dot() {
    eprintln!("paths on this CPU: {:?}", Isa::available());
    let mut rng = Rng::new(17);
    // Q5_0 and Q5_1 take the nibble tiles with a high-bit plane (16-row layout only; Q5_0 packs
    // as Q8_0 in row pairs), IQ4_NL the byte-code tiles with its nibbles looked up (16-row
    // layout; Q8_0 in row pairs).
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL] {
        for &(rows, cols, t) in &[
            (1, 32, 1),
            (7, 96, 3),
            (9, 256, 5),
            (16, 576, 8),
            (5, 64, 13),
            (33, 96, 37),
            (40, 320, 17),
            (6, 1088, 2),
            (150, 256, 1),
            (64, 64, 1),
            (60, 64, 1),
        ] {
            let w = rng.normals(rows * cols, 0.4);
            let x = rng.normals(t * cols, 1.5);
            let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
            let want = gemm_ref(ty, &data, rows, cols, &x, t);
            let a = QActs::quantize(&x, t, cols);
            // Every layout on every path: a path that does not read a layout falls back to one
            // that does (the scalar loops at least), so each pair must still be right.
            let layouts = [Layout::RowPairs, Layout::Rows16];
            let packs = layouts.iter().filter_map(|&l| Packed::pack_as(ty, rows, cols, &data, l, Place::Huge));
            for (p, isa) in packs.flat_map(|p| Isa::available().into_iter().map(move |i| (p.clone(), i))) {
                let p = &p;
                let align = p.row_align();
                let mid = (rows / 2).next_multiple_of(align).min(rows);
                // Token-major output (the engine's layout) holds the same numbers.
                let mut tm = vec![f32::NAN; t * rows];
                for (lo, hi) in [(0, mid), (mid, rows)] {
                    unsafe { gemm_rows_out(isa, p, &a, lo, hi, OutMat::token_major(tm.as_mut_ptr(), lo, rows)) };
                }
                let mut rm = vec![0f32; rows * t];
                gemm_rows(isa, p, &a, 0, rows, &mut rm);
                for o in 0..rows {
                    for r in 0..t {
                        assert_eq!(
                            tm[r * rows + o],
                            rm[o * t + r],
                            "{} {} {:?} token-major ({o}, {r})",
                            ty.name(),
                            isa.name(),
                            p.layout
                        );
                    }
                }
                for (lo, hi) in [(0, rows), (mid, rows)] {
                    // A guard past the output: no path writes rows it was not asked for.
                    let mut got = vec![0f32; (hi - lo) * t + 64];
                    gemm_rows(isa, p, &a, lo, hi, &mut got);
                    let guard = got.split_off((hi - lo) * t);
                    assert!(guard.iter().all(|&g| g == 0.0), "{} {}: wrote past its rows", ty.name(), isa.name());
                    for (i, (g, e)) in got.iter().zip(&want[lo * t..hi * t]).enumerate() {
                        let scale = 1.0 + e.abs();
                        assert!(
                            (g - e).abs() <= 2e-5 * scale * (cols as f32 / 32.0).sqrt(),
                            "{} {} {:?} [{rows}x{cols}]·[{t}] rows {lo}..{hi} elem {i}: {g} vs {e}",
                            ty.name(),
                            isa.name(),
                            p.layout
                        );
                    }
                }
            }
        }
    }
}

/// Q6_K, Q5_K, Q4_K, Q3_K and Q2_K in the 16-row layout, on every path this CPU has (the scalar loops
/// included), against the product written out from ggml's own codes and scales
/// (`q6_k_halves`, `q3_k_halves`, `q5_k_blocks`: the scales and mins rounded to f16, the tiles'
/// one approximation; Q4_K's and Q2_K's `d·sc` and `dmin·m` formed in f32, as ggml forms them) and the
/// activations' 8-bit codes; and against ggml's `vec_dot_q*_K_q8_K`:
/// measured from the exact product of the file's dequantized rows, the tiles' error is no
/// larger than ggml's (whose activations are rounded per 256, ours per 32).
#[test]
fn k_quant_tiles_match_ggml_codes_and_scales() {
    use crate::quant::k_quants::{q5_k_blocks, q6_k_halves, scale_min_k4, QK};
    use crate::quant::k_quants_low::{q2_k_codes, q3_k_halves};
    let f = |bits: u16| half::f16::from_bits(bits).to_f32() as f64;
    let mut rng = Rng::new(23);
    for ty in [GgmlType::Q6_K, GgmlType::Q5_K, GgmlType::Q4_K, GgmlType::Q3_K, GgmlType::Q2_K] {
        for &(rows, cols, t) in &[(16, 256, 1), (21, 512, 3), (40, 768, 9), (17, 256, 17), (70, 512, 1)] {
            let w = rng.normals(rows * cols, 0.4);
            let x = rng.normals(t * cols, 1.5);
            let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
            let name = ty.name();
            // In row pairs Q4_K enters as Q4_1 blocks; the others have no row-pair tiles.
            let pairs = Packed::pack_as(ty, rows, cols, &data, Layout::RowPairs, Place::Heap).map(|p| p.kind);
            assert_eq!(pairs, (ty == GgmlType::Q4_K).then_some(Kind::Q4_1), "{name}: row-pair tiles");
            let p =
                Packed::pack_as(ty, rows, cols, &data, Layout::Rows16, Place::Heap).expect("packs in 16-row groups");
            let kind = match ty {
                GgmlType::Q6_K => Kind::Q6K,
                GgmlType::Q5_K => Kind::Q5K,
                GgmlType::Q3_K => Kind::Q3K,
                GgmlType::Q2_K => Kind::Q2K,
                _ => Kind::Q4K,
            };
            assert_eq!(p.kind, kind);
            let a = QActs::quantize(&x, t, cols);
            let bb = ty.block_bytes();
            let mut want = vec![0f64; rows * t];
            for o in 0..rows {
                let row = &data[o * cols / QK * bb..(o + 1) * cols / QK * bb];
                for (k, blk) in row.chunks_exact(bb).enumerate() {
                    for r in 0..t {
                        let (xq, dx) = a.row(r);
                        let xs = &xq[k * QK..(k + 1) * QK];
                        let dxs = &dx[k * 8..(k + 1) * 8];
                        want[o * t + r] += if ty == GgmlType::Q4_K {
                            let (d, dmin) =
                                (f(u16::from_le_bytes([blk[0], blk[1]])), f(u16::from_le_bytes([blk[2], blk[3]])));
                            (0..8)
                                .map(|j| {
                                    let (ls, lm) = scale_min_k4(j, &blk[4..16]);
                                    let q = &blk[16 + 32 * (j / 2)..16 + 32 * (j / 2 + 1)];
                                    let code = |i: usize| if j % 2 == 0 { q[i] & 0x0F } else { q[i] >> 4 } as i32;
                                    let isum: i32 = (0..32).map(|i| code(i) * xs[32 * j + i] as i32).sum();
                                    let xsum: i32 = xs[32 * j..32 * (j + 1)].iter().map(|&v| v as i32).sum();
                                    let (sc, mn) = ((d as f32 * ls as f32) as f64, (-(dmin as f32) * lm as f32) as f64);
                                    dxs[j] as f64 * (sc * isum as f64 + mn * xsum as f64)
                                })
                                .sum::<f64>()
                        } else if ty == GgmlType::Q3_K {
                            let (q, sc) = q3_k_halves(blk).expect("finite scales");
                            (0..16)
                                .map(|g| {
                                    let isum: i32 =
                                        (0..16).map(|i| (q[16 * g + i] as i32 - 4) * xs[16 * g + i] as i32).sum();
                                    f(sc[g]) * dxs[g / 2] as f64 * isum as f64
                                })
                                .sum::<f64>()
                        } else if ty == GgmlType::Q2_K {
                            let (q, d, dmin, scb) = q2_k_codes(blk);
                            (0..16)
                                .map(|g| {
                                    let isum: i32 = (0..16).map(|i| q[16 * g + i] as i32 * xs[16 * g + i] as i32).sum();
                                    let xsum: i32 = xs[16 * g..16 * (g + 1)].iter().map(|&v| v as i32).sum();
                                    let sc = (d * (scb[g] & 0xF) as f32) as f64;
                                    let mn = (-dmin * (scb[g] >> 4) as f32) as f64;
                                    dxs[g / 2] as f64 * (sc * isum as f64 + mn * xsum as f64)
                                })
                                .sum::<f64>()
                        } else if ty == GgmlType::Q6_K {
                            let (q, sc) = q6_k_halves(blk).expect("finite scales");
                            (0..16)
                                .map(|g| {
                                    let isum: i32 = (0..16).map(|i| q[16 * g + i] as i32 * xs[16 * g + i] as i32).sum();
                                    f(sc[g]) * dxs[g / 2] as f64 * isum as f64
                                })
                                .sum::<f64>()
                        } else {
                            let (q, sc, mn) = q5_k_blocks(blk).expect("finite scales");
                            (0..8)
                                .map(|j| {
                                    let isum: i32 = (0..32).map(|i| q[32 * j + i] as i32 * xs[32 * j + i] as i32).sum();
                                    let xsum: i32 = xs[32 * j..32 * (j + 1)].iter().map(|&v| v as i32).sum();
                                    dxs[j] as f64 * (f(sc[j]) * isum as f64 + f(mn[j]) * xsum as f64)
                                })
                                .sum::<f64>()
                        };
                    }
                }
            }
            for isa in Isa::available() {
                let mut got = vec![0f32; rows * t];
                gemm_rows(isa, &p, &a, 0, rows, &mut got);
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (*g as f64 - e).abs() <= 2e-5 * (1.0 + e.abs()) * (cols as f64 / 32.0).sqrt(),
                        "{name} {} [{rows}x{cols}]·[{t}] elem {i}: {g} vs {e}",
                        isa.name()
                    );
                }
            }
            let ggml = gemm_ref(ty, &data, rows, cols, &x, t);
            let mut got = vec![0f32; rows * t];
            gemm_rows(Isa::best(), &p, &a, 0, rows, &mut got);
            let mut deq = vec![0f32; rows * cols];
            ty.dequantize_row(&data, &mut deq);
            let exact: Vec<f64> = (0..rows * t)
                .map(|i| {
                    let (o, r) = (i / t, i % t);
                    (0..cols).map(|k| deq[o * cols + k] as f64 * x[r * cols + k] as f64).sum()
                })
                .collect();
            let rms = |v: &[f32]| {
                (v.iter().zip(&exact).map(|(a, e)| (*a as f64 - e).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
            };
            let (ours, theirs) = (rms(&got), rms(&ggml));
            assert!(ours <= theirs, "{name} [{rows}x{cols}]·[{t}]: rms error {ours:.3e} against ggml's {theirs:.3e}");
        }
    }
}

#[test]
fn packed_rows_dequantize_like_ggml_and_select() {
    let mut rng = Rng::new(5);
    let (rows, cols) = (20, 96); // more than one 16-row group
    let cases = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::IQ4_NL, GgmlType::IQ4_XS]
        .into_iter()
        .flat_map(|ty| [(ty, Layout::RowPairs), (ty, Layout::Rows16)])
        .chain([(GgmlType::Q6_K, Layout::Rows16), (GgmlType::Q5_K, Layout::Rows16), (GgmlType::Q5_1, Layout::Rows16)])
        .chain([(GgmlType::Q3_K, Layout::Rows16), (GgmlType::Q2_K, Layout::Rows16)])
        .chain([(GgmlType::Q4_K, Layout::Rows16), (GgmlType::Q4_K, Layout::RowPairs)]);
    for (ty, layout) in cases {
        // K-quants: super-blocks of 256; scales and mins rounded to f16 (each term off by at
        // most 2⁻¹¹ of itself; code·scale and min reach ~1.6 here and can cancel).
        let (cols, tol) = if ty.block_elems() == 256 { (512, 2e-3) } else { (cols, 1e-6) };
        let w = rng.normals(rows * cols, 0.4);
        let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
        let p = Packed::pack_as(ty, rows, cols, &data, layout, Place::Heap).expect("every type packs in every layout");
        let rb = ty.row_bytes(cols);
        let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
        let sel = p.select_rows(&[17, 4, 1], Place::Huge);
        assert_eq!((sel.layout, sel.rows), (layout, 3));
        for r in 0..rows {
            ty.dequantize_row(&data[r * rb..(r + 1) * rb], &mut a);
            let picked = [17, 4, 1].iter().position(|&s| s == r);
            for (k, m) in [(Some(r), &p), (picked, &sel)] {
                let Some(k) = k else { continue };
                m.dequant_row(k, &mut b);
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() <= tol * (1.0 + x.abs()), "{} {layout:?} row {r}: {x} vs {y}", ty.name());
                }
            }
        }
    }
}

#[test]
fn scalar_path_is_always_there() {
    assert_eq!(Isa::available()[0], Isa::Scalar);
}

/// Packing a band of rows at a time gives the bytes of one `pack`, for every kind and layout,
/// with a last band shorter than the others, and as one band; every row's bytes are handed back
/// once, in order; the result is on huge pages where they are on (Linux, not turned off).
#[test]
fn packing_in_bands_equals_packing_at_once() {
    let mut rng = Rng::new(31);
    let (rows, cols) = (53, 512);
    let types = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL];
    let k_quants = [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q3_K, GgmlType::Q2_K, GgmlType::IQ4_XS];
    for ty in types.into_iter().chain(k_quants) {
        let w = rng.normals(rows * cols, 0.4);
        let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
        let whole = Packed::pack(ty, rows, cols, &data, Place::Heap).expect("packs");
        for band_rows in [3, rows] {
            let mut seen = 0;
            let banded = Packed::pack_bands(ty, rows, cols, &data, band_rows * ty.row_bytes(cols), |b| {
                assert_eq!(b.as_ptr(), data[seen..].as_ptr(), "{}: bands in order", ty.name());
                seen += b.len();
            })
            .expect("packs in bands");
            assert_eq!(seen, data.len(), "{}: every byte handed back", ty.name());
            let key = |p: &Packed| (p.kind, p.layout, p.rows, p.cols, p.nbp, p.qs.clone(), p.d.clone(), p.m.clone());
            assert!(key(&whole) == key(&banded), "{}: banded packing differs ({band_rows} rows a band)", ty.name());
            let huge = cfg!(target_os = "linux") && crate::hugebuf::enabled();
            assert_eq!(banded.qs.is_huge(), huge, "{}: the banded matrix's place", ty.name());
        }
    }
}

#[test]
fn array_from_calls_f_once_per_index_in_order() {
    let mut calls = Vec::new();
    let a: [usize; 5] = array_from(|i| {
        calls.push(i);
        10 * i + 1
    });
    assert_eq!(a, [1, 11, 21, 31, 41]);
    assert_eq!(calls, [0, 1, 2, 3, 4]);
    let empty: [u8; 0] = array_from(|_| unreachable!("no index for an empty array"));
    assert!(empty.is_empty());
}

#[test]
fn the_cpu_vendor_matches_the_kernel_s() {
    // Linux names the vendor in /proc/cpuinfo; elsewhere there is nothing to compare against.
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else { return };
    let Some(vendor) = info.lines().find_map(|l| l.strip_prefix("vendor_id")) else { return };
    let vendor = vendor.trim_start_matches([' ', '\t', ':']).trim();
    assert_eq!(amd_cpu(), vendor == "AuthenticAMD", "vendor_id {vendor:?}");
}
