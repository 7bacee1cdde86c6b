//! Every C call of `include/kvcsum.h` is called by the C++ wrapper
//! (`include/kvcsum.hpp`) and by the Python package (`python/kvcsum/`),
//! unless an entry of `NOT_CALLED` below says why not (issue 22). A call
//! added to the header without a binding fails here, naming it.
//!
//! What counts as a call: in the C++ header, the call's name in code (not
//! in a comment); in Python, an attribute access `.kvcs_<call>` in code (not
//! in a comment or a docstring), since the package calls through its loaded
//! library object, and a name that appears only as a key of a signature
//! table is declared, not called.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Which binding an allow-list entry is for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Binding {
    Cpp,
    Python,
}

/// Calls a binding need not call: (binding, call or `prefix*suffix`
/// pattern, why). Keep it short: every entry is a call users of that
/// binding cannot reach.
const NOT_CALLED: &[(Binding, &str, &str)] = &[
    (
        Binding::Python,
        "kvcs_*_destroy",
        "called by name (getattr) from each handle class's _destroy attribute, by the shared owner base class",
    ),
    (
    Binding::Python,
    "kvcs_*_size",
    "called by name (getattr) over _lib.STRUCT_SIZES when the library is loaded, each compared with its ctypes struct",
    ),
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()))
}

fn is_identifier_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// C or C++ source without its `//` and `/* */` comments and without the
/// text of its string and character literals (which could hold a name).
fn c_code(source: &str) -> String {
    let bytes = source.as_bytes();
    let mut code = String::with_capacity(source.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i..].starts_with(b"//") {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if bytes[i..].starts_with(b"/*") {
            i += 2;
            while i < bytes.len() && !bytes[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
            code.push(' ');
        } else if bytes[i] == b'"' || bytes[i] == b'\'' {
            let quote = bytes[i];
            i += 1;
            while i < bytes.len() && bytes[i] != quote {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            code.push_str("\"\"");
        } else {
            code.push(bytes[i] as char);
            i += 1;
        }
    }
    code
}

/// Python source without comments and triple-quoted strings (docstrings).
fn python_code(source: &str) -> String {
    let mut code = String::with_capacity(source.len());
    let mut rest = source;
    loop {
        let next_triple = ["\"\"\"", "'''"]
            .iter()
            .filter_map(|q| rest.find(q).map(|at| (at, *q)))
            .min();
        let Some((at, quote)) = next_triple else {
            code.push_str(rest);
            break;
        };
        code.push_str(&rest[..at]);
        let after = &rest[at + 3..];
        rest = match after.find(quote) {
            Some(end) => &after[end + 3..],
            None => "",
        };
    }
    code.lines()
        .map(|line| match line.find('#') {
            // A '#' inside a one-line string is rare in this package; cutting
            // there can only hide a call, so it cannot pass a missing one.
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Identifiers starting with `kvcs_` in `code` for which `keep(code,
/// start, end)` holds.
fn kvcs_identifiers(code: &str, keep: impl Fn(&[u8], usize, usize) -> bool) -> BTreeSet<String> {
    let bytes = code.as_bytes();
    let mut found = BTreeSet::new();
    let mut i = 0;
    while let Some(offset) = code[i..].find("kvcs_") {
        let start = i + offset;
        let mut end = start;
        while end < bytes.len() && is_identifier_byte(bytes[end]) {
            end += 1;
        }
        if (start == 0 || !is_identifier_byte(bytes[start - 1])) && keep(bytes, start, end) {
            found.insert(code[start..end].to_string());
        }
        i = end;
    }
    found
}

/// The calls the C header declares: a `kvcs_` name followed by `(` in code,
/// unless a `*` follows (the return type of a function-pointer typedef).
fn header_calls() -> BTreeSet<String> {
    let code = c_code(&read(&root().join("include/kvcsum.h")));
    kvcs_identifiers(&code, |bytes, _, end| {
        let mut next = bytes[end..].iter().copied().filter(|byte| !byte.is_ascii_whitespace());
        // `kvcs_status (*kvcs_<call>_fn)(...)` is a typedef's return type.
        next.next() == Some(b'(') && next.next() != Some(b'*')
    })
}

fn python_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|error| panic!("cannot list {}: {error}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            python_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "py") {
            out.push(path);
        }
    }
}

fn allowed(binding: Binding, call: &str) -> bool {
    NOT_CALLED.iter().any(|&(entry_binding, pattern, _)| {
        entry_binding == binding
            && match pattern.split_once('*') {
                Some((prefix, suffix)) => {
                    call.len() >= prefix.len() + suffix.len() && call.starts_with(prefix) && call.ends_with(suffix)
                }
                None => call == pattern,
            }
    })
}

/// Fails naming every header call that `called` lacks and the allow-list
/// does not excuse, and every allow-list entry of `binding` that excuses
/// nothing (a stale entry).
fn check_binding(binding: Binding, what: &str, called: &BTreeSet<String>) {
    let calls = header_calls();
    assert!(
        calls.len() >= 80,
        "found only {} calls in include/kvcsum.h: the parser is broken",
        calls.len()
    );
    let missing: Vec<&String> = calls
        .iter()
        .filter(|call| !called.contains(*call) && !allowed(binding, call))
        .collect();
    let stale: Vec<&str> = NOT_CALLED
        .iter()
        .filter(|(entry_binding, pattern, _)| {
            *entry_binding == binding
                && !calls.iter().any(|call| {
                    !called.contains(call) && allowed(binding, call) && {
                        let (prefix, suffix) = pattern.split_once('*').unwrap_or((pattern, ""));
                        call.starts_with(prefix) && call.ends_with(suffix)
                    }
                })
        })
        .map(|(_, pattern, _)| *pattern)
        .collect();
    let wrapped = calls.iter().filter(|call| called.contains(*call)).count();
    println!("{what}: calls {wrapped} of the header's {} C calls", calls.len());
    assert!(
        missing.is_empty(),
        "{what} does not call {} of the header's {} C calls (wrap them, or add an entry with a reason to \
         NOT_CALLED in tests/bindings_coverage.rs):\n  {}",
        missing.len(),
        calls.len(),
        missing
            .iter()
            .map(|call| call.as_str())
            .collect::<Vec<_>>()
            .join("\n  ")
    );
    assert!(
        stale.is_empty(),
        "NOT_CALLED entries for {what} that excuse no uncalled call: {stale:?}"
    );
}

#[test]
fn the_header_parser_finds_known_calls_and_no_types() {
    let calls = header_calls();
    for call in [
        "kvcs_worker_create",
        "kvcs_last_error",
        "kvcs_report_mismatch",
        "kvcs_verifier_check_stored",
    ] {
        assert!(calls.contains(call), "{call} not found among the header's calls");
    }
    for not_call in ["kvcs_worker", "kvcs_status", "kvcs_worker_create_fn", "kvcs_layer"] {
        assert!(!calls.contains(not_call), "{not_call} taken for a call");
    }
    assert!(!c_code("a /* kvcs_x( */ b // kvcs_y(\n\"kvcs_z(\"").contains("kvcs_"));
    assert_eq!(
        python_code("x = 1  # lib.kvcs_a()\n\"\"\"lib.kvcs_b()\"\"\"\nlib.kvcs_c()"),
        "x = 1  \n\nlib.kvcs_c()"
    );
}

#[test]
fn kvcsum_hpp_calls_every_c_call() {
    let code = c_code(&read(&root().join("include/kvcsum.hpp")));
    let called = kvcs_identifiers(&code, |_, _, _| true);
    check_binding(Binding::Cpp, "include/kvcsum.hpp", &called);
}

#[test]
fn the_python_package_calls_every_c_call() {
    let mut files = Vec::new();
    python_files(&root().join("python/kvcsum"), &mut files);
    assert!(!files.is_empty(), "no Python files under python/kvcsum");
    let mut called = BTreeSet::new();
    for file in &files {
        let code = python_code(&read(file));
        called.extend(kvcs_identifiers(&code, |bytes, start, _| {
            start > 0 && bytes[start - 1] == b'.'
        }));
    }
    check_binding(Binding::Python, "python/kvcsum", &called);
}
