//! Gives the shared library the SONAME `libkvcsum.so.<major>` (the major
//! part of the crate version, `0` before 1.0), so that programs linked
//! against an installed `libkvcsum.so` record the versioned name and keep
//! loading it across compatible updates (`make install`).

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets CARGO_PKG_VERSION_MAJOR");
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkvcsum.so.{major}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
