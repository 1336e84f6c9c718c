//! Code-task prompts cut from Python sources (distillation's prompt sets): *docstring → body*
//! (the signature and docstring; the teacher or student writes the body) and *signature →
//! implementation* (the signature alone). The original body is kept as the reference.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptKind {
    Docstring,
    Signature,
}

/// One prompt line of a prompts JSONL file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodePrompt {
    pub prompt: String,
    /// The body the source had (not shown to the model).
    pub reference: String,
    pub kind: PromptKind,
    /// Where it was cut from (`origin:line`).
    pub origin: String,
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

fn is_def(line: &str) -> bool {
    let t = line.trim_start();
    let t = t.strip_prefix("async ").unwrap_or(t);
    t.starts_with("def ") && t.contains('(')
}

/// Lines of `lines[from..]` re-indented by removing `by` leading columns.
fn dedent(lines: &[&str], by: usize) -> String {
    let mut s = String::new();
    for l in lines {
        s.push_str(if l.len() >= by && l[..by].trim().is_empty() { &l[by..] } else { l.trim_start() });
        s.push('\n');
    }
    s
}

/// Every function of `text` with a body of 2..=`max_body` lines, as the prompts of `kinds`.
pub fn python_functions(text: &str, origin: &str, kinds: &[PromptKind], max_body: usize) -> Vec<CodePrompt> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if !is_def(lines[i]) {
            i += 1;
            continue;
        }
        let base = indent(lines[i]);
        // The signature runs until its parentheses close on a line ending in ':'.
        let (mut j, mut depth) = (i, 0i32);
        let mut ok = false;
        while j < lines.len() && j < i + 12 {
            depth += lines[j].matches('(').count() as i32 - lines[j].matches(')').count() as i32;
            if depth <= 0 && lines[j].trim_end().ends_with(':') {
                ok = true;
                break;
            }
            j += 1;
        }
        if !ok {
            i += 1;
            continue;
        }
        let sig_end = j + 1;
        let mut end = sig_end;
        while end < lines.len() && (lines[end].trim().is_empty() || indent(lines[end]) > base) {
            end += 1;
        }
        while end > sig_end && lines[end - 1].trim().is_empty() {
            end -= 1;
        }
        let body = &lines[sig_end..end];
        // A docstring opens the body with triple quotes and closes on the same or a later line.
        let first = body.first().map_or("", |l| l.trim_start());
        let quote = ["\"\"\"", "'''", "r\"\"\"", "r'''"].into_iter().find(|q| first.starts_with(q));
        let doc_end = quote.and_then(|q| {
            let q = q.trim_start_matches('r');
            let rest = &first[first.find(q).map_or(0, |p| p + 3)..];
            if rest.contains(q) {
                Some(1)
            } else {
                body.iter().skip(1).position(|l| l.contains(q)).map(|p| p + 2)
            }
        });
        let at = format!("{origin}:{}", i + 1);
        let code = &body[doc_end.unwrap_or(0)..];
        let code_lines = code.iter().filter(|l| !l.trim().is_empty()).count();
        if (2..=max_body).contains(&code_lines) {
            let sig = dedent(&lines[i..sig_end], base);
            let reference = dedent(code, base);
            if let (Some(d), true) = (doc_end, kinds.contains(&PromptKind::Docstring)) {
                let prompt = format!("{sig}{}", dedent(&body[..d], base));
                out.push(CodePrompt {
                    prompt,
                    reference: reference.clone(),
                    kind: PromptKind::Docstring,
                    origin: at.clone(),
                });
            }
            if kinds.contains(&PromptKind::Signature) {
                out.push(CodePrompt { prompt: sig, reference, kind: PromptKind::Signature, origin: at });
            }
        }
        i = sig_end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str = "import os\n\nclass A:\n    def area(self, w,\n             h):\n        \"\"\"The area.\n\n        Of a box.\n        \"\"\"\n        x = w * h\n        return x\n\n    def one(self):\n        return 1\n\ndef add(a, b):\n    '''Add.'''\n    c = a + b\n    return c\n";

    #[test]
    fn cuts_docstring_and_signature_prompts_with_their_bodies() {
        let p = python_functions(SRC, "m.py", &[PromptKind::Docstring, PromptKind::Signature], 40);
        // `one` has a one-line body and is skipped.
        assert_eq!(p.len(), 4, "{p:#?}");
        assert_eq!(p[0].kind, PromptKind::Docstring);
        assert_eq!(p[0].prompt, "def area(self, w,\n         h):\n    \"\"\"The area.\n\n    Of a box.\n    \"\"\"\n");
        assert_eq!(p[0].reference, "    x = w * h\n    return x\n");
        assert_eq!(p[0].origin, "m.py:4");
        assert_eq!(p[1].prompt, "def area(self, w,\n         h):\n");
        assert_eq!(p[2].prompt, "def add(a, b):\n    '''Add.'''\n");
        assert_eq!(p[3].reference, "    c = a + b\n    return c\n");
        let only_sig = python_functions(SRC, "m.py", &[PromptKind::Signature], 1);
        assert!(only_sig.is_empty(), "bodies longer than max_body are skipped");
    }
}
