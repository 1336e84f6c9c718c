//! `k3mini prompts`: code-task prompt sets from a dataset's own Python sources.

mod common;

use common::*;

#[test]
fn prompt_sets_come_from_the_requested_split_with_their_reference_bodies() {
    let d = scratch("prompts");
    let src = d.join("src");
    std::fs::create_dir_all(&src).expect("src");
    std::fs::write(
        src.join("geometry.py"),
        "def area(w, h):\n    \"\"\"Area of a w x h box.\"\"\"\n    a = w * h\n    return a\n\n\
         def perimeter(w, h):\n    s = w + h\n    return 2 * s\n",
    )
    .expect("py");
    std::fs::write(src.join("notes.txt"), "not python: def nothing(x):\n    pass\n    pass\n").expect("txt");
    let ds = d.join("ds");
    run(k3mini()
        .args(["data", "build", "--tokenizer", "bpe:300", "--val-permille", "0", "--out"])
        .arg(&ds)
        .arg("--source")
        .arg(format!("dir:{}", src.display())));
    let out = d.join("p.jsonl");
    let text = run(k3mini().args(["prompts", "--split", "train", "--data"]).arg(&ds).arg("--out").arg(&out));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .expect("prompts")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    // area: docstring + signature; perimeter: signature only; the .txt file is not Python.
    assert_eq!(lines.len(), 3, "{text}\n{lines:?}");
    assert_eq!(lines[0]["kind"], "docstring");
    assert_eq!(lines[0]["prompt"], "def area(w, h):\n    \"\"\"Area of a w x h box.\"\"\"\n");
    assert_eq!(lines[0]["reference"], "    a = w * h\n    return a\n");
    assert_eq!(lines[2]["prompt"], "def perimeter(w, h):\n");
    // The held-out split of this dataset is empty: the error says so.
    let e =
        k3mini().args(["prompts", "--split", "val", "--data"]).arg(&ds).arg("--out").arg(&out).output().expect("spawn");
    assert!(!e.status.success() && String::from_utf8_lossy(&e.stderr).contains("val split"));
}
