//! kvcsum's integration tests, one binary (`cargo test --test it`; one
//! concern: `cargo test --test it verify::`), one module per concern, with
//! the shared helpers and the naive reference of the SPEC in `support/`.
//! Tests that set process environment variables (`host_simd`,
//! `host_threads`) and the ones run alone with `--ignored` (`kernels`,
//! `gen_header`) and the GPU tests (`gpu`) are binaries of their own.

mod header_gen;
mod support;

mod aliases;
mod avalanche;
mod bindings_coverage;
mod block_arrays;
mod c_abi;
mod cost;
mod decoding;
mod docs;
mod fault_catalogue;
mod ffi_boundary;
mod four_byte_pieces;
mod header;
mod layer_from_layout;
mod layouts;
mod module_imports;
mod msgspec_compat;
mod repair_plan;
mod replicas;
mod spec;
mod state;
mod stored;
mod tier_index;
mod token_placement;
mod validation;
mod verdict_property;
mod verdicts;
mod verify;
mod verify_ffi;
mod wire_bytes;
