//! Engine behaviour: several interleaved sequences, context and vocabulary limits, state sizes.

use std::path::{Path, PathBuf};

use k3_infer::{Engine, Logits, Model};

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(name)
}

#[test]
fn interleaved_sequences_match_separate_runs() {
    let (mut model, _) = Model::load(&golden("tiny_k3")).expect("load");
    // Reference numerics: prefill (chunked) and decode (step) paths then differ only by float
    // order; llama.cpp numerics add f16 / int8 roundings that the two paths may round apart.
    model.compute.exact = true;
    let a: Vec<u32> = (0..30).map(|i| (i * 7 + 3) % 250 + 3).collect();
    let b: Vec<u32> = (0..30).map(|i| (i * 11 + 5) % 250 + 3).collect();
    let alone = |ids: &[u32]| {
        let mut st = model.new_state();
        model.forward(ids, &mut st, Logits::All).expect("forward")
    };
    let (wa, wb) = (alone(&a), alone(&b));
    let mut e = Engine::new(model);
    let (sa, sb) = (e.add_sequence(), e.add_sequence());
    let v = 256;
    let mut got_a = e.feed(sa, &a[..10], Logits::All).expect("a");
    let mut got_b = e.feed(sb, &b[..17], Logits::All).expect("b");
    for &tok in &a[10..17] {
        got_a.extend(e.step(&[(sa, tok)]).expect("step").remove(0));
    }
    for i in 17..30 {
        let mut out = e.step(&[(sa, a[i]), (sb, b[i])]).expect("batch step");
        got_b.extend(out.remove(1));
        got_a.extend(out.remove(0));
    }
    for (name, got, want) in [("a", &got_a, &wa), ("b", &got_b, &wb)] {
        let d = got.iter().zip(want.iter()).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(d < 1e-4, "sequence {name}: {d:e}");
        assert_eq!(got.len(), 30 * v);
    }
    assert_eq!(e.tokens(sa).expect("a").len(), 30);
    // The KDA state is constant-size; the MLA cache grows with the sequence.
    let before = e.state_bytes(sa).expect("bytes");
    e.feed(sa, &[5, 6, 7], Logits::Last).expect("more");
    let after = e.state_bytes(sa).expect("bytes");
    assert_eq!(after - before, 3 * (32 + 8) * 4, "one MLA layer × 3 tokens × (R + Dr) f32");
    e.remove_sequence(sb);
    assert!(e.feed(sb, &[1], Logits::Last).is_err());
    assert_eq!(e.live_sequences(), 1);
}

#[test]
fn limits_are_clear_errors_and_leave_the_state_usable() {
    let (mut model, _) = Model::load(&golden("tiny_kimi_linear_dense")).expect("load");
    model.n_ctx = 16;
    let mut st = model.new_state();
    let e = model.forward(&[3; 17], &mut st, Logits::Last).expect_err("too long").to_string();
    assert!(e.contains("17 tokens") && e.contains("context of 16"), "{e}");
    let e = model.forward(&[3, 999], &mut st, Logits::Last).expect_err("oov").to_string();
    assert!(e.contains("999") && e.contains("vocab_size 256"), "{e}");
    assert_eq!(st.pos, 0);
    model.forward(&[3; 16], &mut st, Logits::Last).expect("fits exactly");
}

#[test]
fn threads_split_work_without_changing_results() {
    // A prompt long enough that every row-parallel op (norms, conv, gates, GLU), the KDA chunks
    // and the matmul bands split over threads; each output element is computed by the same
    // arithmetic whichever thread takes it, so the logits must be identical.
    let (mut model, _) = Model::load(&golden("tiny_k3")).expect("load");
    let ids: Vec<u32> = (0..700).map(|i| (i * 13 + 7) % 250 + 3).collect();
    let mut run = |threads: usize| {
        model.compute.threads = threads;
        let mut st = model.new_state();
        let mut all = model.forward(&ids, &mut st, Logits::All).expect("prefill");
        all.extend(model.forward(&[9], &mut st, Logits::Last).expect("decode"));
        all
    };
    let one = run(1);
    for threads in [2, 3] {
        assert!(run(threads) == one, "{threads} threads changed the logits");
    }
}

#[test]
fn long_prefill_over_decompressed_mla_matches_the_reference() {
    // A prompt long enough that MLA's fast prefill expands keys and values from the latent cache
    // (a short one stays in latent space); its logits stay within f16-cache rounding of the
    // exact path, which attends one query at a time in latent space. Then a decode step and a
    // second long chunk after cached positions.
    let (mut model, _) = Model::load(&golden("tiny_k3")).expect("load");
    let k3_config::ModelConfig::Kimi(cfg) = model.config.clone() else { panic!("tiny_k3 is a Kimi model") };
    let ids: Vec<u32> = (0..300).map(|i| (i * 13 + 7) % 250 + 3).collect();
    assert!(k3_infer::mla::prefill_expands(&cfg.mla, 300, 0) && k3_infer::mla::prefill_expands(&cfg.mla, 300, 301));
    assert!(!k3_infer::mla::prefill_expands(&cfg.mla, 8, 0) && !k3_infer::mla::prefill_expands(&cfg.mla, 1, 300));
    let mut run = |exact: bool| {
        model.compute.exact = exact;
        let mut st = model.new_state();
        let mut all = model.forward(&ids, &mut st, Logits::All).expect("prefill");
        all.extend(model.forward(&[9], &mut st, Logits::Last).expect("decode"));
        all.extend(model.forward(&ids, &mut st, Logits::All).expect("second chunk"));
        all
    };
    let (exact, fast) = (run(true), run(false));
    let worst = exact.iter().zip(&fast).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let scale = exact.iter().map(|a| a.abs()).fold(0f32, f32::max);
    assert!(worst <= 2e-3 * scale.max(1.0), "fast prefill differs from the reference by {worst} (logit scale {scale})");
}

#[test]
fn batched_steps_refuse_bad_batches_and_move_no_sequence() {
    let (model, _) = Model::load(&golden("tiny_kimi_linear_dense")).expect("load");
    let mut e = Engine::new(model);
    let (a, b) = (e.add_sequence(), e.add_sequence());
    e.feed(a, &[3, 4, 5], Logits::Last).expect("a");
    e.feed(b, &[6], Logits::Last).expect("b");
    let err = e.step(&[(a, 7), (a, 8)]).expect_err("twice").to_string();
    assert!(err.contains("more than once"), "{err}");
    let err = e.step(&[(a, 7), (b, 999)]).expect_err("oov").to_string();
    assert!(err.contains("sequence 1 of the batch") && err.contains("999"), "{err}");
    e.remove_sequence(b);
    let err = e.step(&[(a, 7), (b, 8)]).expect_err("removed").to_string();
    assert!(err.contains("does not exist"), "{err}");
    assert_eq!(e.tokens(a).expect("a"), &[3, 4, 5], "a failed step moved no sequence");
    // A sequence state from another model is named too.
    let (other, _) = Model::load(&golden("tiny_k3")).expect("load");
    let (m, _) = Model::load(&golden("tiny_kimi_linear_dense")).expect("load");
    let (mut s0, mut s1) = (m.new_state(), other.new_state());
    let err = m.forward_batch(&[3, 4], &mut [&mut s0, &mut s1]).expect_err("foreign state").to_string();
    assert!(err.contains("sequence 1") && err.contains("another model"), "{err}");
    assert_eq!((s0.pos, s1.pos), (0, 0));
    let err = m.forward_batch(&[3], &mut [&mut s0, &mut s1]).expect_err("count").to_string();
    assert!(err.contains("1 tokens for 2 sequences"), "{err}");
}

#[test]
fn generating_several_sequences_together_matches_generating_each_alone() {
    use k3_infer::engine::StopReason;
    use k3_infer::SamplerConfig;
    use std::ops::ControlFlow;
    let prompts: [Vec<u32>; 3] = [vec![5, 9, 17], (0..11).map(|i| (i * 13 + 7) % 250 + 3).collect(), vec![42]];
    for (temperature, seed) in [(0.0, 0), (0.9, 7)] {
        let cfg = SamplerConfig { temperature, seed, ..SamplerConfig::default() };
        let load = || Engine::new(Model::load(&golden("tiny_k3")).expect("load").0);
        // Each alone, in its own engine.
        let alone: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut e = load();
                let s = e.add_sequence();
                e.generate(s, p, 9, cfg.clone(), &[], |_| ControlFlow::Continue(())).expect("alone")
            })
            .collect();
        // Together, the third stopped by its callback after 4 tokens.
        let mut e = load();
        let ids: Vec<_> = prompts.iter().map(|_| e.add_sequence()).collect();
        let jobs: Vec<_> = ids.iter().zip(&prompts).map(|(&id, p)| (id, p.as_slice())).collect();
        let mut streamed = vec![Vec::new(); 3];
        let got = e
            .generate_many(&jobs, 9, cfg.clone(), &[], |j, t| {
                streamed[j].push(t);
                if j == 2 && streamed[j].len() == 4 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .expect("together");
        for j in 0..3 {
            let want: &[u32] = if j == 2 { &alone[j].tokens[..4] } else { &alone[j].tokens };
            assert_eq!(got[j].tokens, want, "temperature {temperature}: sequence {j}");
            assert_eq!(streamed[j], got[j].tokens, "sequence {j}: streamed what it returned");
            // Every sampled token is fed but the one its callback stopped on.
            let fed = got[j].tokens.len() - usize::from(j == 2);
            assert_eq!(e.tokens(ids[j]).expect("tokens").len(), prompts[j].len() + fed, "sequence {j}");
        }
        assert_eq!(
            (got[0].reason, got[1].reason, got[2].reason),
            (StopReason::MaxTokens, StopReason::MaxTokens, StopReason::Callback)
        );
        // A stop token ends only the sequence that drew it.
        let stop = alone[0].tokens[2];
        let mut e = load();
        let ids: Vec<_> = prompts.iter().map(|_| e.add_sequence()).collect();
        let jobs: Vec<_> = ids.iter().zip(&prompts).map(|(&id, p)| (id, p.as_slice())).collect();
        let got = e.generate_many(&jobs, 9, cfg.clone(), &[stop], |_, _| ControlFlow::Continue(())).expect("stop");
        assert_eq!(got[0].tokens, alone[0].tokens[..2], "sequence 0 stops before its stop token");
        assert_eq!(got[0].reason, StopReason::StopToken);
        for j in 1..3 {
            let cut = alone[j].tokens.iter().position(|&t| t == stop).unwrap_or(9);
            assert_eq!(got[j].tokens, alone[j].tokens[..cut], "sequence {j} with the stop token");
        }
    }
    let mut e = Engine::new(Model::load(&golden("tiny_k3")).expect("load").0);
    let s = e.add_sequence();
    let err = e
        .generate_many(&[(s, &[3][..]), (s, &[4][..])], 2, SamplerConfig::default(), &[], |_, _| {
            ControlFlow::Continue(())
        })
        .expect_err("twice");
    assert!(err.to_string().contains("more than one prompt"), "{err}");
    assert_eq!(e.tokens(s).expect("tokens").len(), 0, "nothing fed");
}
