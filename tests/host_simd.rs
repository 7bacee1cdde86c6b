//! The host engine's SIMD forms of the mixing functions (AVX-512F, AVX2,
//! portable; `KVCS_HOST_SIMD` caps the form a worker runs): each form the
//! CPU has gives the naive reference's `c` in every layout, under MIXED2
//! and MIXED, for cells of whole cache lines and of partial ones. One test
//! in its own binary, since it sets the process's environment.

#[path = "it/support/mod.rs"]
mod support;

use kvcsum::Role;
use support::*;

#[test]
fn every_simd_form_gives_the_reference() {
    let mut rng = Rng::for_test("every_simd_form_gives_the_reference");
    let seed = rng.seed();
    // A bad value fails worker creation, naming it.
    std::env::set_var("KVCS_HOST_SIMD", "sse9");
    let error = kvcsum::Worker::new(kvcsum::WorkerOptions {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: None,
        num_threads: 1,
    })
    .err()
    .expect("KVCS_HOST_SIMD=sse9 is refused");
    assert!(
        matches!(&error, kvcsum::Error::InvalidArgument(m) if m.contains("KVCS_HOST_SIMD") && m.contains("sse9")),
        "{error:?}"
    );
    let mut forms_run = Vec::new();
    for form in ["avx512", "avx2", "portable"] {
        std::env::set_var("KVCS_HOST_SIMD", form);
        for algorithm in [kvcsum::Algorithm::Mixed2, kvcsum::Algorithm::Mixed] {
            with_algorithm(algorithm, || {
                // Cells of 2 (K 8 + V 8 bytes), 16 and 50 pieces: partial
                // lines, whole lines, lines and a tail.
                for head_bytes in [8u32, 64, 200] {
                    let block_size = 16;
                    let num_tokens = rng.range(20..70);
                    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 4, head_bytes, num_tokens));
                    let num_positions = positions_for(kv.num_tokens(), block_size, 0, 1);
                    let full = naive_full(&kv, block_size, 0, num_positions);
                    for kind in all_kinds() {
                        let num_blocks = 8;
                        let table = GroupTable {
                            group_id: 0,
                            first_position: 0,
                            block_ids: BlockAllocator::new(&mut rng, num_blocks).take(num_positions),
                        };
                        let deploy = Deploy {
                            tp_size: 1,
                            pp_size: 1,
                            kind,
                            group_id: 0,
                            block_size,
                            num_blocks,
                            num_threads: 1,
                        };
                        let ranks = deploy_host(&mut rng, deploy, &[(&kv, &table)]);
                        let request = TestRequest {
                            req_id: "r".to_owned(),
                            num_tokens: kv.num_tokens(),
                            tables: vec![table.clone()],
                        };
                        let blocks = block_set(&[request]);
                        let worker = &ranks[0].worker;
                        let description = worker.engine_description();
                        if !forms_run.contains(&description) {
                            forms_run.push(description.clone());
                        }
                        let values = columns_of(&checksum(worker, &blocks, Role::Producer), "r", 0);
                        assert_eq!(
                            values.values().next().unwrap(),
                            &full,
                            "seed {seed}: KVCS_HOST_SIMD={form}, {algorithm:?}, head bytes {head_bytes}, {kind:?} \
                             ({description})"
                        );
                    }
                }
            });
        }
    }
    std::env::remove_var("KVCS_HOST_SIMD");
    println!("forms run: {forms_run:#?}");
    // At least the portable form and whatever this CPU adds.
    assert!(
        forms_run.iter().any(|d| d.ends_with("portable mixing")),
        "{forms_run:?}"
    );
}
