//! The generator of `include/kvcsum.h`, run by `make header` (with
//! `--ignored`): it writes what tests/it/header_gen makes, which
//! tests/it/header.rs checks the checked-in header against. It is ignored so
//! that a plain `cargo test` never rewrites the header.

#[path = "it/header_gen/mod.rs"]
mod header_gen;

use std::path::Path;

#[test]
#[ignore = "writes include/kvcsum.h; `make header` runs it with --ignored"]
fn write_header() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = root.join("include/kvcsum.h");
    std::fs::write(&path, header_gen::generated_header(root))
        .unwrap_or_else(|error| panic!("write {}: {error}", path.display()));
}
