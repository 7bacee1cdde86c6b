//! Running a test's body under a 2 GiB address-space limit, in a child
//! process of its own, so that an allocation in proportion to a declared
//! length fails the test instead of succeeding on a large machine.

/// Runs `body` in a child process (this test binary, this test only) whose
/// address space is limited to 2 GiB; the child must exit normally. `name`
/// is the test's path as `concat!(module_path!(), "::", fn name)` gives it:
/// its first segment (the crate) is dropped, which leaves the name libtest
/// knows the test by.
pub fn under_address_space_limit(name: &str, body: fn()) {
    const CHILD: &str = "KVCS_ADDRESS_LIMIT_CHILD";
    let name = name.split_once("::").map_or(name, |(_, test)| test);
    if std::env::var(CHILD).as_deref() == Ok(name) {
        let limit = libc::rlimit {
            rlim_cur: 2 << 30,
            rlim_max: 2 << 30,
        };
        // SAFETY: setrlimit reads the struct given; no memory is shared.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
        body();
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD, name)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "{name} under a 2 GiB address-space limit: {:?}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}
