//! Facts the docs state that a test can hold: each reads the page and
//! compares what it says with what the library does or declares, so a
//! change of either without the other fails here. (The examples of
//! docs/python.md run in python/tests/test_docs.py; c-api.md's size of the
//! installed library is checked by tests/install/run.sh.)

use std::path::Path;

fn read(path: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|error| panic!("cannot read {path}: {error}"))
}

/// The text of `doc` with its line breaks and runs of spaces made single
/// spaces, so that a sentence wrapped anywhere is found.
fn flat(doc: &str) -> String {
    doc.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn verification_md_names_the_record_version_written_and_the_one_still_read() {
    let text = flat(&read("docs/verification.md"));
    let written = kvcsum::record::RECORD_VERSION;
    // Versions 4 (0.3.0's development builds, no short last values) and 5
    // (no geometry) are still read (src/wire/record.rs).
    let said = format!("this library writes version {written} and reads versions 4 to {written}");
    assert!(
        text.contains(&said),
        "docs/verification.md does not say \"{said}\" (src/wire/record.rs writes version {written})"
    );
    let header = read("include/kvcsum.h");
    assert!(
        header.contains(&format!("#define KVCS_RECORD_VERSION {written}")),
        "include/kvcsum.h's KVCS_RECORD_VERSION is not {written}"
    );
}

/// The row of `status` in docs/ERRORS.md's table.
fn errors_md_row(status: &str) -> String {
    read("docs/ERRORS.md")
        .lines()
        .find(|line| line.contains(&format!("| `{status}` |")))
        .unwrap_or_else(|| panic!("docs/ERRORS.md has no row for {status}"))
        .to_string()
}

/// A `bytes_per_token` that is not a multiple of 8 is refused as
/// INVALID_ARGUMENT (src/inputs/layout.rs; tests/c/errors.c checks the status):
/// ERRORS.md says so under that status and not under UNSUPPORTED.
#[test]
fn errors_md_lists_a_bytes_per_token_not_a_multiple_of_8_as_invalid_argument() {
    assert!(
        errors_md_row("KVCS_ERR_INVALID_ARGUMENT").contains("`bytes_per_token` that is 0 or not a multiple of 8"),
        "docs/ERRORS.md's INVALID_ARGUMENT row does not name bytes_per_token"
    );
    assert!(
        !errors_md_row("KVCS_ERR_UNSUPPORTED").contains("bytes_per_token"),
        "docs/ERRORS.md's UNSUPPORTED row still names bytes_per_token"
    );
    let layout = read("src/inputs/layout.rs");
    assert!(
        layout.contains("bytes_per_token {bytes} is not a positive multiple of {piece_bytes}")
            && layout.contains("InvalidArgument"),
        "src/inputs/layout.rs no longer refuses bytes_per_token as InvalidArgument: change docs/ERRORS.md too"
    );
}

/// The version in kvcsum.hpp's doc comments is never a fixed number
/// (it said 0.1.0 in 0.3.0); the header macros give it.
#[test]
fn kvcsum_hpp_states_no_fixed_version() {
    let hpp = read("include/kvcsum.hpp");
    for (number, line) in hpp.lines().enumerate() {
        let quoted_version = line.split('"').skip(1).step_by(2).any(|quoted| {
            let parts: Vec<&str> = quoted.split('.').collect();
            parts.len() == 3
                && parts
                    .iter()
                    .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
        });
        assert!(
            !quoted_version,
            "include/kvcsum.hpp:{}: a fixed version: {line}",
            number + 1
        );
    }
}

/// KVCS_VERSION_MAJOR/MINOR/PATCH and KVCS_VERSION_NUMBER in the header
/// are Cargo.toml's version.
#[test]
fn header_version_macros_are_cargo_toml_version() {
    let cargo = read("Cargo.toml");
    let version = cargo
        .lines()
        .find_map(|line| line.strip_prefix("version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("Cargo.toml has a version line");
    let parts: Vec<u32> = version
        .split('.')
        .map(|part| part.parse().expect("a numeric version"))
        .collect();
    let header = read("include/kvcsum.h");
    for (name, want) in [
        ("KVCS_VERSION_MAJOR", parts[0]),
        ("KVCS_VERSION_MINOR", parts[1]),
        ("KVCS_VERSION_PATCH", parts[2]),
        ("KVCS_VERSION_NUMBER", parts[0] * 10000 + parts[1] * 100 + parts[2]),
    ] {
        assert!(
            header.contains(&format!("#define {name} {want}\n")),
            "include/kvcsum.h: {name} is not {want} (Cargo.toml's version {version})"
        );
    }
}
