//! The checked-in `include/kvcsum.h` must be what cbindgen generates now.
//! `KVCS_BLESS=1 cargo test --test header` (or `make header`) rewrites it.

use std::path::Path;

#[test]
fn header_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = root.join("include/kvcsum.h");
    if std::env::var_os("KVCS_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/kvcsum.h");
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/kvcsum.h is stale: run `make header` (KVCS_BLESS=1 cargo test --test header) and commit it"
    );
}
