//! `make header`: writes every binding of the C ABI from src/ffi, then
//! `include/kvcsum.h`, as tests/it/header_gen makes them (tests/it/header.rs
//! checks the checked-in files against the same code).

#[path = "../../tests/it/header_gen/mod.rs"]
mod header_gen;

use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().expect("the repository root");
    // The bindings first: cbindgen reads the crate, function table included.
    let bindings = header_gen::bindings::generated_bindings(&root).unwrap_or_else(|problem| {
        eprintln!("make header: {problem}");
        std::process::exit(1)
    });
    let mut written = Vec::new();
    for (relative, text) in bindings {
        let path = root.join(relative);
        if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            std::fs::write(&path, text).unwrap_or_else(|error| panic!("write {}: {error}", path.display()));
            written.push(relative);
        }
    }
    let path = root.join("include/kvcsum.h");
    let header = header_gen::generated_header(&root);
    if std::fs::read(&path).ok().as_deref() != Some(header.as_slice()) {
        std::fs::write(&path, header).unwrap_or_else(|error| panic!("write {}: {error}", path.display()));
        written.push("include/kvcsum.h");
    }
    let written = if written.is_empty() {
        "nothing (all current)".to_owned()
    } else {
        written.join(", ")
    };
    println!("make header: wrote {written}");
}
