//! Cells of 4-byte pieces (SPEC section 1: vLLM's indexer cells, 128 key
//! bytes then a 4-byte scale) on a device worker: the kernel reads 8-byte
//! pieces only, so registration refuses such a layer, naming the layer,
//! its group and the cell size, and leaves the worker as it was (an 8-byte
//! piece layer registers after it and gives the reference), never a value
//! of other pieces. The host engine computes them (tests/it/four_byte_pieces.rs).

use kvcsum::Role;

use crate::common::*;
use crate::support::*;

#[test]
#[ignore = "needs a CUDA device"]
fn a_device_worker_refuses_cells_of_4_byte_pieces_naming_the_layer_and_cell_size() {
    let mut rng = Rng::for_test("a_device_worker_refuses_cells_of_4_byte_pieces_naming_the_layer_and_cell_size");
    let seed = rng.seed();
    let block_size = 16;
    let indexer = KvShape {
        first_layer: 3,
        num_layers: 1,
        first_head: 0,
        total_kv_heads: 1,
        k_bytes: 128,
        v_bytes: 4,
        num_tokens: 40,
    };
    let kv = LogicalKv::random(&mut rng, indexer);
    let mut placement = Placement::for_shard(
        &mut rng,
        &kv,
        &shard(&kv, 0, 1, 0, 1),
        LayoutKind::KeysThenScales,
        0,
        block_size,
        4,
    );
    placement.write_request(&kv, 0, &[2, 0, 3]);
    let copy = DeviceCopy::new(&placement);
    let mut worker = device_worker(0, 1);
    let error = register_at(&mut worker, &placement, &copy.bases).expect_err("4-byte pieces on a device worker");
    let message = error.to_string();
    for needle in ["layer_number 3", "group_id 0", "132 bytes", "4-byte pieces"] {
        assert!(message.contains(needle), "seed {seed}: {needle:?} in {message:?}");
    }
    assert!(
        worker.layout().group(0).is_some_and(|g| g.layers().is_empty()),
        "seed {seed}: nothing registered"
    );
    // The same worker still takes a layer of 8-byte pieces, and computes it.
    let mla = LogicalKv::random(&mut rng, KvShape::mla(1, 136, 40));
    let mut other = Placement::for_shard(
        &mut rng,
        &mla,
        &shard(&mla, 0, 1, 0, 1),
        LayoutKind::Hnd,
        1,
        block_size,
        4,
    );
    other.write_request(&mla, 0, &[1, 3, 0]);
    let other_copy = DeviceCopy::new(&other);
    register_at(&mut worker, &other, &other_copy.bases).expect("8-byte pieces");
    let blocks = block_set(&[TestRequest {
        req_id: "r".to_owned(),
        num_tokens: 40,
        tables: vec![GroupTable {
            group_id: 1,
            first_position: 0,
            block_ids: vec![1, 3, 0],
        }],
    }]);
    let values = columns_of(&checksum(&worker, &blocks, Role::Consumer), "r", 1);
    assert_eq!(
        values.values().next().expect("a column"),
        &naive_full(&mla, block_size, 0, 3),
        "seed {seed}"
    );
}
