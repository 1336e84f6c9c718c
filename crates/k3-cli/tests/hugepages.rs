//! The repacked weights' huge-page chunks (`k3_kernels::hugebuf`) over a model's life: a loaded
//! GGUF holds chunks, and once every model loaded is dropped none is left mapped (a thread that
//! kept its open chunk after a load, or a chunk that outlived its matrices, fails it); after a
//! load the weights are promoted onto huge pages. Its own
//! test binary, so that no other test's matrices hold chunks meanwhile. Pure Rust (the core tier).

mod common;

use common::{golden, k3mini, run, scratch};
use k3_infer::hugepages::{advise, huge_bytes, wait_promoted};
use k3_infer::{Logits, Model};
use k3_kernels::hugebuf::{enabled, mapped_bytes, HUGE};

#[test]
fn chunks_live_with_their_models_and_go_with_them() {
    let d = scratch("hugepages");
    let g = d.join("tiny-q4_0.gguf");
    run(k3mini().args(["quantize", "--model"]).arg(golden("tiny_k3")).args(["--type", "q4_0", "--out"]).arg(&g));
    let huge = cfg!(target_os = "linux") && enabled();
    assert_eq!(mapped_bytes(), 0, "chunks mapped before any load");
    let mut logits = Vec::new();
    for round in 0..3 {
        let (model, _) = Model::load(&g).expect("load");
        assert_eq!(mapped_bytes() > 0, huge, "round {round}: the loaded weights' chunks");
        let mut st = model.new_state();
        logits.push(model.forward(&[5, 9, 13], &mut st, Logits::Last).expect("forward"));
        drop(model);
        // Loaded on scoped threads and this one: every chunk goes with the model.
        assert_eq!(mapped_bytes(), 0, "round {round}: chunks left after the model was dropped");
    }
    assert!(logits.windows(2).all(|w| w[0] == w[1]), "the same logits from each load");
    // A load that fails part way (the last layer's FFN down projection renamed, so the layers
    // before it are repacked first) lets go of what it carved too.
    let mut bytes = std::fs::read(&g).expect("read");
    let name = b"ffn_down.weight";
    let at = bytes.windows(name.len()).rposition(|w| w == name).expect("a down projection");
    bytes[at + name.len() - 1] = b'x';
    let bad = d.join("renamed.gguf");
    std::fs::write(&bad, &bytes).expect("write");
    let err = Model::load(&bad).err().expect("a GGUF without a layer's down projection loads");
    assert!(format!("{err:#}").contains("ffn_down"), "{err:#}");
    assert_eq!(mapped_bytes(), 0, "chunks left after a failed load");

    // After a load the weights are promoted onto huge pages (by default on a thread of its own,
    // waited for here), where this system collapses pages at all: checked first on a buffer of
    // this test's own.
    let probe: Vec<u8> = vec![1; 3 * HUGE];
    let before = huge_bytes().unwrap_or(0);
    let collapses = huge && advise(probe.as_ptr(), probe.len(), true) > 0 && huge_bytes().unwrap_or(0) > before;
    if !collapses {
        eprintln!("skipped the promotion check: this system does not collapse pages into huge pages");
        return;
    }
    let before = huge_bytes().unwrap_or(0);
    let (model, _) = Model::load(&g).expect("load");
    wait_promoted();
    let after = huge_bytes().unwrap_or(0);
    assert!(after >= before + HUGE, "the loaded weights are not on huge pages: {before} -> {after} bytes");
    drop((model, probe));
}
