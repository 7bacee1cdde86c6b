//! Gives the shared library the SONAME `libkvcsum.so.<abi>`, where `<abi>`
//! is `KVCS_ABI_VERSION` (docs/VERSIONING.md): programs linked against an
//! installed `libkvcsum.so` record the versioned name, keep loading it
//! across releases of the same ABI, and never load a library of another
//! ABI (`make install`). Also hands the target triple to the tests
//! (`KVCS_BUILD_TARGET`).

use std::fs;

/// The file that defines `KVCS_ABI_VERSION`, the one place it is written.
const ABI_SOURCE: &str = "src/ffi/constants.rs";

fn main() {
    let source = fs::read_to_string(ABI_SOURCE).expect("build.rs reads src/ffi/constants.rs");
    let abi = source
        .lines()
        .find_map(|line| line.trim().strip_prefix("pub const KVCS_ABI_VERSION: u32 = "))
        .and_then(|rest| rest.strip_suffix(';'))
        .and_then(|value| value.parse::<u32>().ok())
        .expect("src/ffi/constants.rs defines `pub const KVCS_ABI_VERSION: u32 = N;`");
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkvcsum.so.{abi}");
    }
    // The target triple, for tests/it/c_abi.rs, which compiles the C tests with
    // the `cc` crate for the same target (cargo sets TARGET for build
    // scripts only).
    if let Ok(target) = std::env::var("TARGET") {
        println!("cargo:rustc-env=KVCS_BUILD_TARGET={target}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={ABI_SOURCE}");
}
