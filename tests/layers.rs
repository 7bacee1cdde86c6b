//! The modules are layered (see the crate docs in src/lib.rs): every
//! `crate::` path in a module names the module itself or one below it. This
//! reads src/ and fails on a path that runs back up, or on a module that is
//! not in the order below.

use std::fs;
use std::path::{Path, PathBuf};

/// The modules, lowest first. A module may use those before it.
const ORDER: &[&str] = &[
    // arithmetic, errors, msgpack, the host engine's thread pool
    "error",
    "checksum",
    "msgpack",
    "topology",
    // its unit tests (a file of their own)
    "topology_tests",
    "pool",
    // inputs: state layers, layouts, block sets, fingerprints, the caller's stream
    "state",
    "layout",
    "layout_string",
    "blocks",
    "fingerprint",
    "stream",
    // results
    "result",
    // the plan of a call
    "plan",
    // engines
    "host",
    "cuda",
    "detail",
    "stored",
    // the worker
    "worker",
    // records and payloads
    "record",
    "payload",
    // the verifier
    "verify",
    // the repair plan of a verifier's report
    "repair",
    // the C boundary
    "ffi",
];

/// The top-level module a file under src/ belongs to (`None` for lib.rs).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src).unwrap();
    let first = relative.components().next().unwrap().as_os_str().to_str().unwrap();
    match first.strip_suffix(".rs") {
        Some("lib") => None,
        Some(name) => Some(name.to_owned()),
        None => Some(first.to_owned()),
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules a line names through `crate::` or `$crate::`
/// (`crate::{a, b::c}` included); comments are skipped.
fn referenced(line: &str) -> Vec<String> {
    let code = line.split("//").next().unwrap();
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `kvcrate::`, not a crate path
        }
        if let Some(inner) = rest.strip_prefix('{') {
            // Top-level names inside the braces (nested braces skipped).
            let mut depth = 0;
            let mut word = String::new();
            let mut at_start = true;
            for c in inner.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => at_start = true,
                    c if depth == 0 && at_start && (c.is_alphanumeric() || c == '_') => word.push(c),
                    c if depth == 0 && at_start && !c.is_whitespace() => {
                        if !word.is_empty() {
                            names.push(std::mem::take(&mut word));
                        }
                        at_start = false;
                    }
                    _ => {}
                }
            }
            if !word.is_empty() {
                names.push(word);
            }
        } else {
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            names.push(name);
        }
    }
    names
}

#[test]
fn imports_run_down_the_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let rank = |name: &str| ORDER.iter().position(|m| *m == name);
    let mut problems = Vec::new();
    let mut modules_seen = 0;
    for file in &files {
        let Some(module) = module_of(&src, file) else { continue };
        modules_seen += 1;
        let Some(own) = rank(&module) else {
            problems.push(format!(
                "{}: module `{module}` is not in tests/layers.rs's ORDER; add it at its layer",
                file.display()
            ));
            continue;
        };
        let text = fs::read_to_string(file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for name in referenced(line) {
                // Crate-root re-exports (`crate::Result`) name no module.
                let Some(target) = rank(&name) else {
                    if name.chars().next().is_some_and(|c| c.is_lowercase()) {
                        problems.push(format!(
                            "{}:{}: `crate::{name}` is not a module in ORDER",
                            file.display(),
                            number + 1
                        ));
                    }
                    continue;
                };
                if target > own {
                    problems.push(format!(
                        "{}:{}: `{module}` uses `{name}`, which is above it in the layering: {}",
                        file.display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        modules_seen > 20,
        "read only {modules_seen} files under {}",
        src.display()
    );
    assert!(
        problems.is_empty(),
        "imports that run up the layers:\n{}",
        problems.join("\n")
    );
}

/// Crate-root paths (`crate::Result`) are re-exports of lower modules, but
/// hide which one; the engine names the module instead.
#[test]
fn no_module_uses_root_reexports_of_higher_layers() {
    // `crate::Result` is the only root path in use, and `error` is the bottom layer.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for name in referenced(line) {
                let upper = name.chars().next().is_some_and(|c| c.is_uppercase());
                assert!(
                    !upper || name == "Result" || name == "Error",
                    "{}:{}: `crate::{name}` hides which module it comes from; name the module",
                    file.display(),
                    number + 1
                );
            }
        }
    }
}

#[test]
fn the_scanner_finds_paths() {
    assert_eq!(referenced("use crate::layout::{Layout, Role};"), ["layout"]);
    assert_eq!(
        referenced("use crate::{blocks::BlockSet, plan::{Plan, Row}};"),
        ["blocks", "plan"]
    );
    assert_eq!(
        referenced("    $crate::ffi::status::fail(&$crate::error::Error::X)"),
        ["ffi", "error"]
    );
    assert_eq!(referenced("// use crate::worker::Worker;"), Vec::<String>::new());
    assert_eq!(referenced("let x = crate::record::Record::decode(b)?;"), ["record"]);
}
