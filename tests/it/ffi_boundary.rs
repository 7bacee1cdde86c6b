//! The C boundary under careless callers: each case through the
//! `extern "C"` functions as C would call them, with hand-made records and
//! payloads (tests/it/support/hand_made_records.rs).
//!
//! - Registration order of groups does not matter (records list groups by id).
//! - A record's role is compared with the role its request is expected in.
//! - Records of requests not expected change nothing.
//! - Out-of-bounds messages print negative addresses with a sign.
//! - Reports count the loaded positions that were not compared, and an
//!   option makes such loads unverified.
//! - A region at address 0 is refused (a host worker read it and crashed),
//!   and so is a host region that is not mapped memory (address 8, freed
//!   memory, a range running past its mapping).
//! - Topology calls given a TP size of 2^31 from a handshake refuse it under
//!   an address-space limit instead of allocating 8 GiB.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --release --test it ffi_boundary::<name>`.

use crate::support;

use std::ffi::CString;
use std::ptr::null_mut;

use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::status::*;
use kvcsum::ffi::topology::*;
use kvcsum::ffi::verifier::*;
use kvcsum::ffi::worker::*;
use support::address_limit::under_address_space_limit;
use support::hand_made_records::*;
use support::handles::*;
use support::Rng;

// ---------------------------------------------------------------------------
// Groups registered out of id order

#[test]
fn groups_registered_out_of_id_order_give_valid_records_that_match() {
    let mut rng = Rng::for_test("groups_registered_out_of_id_order_give_valid_records_that_match");
    let seed = rng.seed();
    let (num_blocks, block_size) = (4, 16);
    let worker = HostWorker::new(&mut rng, 3, num_blocks, block_size);
    // Group 1 first, then group 0; layers in both.
    assert_eq!(kvcs_worker_add_group(worker.handle, 1, block_size), KVCS_OK);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, block_size), KVCS_OK);
    assert_eq!(
        worker.add_layer(0, 0, 0, num_blocks, block_size),
        KVCS_OK,
        "{}",
        last_error()
    );
    assert_eq!(
        worker.add_layer(1, 1, 1, num_blocks, block_size),
        KVCS_OK,
        "{}",
        last_error()
    );
    assert_eq!(
        worker.add_layer(0, 2, 2, num_blocks, block_size),
        KVCS_OK,
        "{}",
        last_error()
    );
    let scheduled = blocks(&[("req", 40, vec![(0, 0, vec![2, 0, 3]), (1, 0, vec![1, 3, 0])])]);
    let producer_record = worker.record(&scheduled, PRODUCER).unwrap_or_else(|(status, message)| {
        panic!("seed {seed}: kvcs_result_encode gave {status:?}: {message}");
    });
    let consumer_record = worker.record(&scheduled, CONSUMER).unwrap();
    let producer = CVerifier::new(1);
    producer.expect(&scheduled, PRODUCER);
    producer.add(&producer_record).expect("add_record");
    let payload = producer.payload("req").unwrap();
    let consumer = CVerifier::new(1);
    // A plain payload (WEIGHTED) does not say the producer's block sizes.
    consumer.producer_block_size(0, block_size);
    consumer.producer_block_size(1, block_size);
    consumer.expect(&scheduled, CONSUMER);
    consumer.add(&consumer_record).expect("add_record");
    let report = consumer.check("req", &payload).expect("check");
    assert_eq!(report.verdict(), MATCH, "seed {seed}: {}", report.message());
    assert_eq!((report.compared(), report.uncompared()), (6, 0), "seed {seed}");
}

// ---------------------------------------------------------------------------
// A record computed in the other role

#[test]
fn a_record_of_the_other_role_is_unverified_not_corrupt() {
    let mut rng = Rng::for_test("a_record_of_the_other_role_is_unverified_not_corrupt");
    let seed = rng.seed();
    let (num_blocks, block_size) = (8, 16);
    let worker = HostWorker::new(&mut rng, 2, num_blocks, block_size);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, block_size), KVCS_OK);
    for layer in 0..2 {
        assert_eq!(worker.add_layer(0, layer, layer, num_blocks, block_size), KVCS_OK);
    }
    let scheduled = blocks(&[("req", 100, vec![(0, 0, vec![3, 1, 4, 0, 5, 2, 6])])]);
    let producer = CVerifier::new(1);
    producer.expect(&scheduled, PRODUCER);
    producer
        .add(&worker.record(&scheduled, PRODUCER).unwrap())
        .expect("add_record");
    let payload = producer.payload("req").unwrap();
    // The consumer rank ran its checksum with KVCS_ROLE_PRODUCER by mistake.
    let consumer = CVerifier::new(1);
    consumer.producer_block_size(0, block_size);
    consumer.expect(&scheduled, CONSUMER);
    consumer
        .add(&worker.record(&scheduled, PRODUCER).unwrap())
        .expect("add_record");
    let report = consumer.check("req", &payload).expect("check");
    assert_eq!(report.verdict(), UNVERIFIED, "seed {seed}: {}", report.message());
    assert_eq!(
        reason_name(report.reason()),
        "KVCS_UNVERIFIED_ROLE_DIFFERS",
        "seed {seed}"
    );
    assert!(report.message().contains("as a producer"), "{}", report.message());
    // The right role matches.
    consumer
        .add(&worker.record(&scheduled, CONSUMER).unwrap())
        .expect("add_record");
    let report = consumer.check("req", &payload).expect("check");
    assert_eq!(report.verdict(), MATCH, "seed {seed}: {}", report.message());
    // A producer's verifier given a consumer's record builds no payload.
    let producer = CVerifier::new(1);
    producer.expect(&scheduled, PRODUCER);
    producer
        .add(&worker.record(&scheduled, CONSUMER).unwrap())
        .expect("add_record");
    let (status, message) = producer.payload("req").unwrap_err();
    assert_eq!(status, KVCS_ERR_INVALID_ARGUMENT);
    assert!(message.contains("as a consumer"), "{message}");
}

// ---------------------------------------------------------------------------
// Records of requests not expected

fn tp_record(req_id: &str, tp_rank: u32, tp_size: u32, pp_rank: u32) -> Vec<u8> {
    let mut record = simple_record(vec![5], 16);
    record.rank = (tp_rank, tp_size, pp_rank);
    record.requests[0].req_id = req_id.to_owned();
    record.encode()
}

#[test]
fn records_of_requests_not_expected_change_nothing() {
    let verifier = CVerifier::new(2);
    // A stray record (TP size 1, two stages) is accepted and pins nothing.
    verifier.add(&tp_record("stray", 0, 1, 1)).expect("add_record");
    let scheduled = blocks(&[("req", 16, vec![(0, 0, vec![0])])]);
    verifier.expect(&scheduled, CONSUMER);
    verifier.add(&tp_record("req", 0, 2, 0)).expect("add_record");
    verifier.add(&tp_record("req", 1, 2, 0)).expect("add_record");
    // Every worker reported: the verdict is about the payload.
    let req_id = CString::new("req").unwrap();
    let mut out = null_mut();
    assert_eq!(
        kvcs_verifier_check_no_payload(verifier.0, req_id.as_ptr(), &mut out),
        KVCS_OK
    );
    assert_eq!(reason_name(CReport(out).reason()), "KVCS_UNVERIFIED_NO_CHECKSUMS");
    // While records are held, their TP size is enforced.
    assert_eq!(
        status_of(&verifier.add(&tp_record("req", 0, 1, 1))),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("differs from tp_size 2"), "{}", last_error());
    // A stray record of another TP size is still fine, and changes nothing.
    verifier.add(&tp_record("stray", 0, 1, 1)).expect("add_record");
    // Once forgotten, a request's records pin nothing either.
    assert_eq!(kvcs_verifier_forget(verifier.0, req_id.as_ptr()), KVCS_OK);
    verifier.expect(&scheduled, CONSUMER);
    verifier.add(&tp_record("req", 0, 1, 0)).expect("add_record");
    verifier.add(&tp_record("req", 0, 1, 1)).expect("add_record");
    // Expecting the request again drops its records: the TP size is free.
    verifier.expect(&scheduled, CONSUMER);
    verifier.add(&tp_record("req", 1, 2, 0)).expect("add_record");
}

// ---------------------------------------------------------------------------
// Negative addresses in messages

#[test]
fn out_of_bounds_messages_print_negative_bounds_with_a_sign() {
    let mut rng = Rng::for_test("out_of_bounds_messages_print_negative_bounds_with_a_sign");
    let worker = HostWorker::new(&mut rng, 1, 4, 16);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 16), KVCS_OK);
    // Blocks run downwards from address 16: block 3 starts 768 bytes below;
    // the 16 tokens of 16 bytes end at 16 + 256.
    let segment = kvcs_segment {
        address: 16,
        block_stride: -256,
        kernel_block_stride: 0,
        head_stride: 16,
        token_stride: 16,
        bytes_per_token: 16,
    };
    assert_eq!(worker.add_segment(0, 0, 4, 16, segment), KVCS_ERR_OUT_OF_BOUNDS);
    let message = last_error();
    assert!(message.contains("reaches bytes -0x2f0..0x110"), "{message}");
    assert!(!message.contains("0xffff"), "{message}");
}

// ---------------------------------------------------------------------------
// Coverage: loaded positions that were not compared

#[test]
fn reports_count_loaded_positions_not_compared_and_require_them_unless_opted_out() {
    let mut rng = Rng::for_test("reports_count_loaded_positions_not_compared_and_may_require_them");
    let seed = rng.seed();
    // Consumer: block size 16, positions 1..5 (tokens 16..80) of 80 tokens.
    // Producer: block size 32, positions 0..3. Runs of 32 tokens: run 0
    // needs the consumer's position 0, which it did not load, so its
    // position 1 is never compared.
    let c: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
    let record = |num_tokens: u64, values: Vec<u64>| {
        let mut record = simple_record(values, num_tokens);
        record.requests[0].groups[0].first_position = 1;
        record.encode()
    };
    let first_run = rng.next_u64();
    let payload = |num_tokens: u64| {
        let mut values = vec![first_run, c[1].wrapping_add(c[2]), c[3]];
        values.truncate(num_tokens.div_ceil(32) as usize);
        TPayload {
            num_tokens,
            groups: vec![(0, 7, 0, values)],
            extension: Some((1, vec![(0, 32, Vec::new())])),
        }
        .encode()
    };
    let verifier = CVerifier::new(1);
    let scheduled = blocks(&[("req", 80, vec![(0, 1, vec![0, 1, 2, 3])])]);
    verifier.expect(&scheduled, CONSUMER);
    let mut corrupted = c.clone();
    corrupted[0] ^= 1 << 17;
    // By default a position nobody compared makes the load unverified,
    // intact or corrupted there, and the finding names it.
    for values in [c.clone(), corrupted.clone()] {
        verifier.add(&record(80, values)).expect("add_record");
        let report = verifier.check("req", &payload(80)).expect("check");
        assert_eq!(report.verdict(), UNVERIFIED, "seed {seed}: {}", report.message());
        assert_eq!(
            reason_name(report.reason()),
            "KVCS_UNVERIFIED_UNCOMPARED_POSITIONS",
            "seed {seed}"
        );
        assert!(report.message().contains("positions 1..2"), "{}", report.message());
    }
    // Opted out (0), the compared positions alone are judged.
    assert_eq!(kvcs_verifier_set_require_coverage(verifier.0, 0), KVCS_OK);
    for values in [c.clone(), corrupted] {
        verifier.add(&record(80, values)).expect("add_record");
        let report = verifier.check("req", &payload(80)).expect("check");
        // By the definition a match, even with position 1 corrupted; the
        // report says position 1 was not compared.
        assert_eq!(report.verdict(), MATCH, "seed {seed}: {}", report.message());
        assert_eq!((report.compared(), report.uncompared()), (2, 1), "seed {seed}");
        assert!(
            report.message().contains("1 loaded positions not compared"),
            "{}",
            report.message()
        );
    }
    // A producer of fewer tokens (64): the consumer's position 4 is not
    // compared either.
    let report = verifier.check("req", &payload(64)).expect("check");
    assert_eq!(report.verdict(), MATCH, "seed {seed}: {}", report.message());
    assert_eq!((report.compared(), report.uncompared()), (1, 2), "seed {seed}");
    // Required coverage: such a load is unverified with its own reason.
    assert_eq!(
        kvcs_verifier_set_require_coverage(verifier.0, 2),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert_eq!(kvcs_verifier_set_require_coverage(verifier.0, 1), KVCS_OK);
    let report = verifier.check("req", &payload(80)).expect("check");
    assert_eq!(report.verdict(), UNVERIFIED, "seed {seed}");
    assert_eq!(
        reason_name(report.reason()),
        "KVCS_UNVERIFIED_UNCOMPARED_POSITIONS",
        "seed {seed}"
    );
    // A load that compares everything still matches under it.
    let full = CVerifier::new(1);
    let scheduled = blocks(&[("req", 80, vec![(0, 0, vec![0, 1, 2, 3, 4])])]);
    full.expect(&scheduled, CONSUMER);
    assert_eq!(kvcs_verifier_set_require_coverage(full.0, 1), KVCS_OK);
    let values: Vec<u64> = (0..5).map(|_| rng.next_u64()).collect();
    full.add(&simple_record(values.clone(), 80).encode())
        .expect("add_record");
    let sent = vec![
        values[0].wrapping_add(values[1]),
        values[2].wrapping_add(values[3]),
        values[4],
    ];
    let payload = TPayload {
        num_tokens: 80,
        groups: vec![(0, 7, 0, sent)],
        extension: Some((1, vec![(0, 32, Vec::new())])),
    };
    let report = full.check("req", &payload.encode()).expect("check");
    assert_eq!(report.verdict(), MATCH, "seed {seed}: {}", report.message());
    assert_eq!((report.compared(), report.uncompared()), (3, 0), "seed {seed}");
}

// ---------------------------------------------------------------------------
// A host region at address 0

#[test]
fn a_region_at_address_0_or_past_the_end_of_the_address_space_is_refused() {
    let mut rng = Rng::for_test("a_region_at_address_0_or_past_the_end_of_the_address_space_is_refused");
    let worker = HostWorker::new(&mut rng, 1, 4, 16);
    // A host worker cannot check host memory, but address 0 is never
    // memory: accepted, the checksum read it and the process died.
    assert_eq!(
        kvcs_worker_add_region(worker.handle, 0, 1 << 20),
        KVCS_ERR_INVALID_ARGUMENT
    );
    let message = last_error();
    assert!(message.contains("address 0x0"), "{message}");
    assert!(message.contains("length 1048576"), "{message}");
    // A region whose end runs past the end of the address space.
    assert_eq!(
        kvcs_worker_add_region(worker.handle, u64::MAX - 4095, 8192),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("wraps"), "{}", last_error());
    // Nothing was registered: a layer at address 0 reaches memory no region
    // holds, so no checksum can read it.
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 16), KVCS_OK);
    let segment = kvcs_segment {
        address: 0,
        block_stride: 256,
        kernel_block_stride: 0,
        head_stride: 16,
        token_stride: 16,
        bytes_per_token: 16,
    };
    assert_eq!(worker.add_segment(0, 0, 4, 16, segment), KVCS_ERR_OUT_OF_BOUNDS);
    assert!(last_error().contains("no registered region"), "{}", last_error());
    // The worker's own region still works.
    assert_eq!(worker.add_layer(0, 0, 0, 4, 16), KVCS_OK, "{}", last_error());
    let scheduled = blocks(&[("req", 64, vec![(0, 0, vec![3, 1, 2, 0])])]);
    assert!(worker.record(&scheduled, CONSUMER).is_ok());
}

// ---------------------------------------------------------------------------
// Host regions that are not mapped memory

/// Anonymous private memory of `pages` pages (`prot` its protection),
/// unmapped when dropped: the test's own mappings, whose holes it punches.
struct Mapping {
    address: u64,
    length: usize,
}

impl Mapping {
    fn new(pages: usize, prot: i32) -> Mapping {
        let length = pages * page();
        // SAFETY: a fresh anonymous mapping; nothing else refers to it.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(address, libc::MAP_FAILED, "mmap of {pages} pages");
        Mapping {
            address: address as u64,
            length,
        }
    }

    /// Unmaps page `index` (already unmapped pages stay so).
    fn punch(&self, index: usize) -> u64 {
        let address = self.address + (index * page()) as u64;
        // SAFETY: a page of this test's own mapping, which nothing reads.
        let status = unsafe { libc::munmap(address as usize as *mut libc::c_void, page()) };
        assert_eq!(status, 0);
        address
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new` (munmap of holes is harmless).
        unsafe { libc::munmap(self.address as usize as *mut libc::c_void, self.length) };
    }
}

fn page() -> usize {
    // SAFETY: reads a constant of the system.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// Registers `(address, length)` and expects `status` with a message
/// holding every needle; `KVCS_OK` is expected without a message.
fn expect_region(worker: &HostWorker, address: u64, length: u64, status: kvcs_status, needles: &[&str]) {
    let got = kvcs_worker_add_region(worker.handle, address, length);
    let message = if got == KVCS_OK { String::new() } else { last_error() };
    assert_eq!(got, status, "region {address:#x} + {length}: {message}");
    for needle in needles {
        assert!(
            message.contains(needle),
            "region {address:#x} + {length}: {needle:?} not in {message:?}"
        );
    }
}

#[test]
fn host_regions_that_are_not_mapped_memory_are_refused() {
    let mut rng = Rng::for_test("host_regions_that_are_not_mapped_memory_are_refused");
    let seed = rng.seed();
    let page = page() as u64;
    let worker = HostWorker::new(&mut rng, 1, 4, 16);
    // Addresses that were never memory: accepted before, the checksum
    // then read them and the process died (SIGSEGV).
    for address in [8u64, 0x100, page - 8] {
        expect_region(
            &worker,
            address,
            64,
            KVCS_ERR_INVALID_ARGUMENT,
            &[&format!("address {address:#x}"), "length 64", "not mapped"],
        );
    }
    // Memory that was mapped (and written) and is freed now: the middle
    // page of three (a one-page hole, which other threads' mappings do not
    // fill).
    let freed = Mapping::new(3, libc::PROT_READ | libc::PROT_WRITE);
    // SAFETY: the test's own writable mapping of 3 pages.
    unsafe { std::ptr::write_bytes(freed.address as usize as *mut u8, 0x5a, 3 * page as usize) };
    let freed_address = freed.punch(1) + 8 * rng.below(page / 8);
    expect_region(
        &worker,
        freed_address,
        page,
        KVCS_ERR_INVALID_ARGUMENT,
        &[&format!("address {freed_address:#x}"), "not mapped"],
    );

    // A region whose end runs past its mapping: refused, naming the first
    // page that is not mapped; one ending on the mapping's last byte, at any
    // offset in a page, is accepted.
    let mapping = Mapping::new(8, libc::PROT_READ | libc::PROT_WRITE);
    let hole = mapping.punch(5);
    let start = mapping.address + 8 * rng.below(page / 8);
    let inside = mapping.address + 5 * page - start;
    expect_region(
        &worker,
        start,
        inside + 8 * rng.range(1..page / 8),
        KVCS_ERR_OUT_OF_BOUNDS,
        &[
            &format!("address {start:#x}"),
            &format!("page at {hole:#x}"),
            "runs past mapped memory",
        ],
    );
    expect_region(&worker, start, inside, KVCS_OK, &[]);
    // Past the hole the memory is mapped again: a region over the hole is
    // refused, one after it accepted.
    expect_region(
        &worker,
        hole - 8,
        16,
        KVCS_ERR_OUT_OF_BOUNDS,
        &[&format!("page at {hole:#x}")],
    );
    expect_region(&worker, hole + page, 2 * page, KVCS_OK, &[]);

    // A large reservation (more pages than one mincore call takes) with one
    // page unmapped at a random place: found exactly, whatever the chunk.
    let pages = 3 * 4096 + rng.below(4096) as usize;
    let large = Mapping::new(pages, libc::PROT_READ);
    let index = rng.range(1..pages as u64) as usize;
    let large_hole = large.punch(index);
    expect_region(
        &worker,
        large.address,
        (pages * page as usize) as u64,
        KVCS_ERR_OUT_OF_BOUNDS,
        &[&format!("page at {large_hole:#x}")],
    );
    expect_region(&worker, large.address, index as u64 * page, KVCS_OK, &[]);

    // A refused region registered nothing: a layer there reaches memory no
    // region holds, so no checksum can read it.
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 16), KVCS_OK);
    expect_no_region_holds(&worker, 0x100, seed);
    // The worker's own (mapped) region still works.
    assert_eq!(worker.add_layer(0, 1, 0, 4, 16), KVCS_OK, "{}", last_error());
    let scheduled = blocks(&[("req", 64, vec![(0, 0, vec![3, 1, 2, 0])])]);
    assert!(worker.record(&scheduled, CONSUMER).is_ok(), "seed {seed}");
}

#[test]
fn host_regions_mapped_without_read_permission_are_refused() {
    // PROT_NONE is what CUDA's unified addressing reserves for device memory
    // in a host process, and guard pages are: mapped for mincore, so a host
    // worker took such a region before, and a checksum then died reading it.
    let mut rng = Rng::for_test("host_regions_mapped_without_read_permission_are_refused");
    let seed = rng.seed();
    let page = page() as u64;
    let worker = HostWorker::new(&mut rng, 1, 4, 16);
    let pages = 4 + rng.below(12) as usize;
    let none = Mapping::new(pages, libc::PROT_NONE);
    let address = none.address + 8 * rng.below(page / 8);
    expect_region(
        &worker,
        address,
        64,
        KVCS_ERR_INVALID_ARGUMENT,
        &[
            &format!("address {address:#x}"),
            "without read permission (---p)",
            "device worker",
        ],
    );
    // Write-only (no 'r' in /proc/self/maps): refused alike.
    let write_only = Mapping::new(2, libc::PROT_WRITE);
    expect_region(
        &worker,
        write_only.address,
        page,
        KVCS_ERR_INVALID_ARGUMENT,
        &["without read permission (-w-p)"],
    );
    // A readable mapping with one page made unreadable at a random place: a
    // region running into it is refused naming that page; one ending just
    // before it, and one starting just after it, are taken.
    let mapping = Mapping::new(pages, libc::PROT_READ | libc::PROT_WRITE);
    let index = rng.range(1..pages as u64 - 1);
    let guard = mapping.address + index * page;
    // SAFETY: one page of the test's own mapping, which nothing reads.
    let status = unsafe { libc::mprotect(guard as usize as *mut libc::c_void, page as usize, libc::PROT_NONE) };
    assert_eq!(status, 0, "seed {seed}");
    let start = mapping.address + 8 * rng.below(page / 8);
    expect_region(
        &worker,
        start,
        guard - start + 8,
        KVCS_ERR_OUT_OF_BOUNDS,
        &[
            &format!("address {start:#x}"),
            &format!("page at {guard:#x}"),
            "without read permission",
        ],
    );
    expect_region(&worker, start, guard - start, KVCS_OK, &[]);
    expect_region(&worker, guard + page, page, KVCS_OK, &[]);
    // The refused regions registered nothing: a layer over the guard page
    // reaches memory no region holds.
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 16), KVCS_OK);
    expect_no_region_holds(&worker, guard, seed);
}

/// A one-head layer of 4 blocks of 16 tokens at `address` (group 0, which
/// the caller added) is refused: no registered region holds it.
fn expect_no_region_holds(worker: &HostWorker, address: u64, seed: u64) {
    let segment = kvcs_segment {
        address,
        block_stride: 256,
        kernel_block_stride: 0,
        head_stride: 16,
        token_stride: 16,
        bytes_per_token: 16,
    };
    assert_eq!(
        worker.add_segment(0, 0, 4, 16, segment),
        KVCS_ERR_OUT_OF_BOUNDS,
        "seed {seed}"
    );
    assert!(last_error().contains("no registered region"), "{}", last_error());
}

// ---------------------------------------------------------------------------
// Topology calls with a TP size from a handshake

#[test]
fn topology_calls_with_a_huge_tp_size_are_refused_under_a_memory_limit() {
    under_address_space_limit(
        concat!(
            module_path!(),
            "::topology_calls_with_a_huge_tp_size_are_refused_under_a_memory_limit"
        ),
        || {
            // 2^31 remote ranks were 8 GiB of u32 before anything was checked.
            let huge = 1u32 << 31;
            let refused = |status: kvcs_status, needle: &str| {
                assert_eq!(status, KVCS_ERR_INVALID_ARGUMENT, "{needle}: {}", last_error());
                let message = last_error();
                assert!(message.contains(needle) && message.contains("65536"), "{message}");
            };
            let mut len = 7usize;
            refused(
                kvcs_remote_ranks(0, 1, huge, null_mut(), 0, &mut len),
                "remote_tp 2147483648",
            );
            refused(
                kvcs_handshake_targets(0, 1, huge, null_mut(), 0, &mut len),
                "remote_tp 2147483648",
            );
            refused(
                kvcs_head_sources(0, 1, huge, huge, 0, null_mut(), 0, &mut len),
                "remote_tp 2147483648",
            );
            assert_eq!(len, 7, "*len is written only on success or a size query");
            let mut ratio = 0i64;
            refused(kvcs_tp_ratio(huge, 1, &mut ratio), "local_tp 2147483648");
            let (mut first, mut count) = (0u32, 0u32);
            refused(kvcs_rank_heads(0, huge, 1, 0, &mut first, &mut count), "tp 2147483648");
            let mut replicated = 0u32;
            refused(
                kvcs_remote_kv_replicated(huge, 8, &mut replicated),
                "remote_tp 2147483648",
            );
            refused(kvcs_local_kv_replicated(huge, 8, 0, &mut replicated), "tp 2147483648");
            // A handshake telling 2^31 ranks is refused and recorded nowhere.
            let topology = topology(1, 8);
            let mut added = 9u32;
            refused(
                kvcs_topology_add_remote(topology, c"prefill".as_ptr(), &remote_engine(huge), &mut added),
                "tp_size 2147483648",
            );
            assert_eq!(added, 9);
            let mut told = remote_engine(0);
            assert_eq!(
                kvcs_topology_remote(topology, c"prefill".as_ptr(), &mut told),
                KVCS_ERR_NOT_FOUND
            );
            // So is a local engine of that size.
            let local = kvcs_local_engine {
                tp_rank: 0,
                tp_size: huge,
                total_kv_heads: 8,
                is_mla: 0,
                block_size: 16,
            };
            let mut other = null_mut();
            refused(
                kvcs_topology_create(c"decode".as_ptr(), &local, &mut other),
                "tp 2147483648",
            );
            assert!(other.is_null());
            // Just past the bound is refused; the bound itself works.
            refused(
                kvcs_remote_ranks(0, 1, 65_537, null_mut(), 0, &mut len),
                "remote_tp 65537",
            );
            assert_eq!(
                kvcs_remote_ranks(0, 1, 65_536, null_mut(), 0, &mut len),
                KVCS_ERR_BUFFER_TOO_SMALL
            );
            assert_eq!(len, 65_536);
            let mut ranks = vec![u32::MAX; len];
            assert_eq!(
                kvcs_handshake_targets(0, 1, 65_536, ranks.as_mut_ptr(), ranks.len(), &mut len),
                KVCS_OK
            );
            assert!(ranks.iter().enumerate().all(|(i, &rank)| rank == i as u32));
            assert_eq!(
                kvcs_topology_add_remote(topology, c"prefill".as_ptr(), &remote_engine(65_536), &mut added),
                KVCS_OK,
                "{}",
                last_error()
            );
            assert_eq!(added, 1);
            let sources = head_sources_of(|buf, cap, len| {
                kvcs_topology_head_sources(topology, c"prefill".as_ptr(), buf, cap, len)
            });
            // 8 heads on 65,536 ranks: each read once, from the first of its 8,192 holders.
            let expected: Vec<_> = (0..8u32).map(|h| (h * 8192, h, 1, h, 0)).collect();
            assert_eq!(sources.iter().map(fields).collect::<Vec<_>>(), expected);
            kvcs_topology_destroy(topology);
        },
    );
}
