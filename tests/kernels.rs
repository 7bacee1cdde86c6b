//! The embedded CUDA kernels compile with NVRTC for the architectures we
//! ship for. Needs libnvrtc (no GPU): `.ci/run` installs NVRTC from PyPI and
//! runs this with `--ignored`; without NVRTC it is reported as ignored.

#[test]
#[ignore = "needs NVRTC (libnvrtc.so.13 on LD_LIBRARY_PATH); .ci/run runs it with --ignored"]
fn checksum_kernel_compiles_with_nvrtc() {
    for arch in ["sm_90", "sm_80"] {
        let ptx = kvcsum::checksum_ptx(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(
            ptx.contains(".entry kvcs_checksum"),
            "{arch}: no kvcs_checksum entry in the PTX"
        );
    }
}
