//! Bad input: each error of layout registration, block sets, plans, results
//! and workers, with its `Error` variant, a message naming the argument and
//! its value, and no state changed by the failed call (a later valid call
//! still works and gives the reference values).

use crate::support;

use kvcsum::SkippedGroup;
use kvcsum::{Error, LayerSpec, Region, ReplicaKey, Role, StreamHandle, Worker};
use support::*;

/// The error of `result`, after checking its variant (the name its `Debug`
/// starts with) and that its message contains every one of `needles`.
fn expect_error<T>(result: kvcsum::Result<T>, variant: &str, needles: &[&str], context: &str) -> Error {
    let error = match result {
        Ok(_) => panic!("{context}: expected a {variant} error, the call succeeded"),
        Err(error) => error,
    };
    let debug = format!("{error:?}");
    assert!(debug.starts_with(variant), "{context}: expected {variant}, got {debug}");
    let message = error.to_string();
    for needle in needles {
        assert!(
            message.contains(needle),
            "{context}: message {message:?} does not name {needle:?}"
        );
    }
    error
}

/// Everything a worker has registered, to compare before and after a call.
fn snapshot(worker: &Worker) -> String {
    format!("{:?}", worker.layout())
}

/// A small KV in one HND placement: 2 layers, 2 heads, 16-token blocks, 4
/// blocks, with a request of 40 tokens at blocks `table`.
struct Fixture {
    seed: u64,
    kv: LogicalKv,
    placement: Placement,
    table: GroupTable,
}

impl Fixture {
    fn new(rng: &mut Rng) -> Fixture {
        Fixture::with_kind(rng, LayoutKind::Hnd)
    }

    fn with_kind(rng: &mut Rng, kind: LayoutKind) -> Fixture {
        let mut shape = KvShape::gqa(2, 2, 16, 40);
        shape.first_layer = 7;
        let kv = LogicalKv::random(rng, shape);
        let table = GroupTable {
            group_id: 0,
            first_position: 0,
            block_ids: BlockAllocator::new(rng, 4).take(3),
        };
        let shard = shard(&kv, 0, 1, 0, 1);
        let mut placement = Placement::for_shard(rng, &kv, &shard, kind, 0, 16, 4);
        placement.write_request(&kv, 0, &table.block_ids);
        Fixture {
            seed: rng.seed(),
            kv,
            placement,
            table,
        }
    }

    /// A worker with the regions and group registered, no layers.
    fn bare_worker(&self) -> Worker {
        let mut worker = host_worker(0, 1, 0, 1);
        for region in self.placement.regions(&self.placement.host_bases()) {
            worker.add_region(region).unwrap();
        }
        worker.add_group(0, 16).unwrap();
        worker
    }

    fn specs(&self) -> Vec<LayerSpec> {
        self.placement.host_layer_specs()
    }

    fn request(&self) -> TestRequest {
        TestRequest {
            req_id: "r".into(),
            num_tokens: self.kv.num_tokens(),
            tables: vec![self.table.clone()],
        }
    }

    /// Registers the valid layers (where not yet) and checks the worker's
    /// values against the reference.
    fn assert_works(&self, worker: &mut Worker, context: &str) {
        for spec in self.specs() {
            let registered = worker
                .layout()
                .group(spec.group_id)
                .is_some_and(|g| g.layers().iter().any(|l| l.spec == spec));
            if !registered {
                worker.add_layer(spec).expect("valid layer after a failed call");
            }
        }
        let result = checksum(worker, &block_set(&[self.request()]), Role::Producer);
        let expected = naive_full(&self.kv, 16, 0, self.table.block_ids.len());
        let (_, values) = result.column("r", 0, 0).unwrap();
        assert_eq!(
            values,
            expected.as_slice(),
            "seed {}, {context}: values after a failed call",
            self.seed
        );
    }
}

/// Tries `spec` on `worker`, expecting an error; the layout must not change.
fn reject_layer(worker: &mut Worker, spec: LayerSpec, variant: &str, needles: &[&str], context: &str) -> Error {
    let before = snapshot(worker);
    let error = expect_error(worker.add_layer(spec), variant, needles, context);
    assert_eq!(
        snapshot(worker),
        before,
        "{context}: a failed add_layer changed the layout"
    );
    error
}

#[test]
fn bad_regions_groups_and_skips_are_rejected() {
    let mut rng = Rng::for_test("bad_regions_groups_and_skips_are_rejected");
    let fixture = Fixture::new(&mut rng);
    let mut worker = fixture.bare_worker();
    let before = snapshot(&worker);

    let zero = Region {
        address: 0x1000,
        length: 0,
    };
    expect_error(
        worker.add_region(zero),
        "InvalidArgument",
        &["length is 0", "0x1000"],
        "empty region",
    );
    expect_error(
        worker.add_group(3, 0),
        "InvalidArgument",
        &["block_size is 0", "group_id 3"],
        "block size 0",
    );
    expect_error(
        worker.add_group(0, 32),
        "InvalidArgument",
        &["group_id 0", "already registered"],
        "dup group",
    );
    expect_error(
        worker.skip_group(5, ""),
        "InvalidArgument",
        &["reason is empty", "group_id 5"],
        "empty reason",
    );
    assert_eq!(snapshot(&worker), before, "failed calls changed the layout");

    worker.skip_group(5, "state layout unknown").unwrap();
    let after_skip = snapshot(&worker);
    expect_error(
        worker.skip_group(5, "again"),
        "InvalidArgument",
        &["group_id 5", "already skipped"],
        "dup skip",
    );
    assert_eq!(snapshot(&worker), after_skip, "a failed skip_group changed the layout");
    assert_eq!(worker.layout().skip_reason(5), Some("state layout unknown"));
    fixture.assert_works(&mut worker, "after bad regions and groups");
}

#[test]
fn malformed_layers_are_rejected_and_change_nothing() {
    let mut rng = Rng::for_test("malformed_layers_are_rejected_and_change_nothing");
    let fixture = Fixture::new(&mut rng);
    let mut worker = fixture.bare_worker();
    let good = fixture.specs()[0].clone();
    let layer = good.layer_number;
    let named = format!("layer_number {layer}");

    let mut spec = good.clone();
    // 10 bytes are no whole number of pieces, 8- or 4-byte (SPEC section 1).
    spec.segments[0].bytes_per_token = 10;
    reject_layer(
        &mut worker,
        spec,
        "InvalidArgument",
        &["segments[0].bytes_per_token 10", &named],
        "10 bytes",
    );
    let mut spec = good.clone();
    spec.segments[0].bytes_per_token = 0;
    reject_layer(&mut worker, spec, "InvalidArgument", &["bytes_per_token 0"], "0 bytes");

    // Unaligned addresses and strides are unsupported, whatever the field.
    let address = good.segments[0].address + 4;
    let mut spec = good.clone();
    spec.segments[0].address = address;
    reject_layer(
        &mut worker,
        spec,
        "Unsupported",
        &[&format!("segments[0].address {address}"), &named],
        "address",
    );
    let mut spec = good.clone();
    spec.segments[0].token_stride = 36;
    reject_layer(
        &mut worker,
        spec,
        "Unsupported",
        &["segments[0].token_stride 36"],
        "token_stride",
    );
    let mut spec = good.clone();
    spec.segments[0].head_stride += 4;
    let head_stride = format!("segments[0].head_stride {}", good.segments[0].head_stride + 4);
    reject_layer(&mut worker, spec, "Unsupported", &[&head_stride], "head_stride");
    let mut spec = good.clone();
    spec.segments[0].block_stride = -4;
    reject_layer(
        &mut worker,
        spec,
        "Unsupported",
        &["segments[0].block_stride -4"],
        "block_stride",
    );
    let mut spec = good.clone();
    spec.segments[0].kernel_block_stride = 12;
    reject_layer(
        &mut worker,
        spec,
        "Unsupported",
        &["segments[0].kernel_block_stride 12"],
        "kernel stride",
    );

    // Heads: at most 65536 per layer.
    let mut spec = good.clone();
    spec.first_head = 65535;
    spec.num_heads = 2;
    reject_layer(
        &mut worker,
        spec,
        "Unsupported",
        &["first_head 65535", "num_heads 2", "65536", &named],
        "heads",
    );
    let mut spec = good.clone();
    spec.num_heads = 0;
    reject_layer(
        &mut worker,
        spec,
        "InvalidArgument",
        &["num_heads is 0", &named],
        "no heads",
    );

    // Kernel blocks must tile the block size.
    let mut spec = good.clone();
    spec.kernel_blocks = 3;
    spec.tokens_per_kernel_block = 5;
    let tiles = ["kernel_blocks 3", "tokens_per_kernel_block 5", "block_size 16", &named];
    reject_layer(&mut worker, spec, "InvalidArgument", &tiles, "3 x 5");
    let mut spec = good.clone();
    spec.kernel_blocks = 0;
    reject_layer(
        &mut worker,
        spec,
        "InvalidArgument",
        &["kernel_blocks 0"],
        "0 kernel blocks",
    );
    let mut spec = good.clone();
    spec.kernel_blocks = 2;
    reject_layer(
        &mut worker,
        spec,
        "InvalidArgument",
        &["kernel_blocks 2", "tokens_per_kernel_block 16"],
        "2 x 16",
    );

    let mut spec = good.clone();
    spec.group_id = 99;
    reject_layer(&mut worker, spec, "NotFound", &["group_id 99", &named], "unknown group");

    // Replica keys.
    let mut spec = good.clone();
    spec.replica = ReplicaKey {
        replicas: 2,
        replica_index: 2,
    };
    let needles = ["replica_index 2", "replicas 2", &named];
    reject_layer(&mut worker, spec, "InvalidArgument", &needles, "replica index");
    let mut spec = good.clone();
    spec.replica = ReplicaKey {
        replicas: 0,
        replica_index: 0,
    };
    reject_layer(&mut worker, spec, "InvalidArgument", &["replicas is 0"], "replicas 0");

    // One or two segments.
    let mut spec = good.clone();
    spec.segments.clear();
    reject_layer(
        &mut worker,
        spec,
        "InvalidArgument",
        &["num_segments is 0", &named],
        "no segment",
    );
    let mut spec = good.clone();
    spec.segments = vec![good.segments[0]; 3];
    reject_layer(
        &mut worker,
        spec,
        "InvalidArgument",
        &["num_segments is 3"],
        "3 segments",
    );

    let mut spec = good.clone();
    spec.num_blocks = 0;
    reject_layer(
        &mut worker,
        spec,
        "InvalidArgument",
        &["num_blocks is 0", &named],
        "no blocks",
    );

    // A cache larger than its region.
    let mut spec = good.clone();
    spec.num_blocks = 5;
    reject_layer(
        &mut worker,
        spec,
        "OutOfBounds",
        &["segments[0]", &named, "no registered region"],
        "5 blocks",
    );

    assert!(worker.layout().group(0).unwrap().layers().is_empty());
    fixture.assert_works(&mut worker, "after malformed layers");
}

#[test]
fn the_last_allowed_head_is_accepted() {
    let mut rng = Rng::for_test("the_last_allowed_head_is_accepted");
    let fixture = Fixture::new(&mut rng);
    let mut worker = fixture.bare_worker();
    // In a group of its own, so that group 0's values stay the reference's.
    worker.add_group(1, 16).unwrap();
    let mut spec = fixture.specs()[0].clone();
    spec.group_id = 1;
    spec.layer_number = 1000;
    spec.first_head = 65535;
    spec.num_heads = 1;
    worker.add_layer(spec).expect("head 65535 is the last allowed");
    fixture.assert_works(&mut worker, "beside head 65535 of another layer");
}

#[test]
fn overlapping_heads_of_one_layer_are_rejected() {
    let mut rng = Rng::for_test("overlapping_heads_of_one_layer_are_rejected");
    let fixture = Fixture::new(&mut rng);
    let mut worker = fixture.bare_worker();
    worker.add_group(1, 16).unwrap();
    let good = fixture.specs()[0].clone();
    worker.add_layer(good.clone()).unwrap();
    let layer = good.layer_number;
    let named = format!("layer_number {layer}");

    reject_layer(
        &mut worker,
        good.clone(),
        "InvalidArgument",
        &["heads 0..2", &named, "overlap"],
        "twice",
    );
    let mut spec = good.clone();
    spec.first_head = 1;
    spec.num_heads = 1;
    reject_layer(
        &mut worker,
        spec,
        "InvalidArgument",
        &["heads 1..2", "overlap"],
        "partly",
    );
    // The same layer's heads in another group overlap too.
    let mut spec = good.clone();
    spec.group_id = 1;
    reject_layer(&mut worker, spec, "InvalidArgument", &["overlap"], "other group");
    // Heads that follow (a second cache of the layer) are fine.
    let mut spec = good.clone();
    spec.first_head = 2;
    worker
        .add_layer(spec)
        .expect("heads 2..4 of the same layer do not overlap 0..2");
}

/// Per buffer, the bytes `[low, high)` that the placement's cells occupy,
/// found by visiting every cell.
fn tight_extents(placement: &Placement) -> Vec<(usize, usize)> {
    let spec = placement.spec().clone();
    let mut extents = vec![(usize::MAX, 0usize); placement.buffers().len()];
    for &layer in &spec.layer_numbers {
        for head in spec.first_head..spec.first_head + spec.num_heads {
            for block in 0..spec.num_blocks {
                for slot in 0..spec.block_size {
                    for byte in (0..spec.k_bytes + spec.v_bytes).step_by(8) {
                        let (buffer, at) = placement.locate(layer, head, block, slot, byte);
                        let extent = &mut extents[buffer];
                        extent.0 = extent.0.min(at);
                        extent.1 = extent.1.max(at + 8);
                    }
                }
            }
        }
    }
    extents
}

/// A layer whose distinct cells share bytes (a stride of 0 over more than
/// one index, cells closer than their size, V over K) is refused: both
/// sides registered alike would match while bytes neither reads were
/// corrupt. The real layout beside it, and K and V as two segments of one
/// cell, are accepted and give the reference values.
#[test]
fn layers_whose_cells_share_bytes_are_refused_and_change_nothing() {
    let mut rng = Rng::for_test("layers_whose_cells_share_bytes_are_refused_and_change_nothing");
    let fixture = Fixture::new(&mut rng);
    let mut worker = fixture.bare_worker();
    let good = fixture.specs()[0].clone();
    let named = format!("layer_number {}", good.layer_number);
    let k = good.segments[0];
    let cell = k.bytes_per_token as i64;
    let closer = cell - 8 * rng.range(1..cell as u64 / 8) as i64;
    let k_bytes = 8 * rng.range(1..cell as u64 / 8) as u32;
    let split = |v_address: u64, v_block_stride: i64| {
        let mut spec = good.clone();
        spec.segments[0].bytes_per_token = k_bytes;
        let mut v = k;
        v.address = v_address;
        v.block_stride = v_block_stride;
        v.bytes_per_token = k.bytes_per_token - k_bytes;
        spec.segments.push(v);
        spec
    };
    type Edit = Box<dyn Fn(&mut LayerSpec)>;
    let cases: Vec<(&str, Edit, Vec<String>)> = vec![
        (
            "every token one cell",
            Box::new(|spec| spec.segments[0].token_stride = 0),
            vec!["segments[0]".into(), "token_stride 0".into()],
        ),
        (
            "tokens closer than a cell",
            Box::new(move |spec| spec.segments[0].token_stride = closer),
            vec![format!("token_stride {closer}"), format!("the {cell} bytes")],
        ),
        (
            "tokens closer than a cell, walking down",
            Box::new(move |spec| spec.segments[0].token_stride = -closer),
            vec![format!("token_stride -{closer}")],
        ),
        (
            "every head one",
            Box::new(|spec| spec.segments[0].head_stride = 0),
            vec!["head_stride 0".into()],
        ),
        (
            "heads one token apart",
            Box::new(move |spec| spec.segments[0].head_stride = cell),
            vec!["share bytes".into()],
        ),
        (
            "blocks one head apart",
            Box::new(move |spec| spec.segments[0].block_stride = k.head_stride),
            vec!["share bytes".into()],
        ),
        (
            "logical blocks sharing kernel blocks",
            Box::new(move |spec| {
                spec.kernel_blocks = 2;
                spec.tokens_per_kernel_block = 8;
                spec.segments[0].kernel_block_stride = k.block_stride;
            }),
            vec!["share bytes".into()],
        ),
    ];
    for (context, edit, needles) in cases {
        let mut spec = good.clone();
        edit(&mut spec);
        let mut needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        needles.extend(["share bytes", named.as_str()]);
        reject_layer(&mut worker, spec, "InvalidArgument", &needles, context);
    }
    // V over K: at K's address, inside K's cells, or with other strides over K's cells.
    let last_block = (good.num_blocks as i64 - 1) * k.block_stride;
    let pair_cases = [
        ("V at K's address", split(k.address, k.block_stride)),
        (
            "V inside K's cells",
            split(k.address + 8 * rng.below(k_bytes as u64 / 8), k.block_stride),
        ),
        // V's blocks in reverse, block b over K's block num_blocks - 1 - b.
        (
            "V with other strides over K",
            split(k.address + last_block as u64, -k.block_stride),
        ),
    ];
    for (context, spec) in pair_cases {
        reject_layer(
            &mut worker,
            spec,
            "InvalidArgument",
            &[
                "segments[0] (bytes",
                "segments[1] (bytes",
                "K and V must not overlap",
                &named,
            ],
            context,
        );
    }
    fixture.assert_works(&mut worker, "after layers whose cells share bytes");

    // K then V as two segments of the same cell: accepted, the same values.
    let mut split_worker = fixture.bare_worker();
    split_worker
        .add_layer(split(k.address + k_bytes as u64, k.block_stride))
        .expect("K and V side by side");
    for spec in fixture.specs().into_iter().skip(1) {
        split_worker.add_layer(spec).expect("the other layers");
    }
    let result = checksum(&split_worker, &block_set(&[fixture.request()]), Role::Producer);
    let expected = naive_full(&fixture.kv, 16, 0, fixture.table.block_ids.len());
    assert_eq!(
        result.column("r", 0, 0).unwrap().1,
        expected.as_slice(),
        "seed {}: K and V as two segments of one cell",
        fixture.seed
    );
}

#[test]
fn layers_reaching_outside_every_region_are_rejected() {
    let mut rng = Rng::for_test("layers_reaching_outside_every_region_are_rejected");
    let seed = rng.seed();
    for kind in all_kinds() {
        let fixture = Fixture::with_kind(&mut rng, kind);
        let placement = &fixture.placement;
        let bases = placement.host_bases();
        let extents = tight_extents(placement);
        let regions = |shrink: Option<(usize, bool)>| -> Vec<Region> {
            extents
                .iter()
                .enumerate()
                .map(|(i, &(low, high))| {
                    let (mut low, mut high) = (low as u64, high as u64);
                    match shrink {
                        Some((buffer, true)) if buffer == i => low += 8,
                        Some((buffer, false)) if buffer == i => high -= 8,
                        _ => {}
                    }
                    Region {
                        address: bases[i] + low,
                        length: high - low,
                    }
                })
                .collect()
        };
        // Regions exactly around the cells are enough.
        let mut worker = host_worker(0, 1, 0, 1);
        for region in regions(None) {
            worker.add_region(region).unwrap();
        }
        worker.add_group(0, 16).unwrap();
        fixture.assert_works(&mut worker, &format!("{kind:?}, tight regions"));

        // 8 bytes less at either end of any buffer: some layer reaches outside.
        for buffer in 0..extents.len() {
            for at_start in [true, false] {
                let context = format!(
                    "seed {seed}, {kind:?}, buffer {buffer} shrunk at the {}",
                    if at_start { "start" } else { "end" }
                );
                let mut worker = host_worker(0, 1, 0, 1);
                for region in regions(Some((buffer, at_start))) {
                    worker.add_region(region).unwrap();
                }
                worker.add_group(0, 16).unwrap();
                let mut rejected = 0;
                for spec in fixture.specs() {
                    let named = format!("layer_number {}", spec.layer_number);
                    let before = snapshot(&worker);
                    match worker.add_layer(spec) {
                        Ok(()) => {}
                        Err(error) => {
                            assert!(matches!(error, Error::OutOfBounds(_)), "{context}: {error:?}");
                            let message = error.to_string();
                            assert!(
                                message.contains("segments[") && message.contains(&named),
                                "{context}: message {message:?}"
                            );
                            assert_eq!(
                                snapshot(&worker),
                                before,
                                "{context}: failed add_layer changed the layout"
                            );
                            rejected += 1;
                        }
                    }
                }
                assert!(rejected > 0, "{context}: every layer was accepted");
            }
        }
    }
}

#[test]
fn bad_block_ids_fail_the_whole_call() {
    let mut rng = Rng::for_test("bad_block_ids_fail_the_whole_call");
    let fixture = Fixture::new(&mut rng);
    let mut worker = fixture.bare_worker();
    for spec in fixture.specs() {
        worker.add_layer(spec).unwrap();
    }
    let good = fixture.request();
    for (bad_id, position_past_end) in [(4u32, false), (u32::MAX, false), (4, true)] {
        // The valid request first: nothing of it may come back either.
        let mut blocks = block_set(std::slice::from_ref(&good));
        blocks.add_request("b", 40).unwrap();
        let (first_position, ids) = if position_past_end {
            // Position 5 holds no tokens of 40 but its id is still checked.
            (4, vec![1, bad_id])
        } else {
            (0, vec![0, bad_id, 1])
        };
        blocks.add_group("b", 0, first_position, &ids).unwrap();
        let position = first_position + 1;
        let needles = [
            format!("block id {bad_id}"),
            format!("position {position}"),
            "req_id \"b\"".to_owned(),
            "group_id 0".to_owned(),
            "num_blocks 4".to_owned(),
        ];
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        let context = format!("block id {bad_id} at position {position}");
        for role in [Role::Producer, Role::Consumer] {
            expect_error(
                worker.checksum(&blocks, role, StreamHandle::legacy_default()),
                "OutOfBounds",
                &needles,
                &context,
            );
        }
    }
    // An unknown group fails the call as well.
    let mut blocks = block_set(std::slice::from_ref(&good));
    blocks.add_request("g", 40).unwrap();
    blocks.add_group("g", 42, 0, &[0]).unwrap();
    let needles = ["group_id 42", "req_id \"g\"", "not registered"];
    expect_error(
        worker.checksum(&blocks, Role::Producer, StreamHandle::legacy_default()),
        "NotFound",
        &needles,
        "group",
    );
    fixture.assert_works(&mut worker, "after bad block ids");
}

#[test]
fn block_ids_are_checked_against_the_smallest_cache_of_the_group() {
    let mut rng = Rng::for_test("block_ids_are_checked_against_the_smallest_cache_of_the_group");
    let seed = rng.seed();
    // Layer 0 has 6 blocks, layer 1 only 4: block ids must be below 4.
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 1, 8, 16));
    let mut worker = host_worker(0, 1, 0, 1);
    let mut placements = Vec::new();
    for (layer, num_blocks) in [(0u32, 6u32), (1, 4)] {
        let spec = CacheSpec {
            kind: LayoutKind::Nhd,
            group_id: 0,
            block_size: 8,
            num_blocks,
            layer_numbers: vec![layer],
            first_head: 0,
            num_heads: 1,
            replica: ReplicaKey {
                replicas: 1,
                replica_index: 0,
            },
            k_bytes: 8,
            v_bytes: 8,
        };
        let mut placement = Placement::new(&mut rng, spec);
        placement.write_request(&kv, 0, &[3, 1]);
        register_host(&mut worker, &placement);
        placements.push(placement);
    }
    let mut blocks = kvcsum::BlockSet::new();
    blocks.add_request("r", 16).unwrap();
    blocks.add_group("r", 0, 0, &[3, 4]).unwrap();
    let needles = ["block id 4", "num_blocks 4"];
    expect_error(
        worker.checksum(&blocks, Role::Consumer, StreamHandle::legacy_default()),
        "OutOfBounds",
        &needles,
        "min",
    );
    let mut blocks = kvcsum::BlockSet::new();
    blocks.add_request("r", 16).unwrap();
    blocks.add_group("r", 0, 0, &[3, 1]).unwrap();
    let result = checksum(&worker, &blocks, Role::Consumer);
    let (_, values) = result.column("r", 0, 0).unwrap();
    assert_eq!(values, naive_full(&kv, 8, 0, 2).as_slice(), "seed {seed}");
}

#[test]
fn result_accessors_report_unknown_names() {
    let mut rng = Rng::for_test("result_accessors_report_unknown_names");
    let fixture = Fixture::new(&mut rng);
    let mut worker = fixture.bare_worker();
    for spec in fixture.specs() {
        worker.add_layer(spec).unwrap();
    }
    let result = checksum(&worker, &block_set(&[fixture.request()]), Role::Producer);
    expect_error(
        result.group("nope", 0),
        "NotFound",
        &["req_id \"nope\""],
        "unknown request",
    );
    expect_error(
        result.group("r", 9),
        "NotFound",
        &["group_id 9", "req_id \"r\""],
        "unknown group",
    );
    expect_error(
        result.column("nope", 0, 0),
        "NotFound",
        &["req_id \"nope\""],
        "column of unknown request",
    );
    expect_error(
        result.column("r", 9, 0),
        "NotFound",
        &["group_id 9"],
        "column of unknown group",
    );
    let needles = ["column 1", "num_columns 1", "req_id \"r\"", "group_id 0"];
    expect_error(result.column("r", 0, 1), "OutOfBounds", &needles, "column past the end");
    let (_, values) = result.column("r", 0, 0).unwrap();
    let expected = naive_full(&fixture.kv, 16, 0, 3);
    assert_eq!(values, expected.as_slice(), "seed {}", fixture.seed);
}

#[test]
fn bad_block_sets_are_rejected_and_change_nothing() {
    let mut blocks = kvcsum::BlockSet::new();
    blocks.add_request("a", 10).unwrap();
    blocks.add_group("a", 0, 2, &[5, 6]).unwrap();
    let before = format!("{:?}", blocks.requests());
    expect_error(
        blocks.add_request("a", 3),
        "InvalidArgument",
        &["req_id \"a\"", "already"],
        "dup request",
    );
    expect_error(
        blocks.add_request("", 3),
        "InvalidArgument",
        &["req_id is empty"],
        "empty req_id",
    );
    expect_error(
        blocks.add_group("zz", 0, 0, &[1]),
        "NotFound",
        &["req_id \"zz\""],
        "group of unknown request",
    );
    let needles = ["group_id 0", "req_id \"a\"", "already"];
    expect_error(
        blocks.add_group("a", 0, 0, &[1]),
        "InvalidArgument",
        &needles,
        "dup group",
    );
    let needles = ["first_position 18446744073709551615", "overflows"];
    expect_error(
        blocks.add_group("a", 1, u64::MAX, &[1]),
        "InvalidArgument",
        &needles,
        "position overflow",
    );
    assert_eq!(
        format!("{:?}", blocks.requests()),
        before,
        "failed calls changed the block set"
    );
    blocks.add_group("a", 1, 0, &[1]).unwrap();
    assert_eq!(blocks.request("a").unwrap().groups.len(), 2);
}

#[test]
fn skipped_groups_are_listed_and_never_computed() {
    let mut rng = Rng::for_test("skipped_groups_are_listed_and_never_computed");
    let fixture = Fixture::new(&mut rng);
    let mut worker = fixture.bare_worker();
    for spec in fixture.specs() {
        worker.add_layer(spec).unwrap();
    }
    let reason = "mamba state layout unknown";
    worker.skip_group(3, reason).unwrap();
    let mut with_skipped = fixture.request();
    with_skipped.tables.insert(
        0,
        GroupTable {
            group_id: 3,
            first_position: 0,
            block_ids: vec![7, 8, 9],
        },
    );
    let only_skipped = TestRequest {
        req_id: "s".into(),
        num_tokens: 40,
        tables: vec![GroupTable {
            group_id: 3,
            first_position: 1,
            block_ids: vec![2],
        }],
    };
    let result = checksum(&worker, &block_set(&[with_skipped, only_skipped]), Role::Consumer);
    let skipped = vec![SkippedGroup {
        group_id: 3,
        reason: reason.into(),
    }];
    let requests = result.requests();
    assert_eq!(requests[0].skipped, skipped);
    assert_eq!(
        requests[0].groups.iter().map(|g| g.group_id).collect::<Vec<_>>(),
        vec![0]
    );
    assert_eq!(requests[1].req_id, "s");
    assert_eq!(requests[1].skipped, skipped);
    assert!(requests[1].groups.is_empty());
    expect_error(
        result.group("r", 3),
        "NotFound",
        &["group_id 3", "skipped", reason],
        "skipped group",
    );
    // Only group 0's values exist: 3 positions, one column.
    assert_eq!(result.values().unwrap().len(), 3);
    let (_, values) = result.column("r", 0, 0).unwrap();
    let expected = naive_full(&fixture.kv, 16, 0, 3);
    assert_eq!(values, expected.as_slice(), "seed {}", fixture.seed);
}

/// What a block set counts as blocks are added (its groups, its block ids,
/// each group's largest id: what a call sizes and checks with) against the
/// same read off its requests, after random adds, failed adds among them.
#[test]
fn block_set_counts_follow_every_add() {
    let mut rng = Rng::for_test("block_set_counts_follow_every_add");
    let seed = rng.seed();
    for trial in 0..200 {
        let mut blocks = kvcsum::BlockSet::new();
        let mut req_ids: Vec<String> = Vec::new();
        for step in 0..rng.range(1..40) {
            let context = format!("seed {seed}, trial {trial}, step {step}");
            if req_ids.is_empty() || rng.chance(1, 4) {
                let req_id = format!("r{}", rng.below(12));
                if blocks.add_request(&req_id, rng.below(1000)).is_ok() {
                    req_ids.push(req_id);
                }
            } else {
                // Repeated groups, unknown requests and overflowing
                // positions fail and must count nothing.
                let req_id = if rng.chance(1, 8) {
                    "unknown".to_owned()
                } else {
                    rng.pick(&req_ids).clone()
                };
                let first_position = if rng.chance(1, 8) {
                    u64::MAX - rng.below(3)
                } else {
                    rng.below(50)
                };
                let ids: Vec<u32> = (0..rng.below(20))
                    .map(|_| {
                        if rng.chance(1, 4) {
                            rng.next_u64() as u32
                        } else {
                            rng.below(64) as u32
                        }
                    })
                    .collect();
                let _ = blocks.add_group(&req_id, rng.below(4) as u32, first_position, &ids);
            }
            let groups: Vec<&kvcsum::GroupBlocks> = blocks.requests().iter().flat_map(|r| &r.groups).collect();
            assert_eq!(blocks.num_groups(), groups.len(), "{context}: groups");
            let num_blocks: usize = groups.iter().map(|g| g.block_ids.len()).sum();
            assert_eq!(blocks.num_blocks(), num_blocks, "{context}: block ids");
            for group in groups {
                let mut largest = 0;
                for &id in &group.block_ids {
                    if id > largest {
                        largest = id;
                    }
                }
                assert_eq!(group.max_block_id(), largest, "{context}: {group:?}");
            }
        }
    }
}

/// Random block sets with ids past the cache here and there: a call fails
/// exactly when some id is, naming the first one in request, group and
/// position order, and otherwise takes them all.
#[test]
fn random_bad_block_ids_are_all_found() {
    let mut rng = Rng::for_test("random_bad_block_ids_are_all_found");
    let fixture = Fixture::new(&mut rng);
    let mut worker = fixture.bare_worker();
    for spec in fixture.specs() {
        worker.add_layer(spec).unwrap();
    }
    let seed = rng.seed();
    for trial in 0..300 {
        let mut blocks = kvcsum::BlockSet::new();
        let mut first_bad = None;
        for r in 0..rng.range(1..5) {
            let req_id = format!("q{r}");
            blocks.add_request(&req_id, rng.below(100)).unwrap();
            let first_position = rng.below(6);
            let ids: Vec<u32> = (0..rng.below(6))
                .map(|_| match rng.below(20) {
                    0 => u32::MAX,
                    1 => rng.range(4..u32::MAX as u64) as u32,
                    2 => 4,
                    _ => rng.below(4) as u32,
                })
                .collect();
            for (i, &id) in ids.iter().enumerate() {
                if id >= 4 && first_bad.is_none() {
                    first_bad = Some((req_id.clone(), first_position + i as u64, id));
                }
            }
            blocks.add_group(&req_id, 0, first_position, &ids).unwrap();
        }
        let context = format!("seed {seed}, trial {trial}");
        let result = worker.checksum(&blocks, Role::Producer, StreamHandle::legacy_default());
        match first_bad {
            Some((req_id, position, id)) => {
                let needles = [
                    format!("block id {id} at position {position} of req_id \"{req_id}\""),
                    "num_blocks 4".to_owned(),
                ];
                let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
                expect_error(result, "OutOfBounds", &needles, &context);
            }
            None => {
                // The values of good ids are checked elsewhere; here, the
                // call takes them all, every position in its place.
                let result = result.unwrap_or_else(|e| panic!("{context}: {e}"));
                for request in blocks.requests() {
                    let (_, values) = result.column(&request.req_id, 0, 0).unwrap();
                    assert_eq!(values.len(), request.groups[0].block_ids.len(), "{context}");
                }
            }
        }
    }
}
