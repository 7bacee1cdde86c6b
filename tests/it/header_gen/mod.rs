//! How `include/kvcsum.h` is made: cbindgen over the crate, with the
//! prototypes put under `KVCS_NO_PROTOTYPES`; and every other binding of
//! the C ABI ([`bindings`], from src/ffi read with syn). The one
//! definition, shared by the check (tests/it/header.rs) and the generator
//! (tests/gen_header.rs, `make header`).

pub mod bindings;

use std::path::Path;

/// The header as cbindgen writes it, with its prototypes under
/// `#if !defined(KVCS_NO_PROTOTYPES)`: a program that loads the library at
/// run time defines it, so a direct call does not compile.
pub fn generated_header(root: &Path) -> Vec<u8> {
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let text = String::from_utf8(generated).expect("the header is UTF-8");
    guard_prototypes(&text).into_bytes()
}

/// `header` with the function declarations of its `extern "C"` block
/// between `#if !defined(KVCS_NO_PROTOTYPES)` and `#endif`.
fn guard_prototypes(header: &str) -> String {
    let open = "extern \"C\" {\n#endif // __cplusplus\n";
    let close = "\n#ifdef __cplusplus\n}  // extern \"C\"";
    assert_eq!(
        header.matches(open).count(),
        1,
        "cbindgen's extern \"C\" block has changed shape"
    );
    assert_eq!(
        header.matches(close).count(),
        1,
        "cbindgen's extern \"C\" block has changed shape"
    );
    header
        .replacen(open, &format!("{open}\n#if !defined(KVCS_NO_PROTOTYPES)\n"), 1)
        .replacen(
            close,
            &format!("\n#endif  /* !defined(KVCS_NO_PROTOTYPES) */\n{close}"),
            1,
        )
}
