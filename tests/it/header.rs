//! The checked-in bindings must be what their generators make now:
//! `include/kvcsum.h` (cbindgen, with the prototypes put under
//! `KVCS_NO_PROTOTYPES`), and what `header_gen::bindings` makes from src/ffi
//! (src/ffi/generated/, src/ffi/api-slots.txt, python/kvcsum/_abi.py and
//! _enums.py). These only check; `make header` regenerates them all
//! (tools/bindgen, which writes what `header_gen` makes).

use crate::header_gen;

use std::path::Path;

#[test]
fn header_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let generated = header_gen::generated_header(root);
    let checked_in = std::fs::read(root.join("include/kvcsum.h")).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/kvcsum.h is stale: run `make header` and commit it"
    );
}

/// The function-pointer types, the function table, its slots, the struct
/// layouts and the Python ABI and enum modules are what
/// tests/it/header_gen/bindings.rs makes from src/ffi now. A new call,
/// struct, enum or constant without them fails here.
#[test]
fn generated_bindings_are_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bindings = header_gen::bindings::generated_bindings(root).unwrap_or_else(|problem| panic!("{problem}"));
    let mut stale = Vec::new();
    for (relative, generated) in bindings {
        let checked_in = std::fs::read_to_string(root.join(relative)).unwrap_or_default();
        if checked_in != generated {
            let (number, (want, have)) = generated
                .lines()
                .chain(std::iter::repeat(""))
                .zip(checked_in.lines().chain(std::iter::repeat("")))
                .enumerate()
                .find(|(_, (want, have))| want != have)
                .unwrap_or((0, ("", "")));
            stale.push(format!(
                "{relative}:{}: generated `{want}`, checked in `{have}`",
                number + 1
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "generated bindings are stale (run `make header` and commit):\n{}",
        stale.join("\n")
    );
}

/// Each entry of the function table keeps its slot: the header's `kvcs_api`
/// lists src/ffi/api-slots.txt in order after its size and version, and
/// every call of the header but the entry point has a slot.
#[test]
fn the_function_table_keeps_its_slots() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = std::fs::read_to_string(root.join("include/kvcsum.h")).unwrap();
    let slots: Vec<String> = std::fs::read_to_string(root.join("src/ffi/api-slots.txt"))
        .unwrap()
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .enumerate()
        .map(|(index, line)| {
            let (slot, name) = line.split_once(' ').expect("`<slot> <call>`");
            assert_eq!(
                slot.parse::<usize>().ok(),
                Some(index),
                "api-slots.txt: {line} is out of sequence"
            );
            name.to_owned()
        })
        .collect();
    let end = header.find("} kvcs_api;").expect("kvcs_api in the header");
    let body = &header[header[..end].rfind("typedef struct {").expect("start of kvcs_api")..end];
    let entries: Vec<String> = body
        .lines()
        .map(str::trim)
        .filter(|line| !line.starts_with("//"))
        .filter_map(|line| line.strip_suffix(';'))
        .map(|declaration| declaration.rsplit(' ').next().unwrap().to_owned())
        .collect();
    assert_eq!(entries[..2], ["size", "abi_version"]);
    assert_eq!(
        entries[2..],
        slots[..],
        "kvcs_api's entries moved away from src/ffi/api-slots.txt"
    );
    let mut calls: Vec<String> = prototypes(&header)
        .into_iter()
        .filter(|c| c != "kvcs_api_get")
        .collect();
    let mut listed = slots.clone();
    calls.sort();
    listed.sort();
    assert_eq!(calls, listed, "the header's calls and the table's entries differ");
}

/// The names of the functions the header declares.
fn prototypes(header: &str) -> Vec<String> {
    header
        .lines()
        .filter(|line| !line.starts_with([' ', '#', '/']) && !line.starts_with("typedef"))
        .filter_map(|line| line.split_once('(').map(|(head, _)| head))
        .filter_map(|head| head.rsplit([' ', '*']).next())
        .filter(|name| name.starts_with("kvcs_"))
        .map(str::to_owned)
        .collect()
}

/// C and standard-header names the header may use besides its own.
const STANDARD: &[&str] = &[
    "const",
    "void",
    "char",
    "int",
    "unsigned",
    "signed",
    "long",
    "short",
    "bool",
    "enum",
    "struct",
    "union",
    "typedef",
    "extern",
    "uint8_t",
    "uint16_t",
    "uint32_t",
    "uint64_t",
    "int8_t",
    "int16_t",
    "int32_t",
    "int64_t",
    "size_t",
    "uintptr_t",
    "UINT32_MAX",
    "UINT64_MAX",
];

/// The names a C header declares at file scope (macros, tags, typedefs,
/// enumerators, functions), in order. Field and parameter names are not
/// among them: they live in their struct's or prototype's scope.
fn file_scope_names(header: &str) -> Vec<String> {
    // Comments and string literals out.
    let mut text = String::new();
    let mut rest = header;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |end| &after[end..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |end| &after[end + 2..]);
        } else if let Some(after) = rest.strip_prefix('"') {
            rest = after.find('"').map_or("", |end| &after[end + 1..]);
            text.push_str("\"\"");
        } else {
            let c = rest.chars().next().unwrap();
            text.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    let mut names = Vec::new();
    let mut code = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(directive) = trimmed.strip_prefix('#') {
            // Only #define declares a name; #if/#include/... use them.
            let mut words = directive.split_whitespace();
            if words.next() == Some("define") {
                let name: String = words
                    .next()
                    .unwrap_or("")
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                names.push(name);
            }
        } else {
            code.push_str(line);
            code.push('\n');
        }
    }
    // Scopes: file scope (and extern "C" blocks), enum bodies (their
    // enumerators are file-scope names), struct bodies and parentheses (not).
    #[derive(PartialEq)]
    enum Scope {
        File,
        Enum,
        Other,
    }
    let mut scopes = vec![Scope::File];
    let mut parens = 0usize;
    let mut previous = Vec::<String>::new();
    let mut chars = code.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_alphabetic() || c == '_' {
            let mut word = String::from(c);
            while let Some(&next) = chars.peek() {
                if next.is_alphanumeric() || next == '_' {
                    word.push(next);
                    chars.next();
                } else {
                    break;
                }
            }
            let in_file = parens == 0 && scopes.last() != Some(&Scope::Other);
            if in_file && !STANDARD.contains(&word.as_str()) {
                names.push(word.clone());
            }
            previous.push(word);
            continue;
        }
        match c {
            '(' => parens += 1,
            ')' => parens = parens.saturating_sub(1),
            '{' => {
                let scope = if previous.last().is_some_and(|w| w == "extern") {
                    Scope::File
                } else if previous.iter().any(|w| w == "enum") {
                    Scope::Enum
                } else {
                    Scope::Other
                };
                scopes.push(scope);
            }
            '}' => {
                scopes.pop();
            }
            ';' => previous.clear(),
            '"' => {} // extern "C": the literal was emptied above
            _ => {}
        }
        if c == '{' || c == '}' {
            previous.clear();
        }
    }
    names
}

/// The names of `header` that lack the kvcs_/KVCS_ prefix (the include guard allowed).
fn unprefixed(header: &str) -> Vec<String> {
    let mut bad: Vec<String> = file_scope_names(header)
        .into_iter()
        .filter(|name| !(name.starts_with("kvcs_") || name.starts_with("KVCS_") || name == "KVCSUM_H"))
        .collect();
    bad.dedup();
    bad
}

/// Every name the header declares is prefixed, so that it cannot clash with
/// an engine's own macros and types (a C++ engine with a `BATCH` macro).
#[test]
fn header_names_are_prefixed() {
    let header = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/kvcsum.h")).unwrap();
    let names = file_scope_names(&header);
    for expected in [
        "KVCS_ABI_VERSION",
        "kvcs_status",
        "KVCS_ERR_NOT_FOUND",
        "kvcs_worker_create",
        "kvcs_segment",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} not found among {names:?}"
        );
    }
    let bad = unprefixed(&header);
    assert!(
        bad.is_empty(),
        "include/kvcsum.h declares names without the kvcs_/KVCS_ prefix: {bad:?}"
    );
}

#[test]
fn the_name_check_finds_unprefixed_names() {
    let sample = r#"
#ifndef KVCSUM_H
#define KVCSUM_H
#include <stdint.h>
#define BATCH 4 // a comment naming OTHER
enum kvcs_role { KVCS_ROLE_PRODUCER = 0, ROLE_CONSUMER = 1 };
typedef struct kvcs_segment { uint64_t address; uint32_t count; } segment_t;
typedef struct worker worker;
#ifdef __cplusplus
extern "C" {
#endif
kvcs_status kvcs_worker_create(const struct kvcs_segment *options, uint32_t n);
const char *last_error(void);
#ifdef __cplusplus
}
#endif
#endif
"#;
    assert_eq!(
        unprefixed(sample),
        ["BATCH", "ROLE_CONSUMER", "segment_t", "worker", "last_error"]
    );
}

/// The C functions of the header that return a `kvcs_status`.
fn fallible_functions(header: &str) -> Vec<String> {
    header
        .lines()
        .filter_map(|line| line.strip_prefix("kvcs_status "))
        .filter_map(|rest| rest.split_once('(').map(|(name, _)| name.trim().to_owned()))
        .filter(|name| name.starts_with("kvcs_"))
        .collect()
}

/// Every fallible C call has at least one error path tested from C
/// (`EXPECT(kvcs_call(...), KVCS_ERR_..., ...)` in tests/c), so that the
/// C tests follow the header as it grows.
#[test]
fn every_fallible_call_has_an_error_test_in_c() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = std::fs::read_to_string(root.join("include/kvcsum.h")).unwrap();
    let functions = fallible_functions(&header);
    assert!(functions.len() > 30, "found only {functions:?}");
    let mut sources = String::new();
    for entry in std::fs::read_dir(root.join("tests/c")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "c") {
            sources += &std::fs::read_to_string(&path).unwrap();
        }
    }
    // The first argument of each EXPECT(...) whose expected status is an error.
    let mut tested = std::collections::BTreeSet::new();
    for (at, _) in sources.match_indices("EXPECT(") {
        let rest = &sources[at + "EXPECT(".len()..];
        let statement = &rest[..rest.find(';').unwrap_or(rest.len())];
        let name: String = statement
            .trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if statement.contains("KVCS_ERR_") {
            tested.insert(name);
        }
    }
    let missing: Vec<&String> = functions.iter().filter(|f| !tested.contains(f.as_str())).collect();
    assert!(
        missing.is_empty(),
        "C calls with no error path tested in tests/c: {missing:?}"
    );
}
