//! Checkpoint loading against checkpoints that transformers 5.24 wrote (tests/golden/), and the
//! errors for broken ones.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use k3_format::{save_checkpoint, tensor_specs, Checkpoint};

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(name)
}

/// A scratch directory, removed when dropped.
fn scratch(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("k3ck-{tag}-")).tempdir().expect("scratch dir")
}

#[test]
fn transformers_saved_checkpoints_load_completely() {
    for tag in ["dense", "moe", "moe_grouped"] {
        let ck = Checkpoint::open(&golden(&format!("tiny_kimi_linear_{tag}"))).expect("open");
        // transformers writes dense layers as block_sparse_moe.* and A_log as [1,1,H,1]: both accepted.
        let all = ck.read_all().expect("read_all");
        assert_eq!(all.len(), tensor_specs(&ck.config).len());
        assert!(ck.warnings.iter().all(|w| !w.contains("not used")), "{tag}: {:?}", ck.warnings);
    }
}

fn copy_fixture(tag: &str) -> tempfile::TempDir {
    let src = golden("tiny_kimi_linear_dense");
    let dst = scratch(tag);
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dst.path().join(f)).expect("copy");
    }
    dst
}

#[test]
fn broken_checkpoints_get_errors_naming_file_and_tensor() {
    // wrong shape: rewrite with a config that expects a larger vocab
    let tmp = copy_fixture("shape");
    let d = tmp.path();
    let cfg = std::fs::read_to_string(d.join("config.json")).expect("read");
    std::fs::write(d.join("config.json"), cfg.replace("\"vocab_size\": 256", "\"vocab_size\": 300")).expect("write");
    let ck = Checkpoint::open(d).expect("open");
    let err = ck.read_all().expect_err("shape error").to_string();
    assert!(
        err.contains("model.embed_tokens.weight") && err.contains("[300, 64]") && err.contains("model.safetensors"),
        "{err}"
    );

    // missing tensor: a config with one more layer
    let tmp = copy_fixture("missing");
    let d = tmp.path();
    let cfg = std::fs::read_to_string(d.join("config.json")).expect("read");
    let cfg = cfg
        .replace("\"num_hidden_layers\": 4", "\"num_hidden_layers\": 5")
        .replace("\"full_attention\"\n  ]", "\"full_attention\",\n \"linear_attention\"\n  ]")
        .replace("\"dense\"\n  ]", "\"dense\",\n \"dense\"\n  ]");
    std::fs::write(d.join("config.json"), cfg).expect("write");
    let ck = Checkpoint::open(d).expect("open");
    let err = ck.read_all().expect_err("missing error").to_string();
    assert!(err.contains("model.layers.4.") && err.contains("missing tensor"), "{err}");

    // truncated safetensors
    let tmp = copy_fixture("trunc");
    let d = tmp.path();
    let bytes = std::fs::read(d.join("model.safetensors")).expect("read");
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).expect("write");
    let err = Checkpoint::open(d).err().expect("truncated").to_string();
    assert!(err.contains("model.safetensors") && err.contains("truncated"), "{err}");

    // missing config.json / not a directory
    std::fs::remove_file(d.join("config.json")).expect("rm");
    let err = Checkpoint::open(d).err().expect("no config").to_string();
    assert!(err.contains("config.json"), "{err}");
    let err = Checkpoint::open(Path::new("/nonexistent/ckpt")).err().expect("no dir").to_string();
    assert!(err.contains("/nonexistent/ckpt"), "{err}");
}

#[test]
fn save_then_open_is_bit_exact_and_sharded_index_loads() {
    let src = Checkpoint::open(&golden("tiny_kimi_linear_moe")).expect("open");
    let tensors: HashMap<String, Vec<f32>> =
        src.read_all().expect("read").into_iter().map(|(s, d)| (s.name, d)).collect();
    let tmp = scratch("save");
    let d = tmp.path();
    save_checkpoint(d, &src.config, tensors.clone()).expect("save");
    let back = Checkpoint::open(d).expect("reopen");
    assert_eq!(back.config, src.config);
    for (s, data) in back.read_all().expect("read") {
        let a = &tensors[&s.name];
        assert!(a.iter().zip(&data).all(|(x, y)| x.to_bits() == y.to_bits()), "{}", s.name);
    }
    // Split into two shards with an index file, as large HF checkpoints are.
    let specs = tensor_specs(&src.config);
    let (first, second) = specs.split_at(specs.len() / 2);
    let shard = |part: &[k3_format::TensorSpec], file: &str| {
        let t: Vec<_> = part
            .iter()
            .map(|s| {
                (s.name.clone(), s.shape.clone(), k3_format::safetensors_io::OwnedData::F32(tensors[&s.name].clone()))
            })
            .collect();
        k3_format::write_safetensors(&d.join(file), &t, None).expect("shard");
    };
    std::fs::remove_file(d.join("model.safetensors")).expect("rm");
    shard(first, "model-00001-of-00002.safetensors");
    shard(second, "model-00002-of-00002.safetensors");
    let map: serde_json::Map<String, serde_json::Value> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let f =
                if i < first.len() { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" };
            (s.name.clone(), serde_json::Value::String(f.into()))
        })
        .collect();
    std::fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .expect("index");
    let sharded = Checkpoint::open(d).expect("sharded open");
    assert_eq!(sharded.read_all().expect("read").len(), specs.len());
}
