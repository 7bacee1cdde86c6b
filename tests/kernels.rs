//! The embedded CUDA kernels compile with NVRTC for the architectures we
//! ship for. Needs libnvrtc (no GPU): `.ci/run` installs NVRTC from PyPI and
//! runs this with `--ignored`; without NVRTC it is reported as ignored.
//!
//! The kernel source carries a generated prelude: the constants it shares
//! with the host and a `static_assert` of every descriptor's size and field
//! offsets as `src/engines/cuda/descriptors.rs` lays them out, so this test also
//! fails when a descriptor drifts on one side. `KVCS_PTX_DIR=dir` writes the
//! PTX there (`checksum_sm_90.ptx`, ...), to compare kernels across changes.

#[test]
#[ignore = "needs NVRTC (libnvrtc.so.13 on LD_LIBRARY_PATH); .ci/run runs it with --ignored"]
fn checksum_kernel_compiles_with_nvrtc() {
    for arch in ["sm_90", "sm_80"] {
        let ptx = kvcsum::checksum_ptx(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for entry in [
            "kvcs_checksum",
            "kvcs_checksum_unpaired",
            "kvcs_checksum_placed",
            "kvcs_checksum_narrow",
            "kvcs_store",
            "kvcs_state",
        ] {
            assert!(
                ptx.contains(&format!(".entry {entry}")),
                "{arch}: no {entry} entry in the PTX"
            );
        }
        if let Some(dir) = std::env::var_os("KVCS_PTX_DIR") {
            let path = std::path::Path::new(&dir).join(format!("checksum_{arch}.ptx"));
            std::fs::write(&path, &ptx).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
}
