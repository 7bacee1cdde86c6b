//! Shared test support: a seeded PRNG, a logical KV model with a deliberately
//! naive reference of SPEC sections 2-3, layout builders that place logical KV
//! (or a TP/PP shard of it) into byte buffers, and helpers to register those
//! buffers on a `kvcsum::Worker` and read its results. Beside them: owning
//! wrappers over the C ABI (`handles`), records and payloads written by hand
//! (`hand_made_records`, with the msgpack writer `msgpack`), and a child
//! process under an address-space limit (`address_limit`).
//!
//! Placements keep their bytes in host buffers and describe their caches
//! relative to each buffer's base address ([`Placement::layer_specs`]), so the
//! same placement can be copied to device memory and registered there.
//!
//! Reproduce a failure with the seed the failing test printed:
//! `KVCS_TEST_SEED=<seed> cargo test <test name> -- --nocapture`.

#![allow(dead_code)]

pub mod address_limit;
pub mod faults;
pub mod hand_made_records;
pub mod handles;
mod layouts;
pub mod msgpack;
mod random;
mod reference;
mod requests;
mod shards;
pub mod state;
pub mod token_placement;
mod workers;

pub use layouts::*;
pub use random::*;
pub use reference::*;
pub use requests::*;
pub use shards::*;
pub use workers::*;
