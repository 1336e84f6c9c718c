//! Batched decode (`Model::forward_batch`, `Engine::step`): several sequences at different
//! positions (one past the attention's split threshold) decoded together give each sequence the logits it gets alone, on f32 checkpoints
//! and on their Q4_0 GGUFs (the integer kernels), for every model family and layer kind the
//! engine runs, at 1 and 2 threads. Pure Rust (the core tier).

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{golden, k3mini, run, scratch};
use k3_config::ModelConfig;
use k3_infer::linear::Compute;
use k3_infer::{Engine, Logits, Model};

/// A Llama checkpoint (tiny-llama's shape cut to 2 layers and 256 ids) with small random
/// weights, so that the batch test also covers the Llama family without libtorch.
fn random_llama(dir: &Path) {
    let mut cfg = k3_config::presets::tiny_llama();
    cfg.num_hidden_layers = 2;
    cfg.vocab_size = 256;
    let cfg = ModelConfig::Llama(cfg);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let tensors: HashMap<String, Vec<f32>> = k3_format::tensor_specs(&cfg)
        .into_iter()
        .map(|s| {
            let n = s.numel();
            let v = if s.shape.len() == 1 {
                (0..n).map(|_| 1.0 + 0.2 * rnd()).collect()
            } else {
                (0..n).map(|_| 0.2 * rnd()).collect()
            };
            (s.name, v)
        })
        .collect();
    k3_format::checkpoint::save_checkpoint(dir, &cfg, tensors).expect("write the random Llama checkpoint");
}

/// Five sequences with prompts of different lengths, then `steps` batched decode steps through
/// an engine, against the same tokens fed to each sequence alone. Returns the largest logit
/// difference relative to the logits' scale, and checks the greedy picks agree wherever the
/// top two are apart by more than that.
fn batch_against_alone(model_path: &Path, threads: usize, steps: usize) -> f32 {
    let (mut model, _) = Model::load(model_path).expect("load");
    model.compute = Compute { threads, exact: false };
    let v = model.vocab_size() as u32;
    // The fifth past the 1,024 positions from which a decode step's attention splits the cache
    // over the threads (MLA's latent rows, Llama's K/V).
    let prompts: Vec<Vec<u32>> = [5usize, 1, 12, 3, 1030]
        .iter()
        .enumerate()
        .map(|(s, &n)| (0..n as u32).map(|i| (i * 7 + 11 * s as u32 + 3) % (v - 3) + 3).collect())
        .collect();
    let next = |s: usize, i: usize| ((i * 13 + s * 5 + 1) as u32) % (v - 3) + 3;
    // Each sequence alone.
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        let mut st = model.new_state();
        let mut out = vec![model.forward(p, &mut st, Logits::Last).expect("prefill")];
        for i in 0..steps {
            out.push(model.forward(&[next(s, i)], &mut st, Logits::Last).expect("decode"));
        }
        alone.push(out);
    }
    // Together.
    let mut e = Engine::new(model);
    let ids: Vec<_> = prompts.iter().map(|_| e.add_sequence()).collect();
    let mut together: Vec<Vec<Vec<f32>>> =
        ids.iter().zip(&prompts).map(|(&id, p)| vec![e.feed(id, p, Logits::Last).expect("prefill")]).collect();
    for i in 0..steps {
        let batch: Vec<_> = ids.iter().enumerate().map(|(s, &id)| (id, next(s, i))).collect();
        for (s, l) in e.step(&batch).expect("batched step").into_iter().enumerate() {
            together[s].push(l);
        }
    }
    for (s, &id) in ids.iter().enumerate() {
        assert_eq!(e.tokens(id).expect("tokens").len(), prompts[s].len() + steps);
    }
    let mut worst = 0f32;
    for (s, (a, b)) in alone.iter().zip(&together).enumerate() {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            let scale = x.iter().fold(1f32, |m, v| m.max(v.abs()));
            let d = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max) / scale;
            worst = worst.max(d);
            let mut order: Vec<usize> = (0..x.len()).collect();
            order.sort_by(|&p, &q| x[q].total_cmp(&x[p]));
            let top = |l: &[f32]| (0..l.len()).max_by(|&p, &q| l[p].total_cmp(&l[q])).expect("logits");
            if (x[order[0]] - x[order[1]]) / scale > 2.0 * d {
                assert_eq!(top(x), top(y), "{}: sequence {s}, step {i}: greedy picks differ", model_path.display());
            }
        }
    }
    worst
}

#[test]
fn batched_decode_gives_each_sequence_its_own_logits() {
    let dir = scratch("batch");
    let llama = dir.join("llama");
    random_llama(&llama);
    let mut models = vec![llama.clone()];
    for name in ["tiny_kimi_linear_dense", "tiny_kimi_linear_moe", "tiny_k3"] {
        models.push(golden(name));
    }
    for m in models.clone() {
        let name = m.file_name().expect("name").to_string_lossy().to_string();
        let g = dir.join(format!("{name}-q4_0.gguf"));
        run(k3mini().args(["quantize", "--model"]).arg(&m).args(["--type", "q4_0", "--out"]).arg(&g));
        models.push(g);
    }
    for m in &models {
        for threads in [1, 2] {
            let worst = batch_against_alone(m, threads, 6);
            eprintln!("{} at {threads} thread(s): largest relative logit difference {worst:.2e}", m.display());
            // The products over B rows run the multi-token kernels, whose sums may be taken in
            // another order than the one-token kernels'; nothing else differs.
            assert!(worst < 1e-5, "{}: batched logits differ from alone by {worst:e} of their scale", m.display());
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
