//! The SmolLM2-135M-Instruct teacher GGUF (llama arch, Q4_1 + Q8_0, embedded BPE tokenizer) in our
//! engine against transformers' GGUF loader: logits, tokenization, and a chat generation.

mod common;

use std::process::Command;

use common::*;
use k3_infer::tokenizer::Tokenizer;
use k3_infer::{Logits, Model};

const TEXTS: &[&str] = &[
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n",
    "Numbers 1234567 and 3.14159, unicode café naïve 東京 🚀, tabs\tand  spaces.",
    "<|im_start|>user\nHi there<|im_end|>\n",
];

#[test]
fn teacher_gguf_matches_transformers() {
    let (Some(py), Some(gguf)) = (python(), teacher()) else { return };
    let tok = Tokenizer::for_model(&gguf).expect("tokenizer").expect("the teacher has a vocabulary");
    let ids = tok.encode(TEXTS[0]).expect("encode");
    let ids_s: Vec<String> = ids.iter().map(u32::to_string).collect();
    let d = scratch("teacher");
    let out = d.join("ref.safetensors");
    let mut cmd = Command::new(&py);
    cmd.arg(tool("smollm2_reference.py")).arg(&gguf).arg(ids_s.join(",")).arg(&out);
    cmd.args(TEXTS);
    run(&mut cmd);
    // Tokenizer: identical ids on code, digits, unicode and special tokens.
    for (i, text) in TEXTS.iter().enumerate() {
        let (_, want) = read(&out, &format!("text.{i}"));
        let got: Vec<f32> = tok.encode(text).expect("encode").iter().map(|&x| x as f32).collect();
        assert_eq!(got, want, "tokenization of text {i}");
    }
    // Logits: the same dequantized weights in f32 through 30 layers.
    let (mut model, _) = Model::load(&gguf).expect("load teacher");
    model.compute.exact = true; // transformers runs f32 activations on the dequantized weights
    let mut st = model.new_state();
    let got = model.forward(&ids, &mut st, Logits::All).expect("forward");
    let (shape, want) = read(&out, "logits");
    assert_eq!(shape, vec![ids.len(), 49152]);
    let diff = max_abs(&got, &want);
    assert!(diff < 2e-3, "max |k3mini − transformers| on the teacher = {diff:e}");
    assert_eq!(top1_agreement(&got, &want, 49152), 1.0);
}

#[test]
fn teacher_chat_generation_runs() {
    let Some(gguf) = teacher() else { return };
    let text = run(k3mini().args(["generate", "--model"]).arg(&gguf).args([
        "--prompt",
        "Write a Python function that returns the factorial of n.",
        "--chat",
        "--max-tokens",
        "40",
    ]));
    assert!(text.contains("def ") || text.contains("factorial"), "unexpected output:\n{text}");
}

#[test]
fn several_prompts_generate_together_as_each_does_alone() {
    let Some(gguf) = teacher() else { return };
    let prompts = ["Name three primary colors.", "Write a Python function that returns the factorial of n.", "Say hi."];
    let gen = |ps: &[&str]| {
        let mut c = k3mini();
        c.args(["generate", "--model"]).arg(&gguf).args(["--chat", "--threads", "2", "--max-tokens", "24"]);
        for p in ps {
            c.args(["--prompt", p]);
        }
        // stdout and stderr together: drop the stats line.
        let text = run(&mut c);
        text.lines().filter(|l| !l.contains(" prompt tokens, prefill ")).collect::<Vec<_>>().join("\n")
    };
    let together = gen(&prompts);
    for (i, p) in prompts.iter().enumerate() {
        let alone = gen(&[p]);
        let head = format!("=== {} ===\n", i + 1);
        let start = together.find(&head).unwrap_or_else(|| panic!("no section {}:\n{together}", i + 1)) + head.len();
        let end = together[start..].find("\n=== ").map_or(together.len(), |e| start + e);
        assert_eq!(together[start..end].trim_end(), alone.trim_end(), "prompt {i} together vs alone");
    }
}

#[test]
fn prompt_longer_than_the_context_is_refused() {
    let Some(gguf) = teacher() else { return };
    let long = "word ".repeat(9000);
    let out = k3mini()
        .args(["generate", "--model"])
        .arg(&gguf)
        .args(["--prompt", &long, "--max-tokens", "1"])
        .output()
        .expect("spawn");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("context of 8192"), "{err}");
}
