//! The C tests (tests/c/*.c) from `cargo test`: compiled as strict C11
//! (`-std=c11 -Wall -Wextra -Wpedantic -Werror`, the flags of `make
//! c-test`) with the compiler the `cc` crate finds for this target, linked
//! against the libkvcsum.so this `cargo test` built, and run. So `cargo test`
//! alone covers the C ABI; `make c-test` runs the same program under
//! AddressSanitizer and UBSan.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every C file compiles cleanly in strict C11 (the Makefile's `STRICT`).
const STRICT: &[&str] = &["-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror"];

/// The ABI version, which the SONAME carries (`libkvcsum.so.<abi>`, build.rs).
const ABI_VERSION: u32 = kvcsum::ffi::constants::KVCS_ABI_VERSION;

/// The folder of the library this test run links: cargo puts the cdylib
/// beside the test binaries (`target/<profile>/deps`).
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's folder").to_path_buf();
    for dir in [deps.clone(), deps.parent().map(Path::to_path_buf).unwrap_or_default()] {
        if dir.join("libkvcsum.so").is_file() {
            return dir;
        }
    }
    panic!(
        "no libkvcsum.so beside {} or above it; cargo builds the cdylib with the tests",
        exe.display()
    );
}

#[test]
fn the_c_tests_pass_compiled_as_strict_c11() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let library = library_dir();
    // The program needs the library under its SONAME; a folder of this
    // test's own holds both names, so nothing of cargo's is changed.
    let work = library.join("c_abi_test");
    fs::create_dir_all(&work).unwrap();
    for name in ["libkvcsum.so".to_owned(), format!("libkvcsum.so.{ABI_VERSION}")] {
        let link = work.join(&name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(library.join("libkvcsum.so"), &link).unwrap();
    }

    let mut sources: Vec<PathBuf> = fs::read_dir(root.join("tests/c"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "c"))
        .collect();
    sources.sort();
    assert!(sources.len() >= 5, "only {} C test files in tests/c", sources.len());

    let target = env!("KVCS_BUILD_TARGET");
    let compiler = cc::Build::new()
        .cargo_metadata(false)
        .target(target)
        .host(target)
        .opt_level(0)
        .debug(true)
        .get_compiler();
    assert!(
        !compiler.is_like_msvc(),
        "the C tests need a gcc- or clang-like compiler"
    );
    let program = work.join("c_tests");
    let _ = fs::remove_file(&program);
    let mut compile = compiler.to_command();
    compile
        .args(STRICT)
        .arg("-I")
        .arg(root.join("include"))
        .arg("-I")
        .arg(root.join("tests/c"))
        .args(&sources)
        .arg("-o")
        .arg(&program)
        .arg(format!("-L{}", work.display()))
        .arg("-lkvcsum")
        .arg(format!("-Wl,-rpath,{}", work.display()));
    // The command as a shell would show it (cc also sets the environment,
    // which Command's Debug would print whole).
    let shown = std::iter::once(compile.get_program())
        .chain(compile.get_args())
        .map(|part| part.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let compiled = compile
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{shown}`: {e}"));
    assert!(
        compiled.status.success(),
        "the C tests do not compile as strict C11 (`{shown}`):\n{}{}",
        String::from_utf8_lossy(&compiled.stdout),
        String::from_utf8_lossy(&compiled.stderr)
    );

    let run = Command::new(&program).current_dir(&work).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    // The program's last line: "N passed, M failed" (the last such line).
    let summary = stdout.lines().chain(stderr.lines()).rev().find_map(|line| {
        let (passed, failed) = line.trim().split_once(" passed, ")?;
        Some((
            passed.parse::<u64>().ok()?,
            failed.strip_suffix(" failed")?.parse::<u64>().ok()?,
        ))
    });
    let Some((passed, failed)) = summary else {
        panic!(
            "the C tests printed no `N passed, M failed` line (exit {:?}):\n{stdout}{stderr}",
            run.status
        )
    };
    assert!(
        run.status.success() && failed == 0,
        "the C tests failed: {passed} passed, {failed} failed, exit {:?}:\n{stderr}",
        run.status
    );
    assert!(passed > 100, "only {passed} C checks ran");
}
