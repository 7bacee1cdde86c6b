//! Every C call of `include/kvcsum.h` is called by the C++ wrapper
//! (`include/kvcsum.hpp`) and by the Python package (`python/kvcsum/`):
//! every call has a binding in each language. A call added to the header without a binding fails here,
//! naming it.
//!
//! What counts as a call: in the C++ header, the call's name in code (not
//! in a comment or a string); in Python, an attribute access `.kvcs_<call>`
//! in code (not in a comment or a docstring), since the package calls
//! through its loaded library object; a name that appears only as a key of
//! a signature table is declared, not called. The one exception is the
//! short allow-list `CALLED_BY_NAME`: calls a binding looks up by a string
//! (`getattr(lib, name)`), which count where that string is in its code.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Which binding an allow-list entry is for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Binding {
    Python,
}

/// Calls a binding reaches through their name in a string rather than an
/// attribute access: (binding, `prefix*suffix` pattern, where and why). A
/// call matching a pattern counts as called only where its full name is a
/// string literal in that binding's code. Keep it short.
const CALLED_BY_NAME: &[(Binding, &str, &str)] = &[
    (
        Binding::Python,
        "kvcs_*_destroy",
        "the shared handle base class calls getattr(lib, self._destroy), each handle class naming its call",
    ),
    (
        Binding::Python,
        "kvcs_tier_index_*",
        "kvcsum._tier declares the store and check a second time from the loaded library by name (cdll[name]), \
         taking plain addresses for a decode step's hot call",
    ),
    (
        Binding::Python,
        "kvcs_*_size",
        "_lib's layout check calls getattr(api, f\"{c_name}_size\")() for each struct that has one, the names \
         being keys of the generated _abi.CALLS",
    ),
];

/// Deprecated calls, kept in the ABI, whose replacement the bindings call
/// instead: (call, replacement). A deprecated call counts as wrapped where
/// its replacement is called, and its header doc comment must say
/// "Deprecated" and name the replacement.
const DEPRECATED: &[(&str, &str)] = &[
    ("kvcs_result_column", "kvcs_result_column_buf"),
    ("kvcs_result_stored", "kvcs_result_stored_buf"),
    ("kvcs_result_entries", "kvcs_result_entries_buf"),
    ("kvcs_result_check_entries", "kvcs_result_check_entries_buf"),
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

/// Whether `call` matches a `prefix*suffix` pattern (or equals a plain one).
fn matches(pattern: &str, call: &str) -> bool {
    match pattern.split_once('*') {
        Some((prefix, suffix)) => {
            call.len() >= prefix.len() + suffix.len() && call.starts_with(prefix) && call.ends_with(suffix)
        }
        None => call == pattern,
    }
}

/// The calls of `CALLED_BY_NAME` entries of `binding` whose names are
/// string literals in `code` (single or double quotes); fails on an entry
/// that matches none of them (a stale entry).
fn called_by_name(binding: Binding, code: &str) -> BTreeSet<String> {
    let quoted = kvcs_identifiers(code, |bytes, start, end| {
        start > 0
            && end < bytes.len()
            && (bytes[start - 1] == b'"' || bytes[start - 1] == b'\'')
            && bytes[end] == bytes[start - 1]
    });
    let mut called = BTreeSet::new();
    for &(entry_binding, pattern, _) in CALLED_BY_NAME.iter().filter(|entry| entry.0 == binding) {
        let named: Vec<&String> = quoted.iter().filter(|name| matches(pattern, name)).collect();
        assert!(
            !named.is_empty(),
            "CALLED_BY_NAME entry {pattern} ({entry_binding:?}) names no call: remove it"
        );
        called.extend(named.into_iter().cloned());
    }
    called
}

/// Fails naming every header call that `called` lacks.
fn check_binding(what: &str, called: &BTreeSet<String>) {
    let mut called = called.clone();
    for &(call, replacement) in DEPRECATED {
        if called.contains(replacement) {
            called.insert(call.to_string());
        }
    }
    let called = &called;
    let calls = header_calls();
    assert!(
        calls.len() >= 80,
        "found only {} calls in include/kvcsum.h: the parser is broken",
        calls.len()
    );
    let missing: Vec<&str> = calls
        .iter()
        .filter(|call| !called.contains(*call))
        .map(String::as_str)
        .collect();
    println!(
        "{what}: calls {} of the header's {} C calls",
        calls.len() - missing.len(),
        calls.len()
    );
    assert!(
        missing.is_empty(),
        "{what} does not call {} of the header's {} C calls (wrap them; a call looked up by a name in a string \
         may be added to CALLED_BY_NAME in tests/it/bindings_coverage.rs, with why):\n  {}",
        missing.len(),
        calls.len(),
        missing.join("\n  ")
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
    let by_name = called_by_name(
        Binding::Python,
        "_destroy = \"kvcs_blocks_destroy\"\nSIZES = {'kvcs_layer_size': L, \"kvcs_add\": 1}\nkvcs_state_size\n\
         _raw(\"kvcs_tier_index_store\", ARGS)",
    );
    assert_eq!(
        by_name.into_iter().collect::<Vec<_>>(),
        ["kvcs_blocks_destroy", "kvcs_layer_size", "kvcs_tier_index_store"]
    );
    assert_eq!(
        python_code("x = 1  # lib.kvcs_a()\n\"\"\"lib.kvcs_b()\"\"\"\nlib.kvcs_c()"),
        "x = 1  \n\nlib.kvcs_c()"
    );
}

#[test]
fn kvcsum_hpp_calls_every_c_call() {
    let code = c_code(&read(&root().join("include/kvcsum.hpp")));
    let called = kvcs_identifiers(&code, |_, _, _| true);
    check_binding("include/kvcsum.hpp", &called);
}

#[test]
fn the_python_package_calls_every_c_call() {
    let mut files = Vec::new();
    python_files(&root().join("python/kvcsum"), &mut files);
    assert!(!files.is_empty(), "no Python files under python/kvcsum");
    let mut code = String::new();
    for file in &files {
        code.push_str(&python_code(&read(file)));
        code.push('\n');
    }
    let mut called = kvcs_identifiers(&code, |bytes, start, _| start > 0 && bytes[start - 1] == b'.');
    called.extend(called_by_name(Binding::Python, &code));
    check_binding("python/kvcsum", &called);
}

/// Each deprecated call is still in the header (the ABI keeps it), its doc
/// comment says so and names its replacement, which is a call too.
#[test]
fn deprecated_calls_are_kept_and_marked() {
    let header = read(&root().join("include/kvcsum.h"));
    let calls = header_calls();
    for &(call, replacement) in DEPRECATED {
        assert!(
            calls.contains(call),
            "{call} is deprecated but no longer in the header (ABI 2 keeps it)"
        );
        assert!(
            calls.contains(replacement),
            "{call}'s replacement {replacement} is not a header call"
        );
        // The doc comment is the block of `//` lines right above the prototype.
        let at = header
            .find(&format!(" {call}("))
            .unwrap_or_else(|| panic!("{call}'s prototype not found"));
        let line_start = header[..at].rfind('\n').map_or(0, |i| i + 1);
        let doc: Vec<&str> = header[..line_start]
            .lines()
            .rev()
            .take_while(|line| line.trim_start().starts_with("//"))
            .collect();
        let doc = doc.into_iter().rev().collect::<Vec<_>>().join("\n");
        assert!(
            doc.contains("Deprecated") && doc.contains(replacement),
            "{call}'s doc comment does not say Deprecated and name {replacement}:\n{doc}"
        );
    }
}
