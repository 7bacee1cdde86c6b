//! GPU tests: the device engine gives the host engine's values bit for bit
//! (and so the naive reference's) on every layout, TP split, replica and
//! role, and rejects bad input as the host engine does. One file per
//! concern: attention caches (`attention`), stored checksums (`stored`),
//! state layers (`state`); what they share is in `common` (device copies,
//! host/device worker pairs) and `streams` (the stream rule's scaffolding).
//!
//! They need a CUDA device, so they are `#[ignore]`d and reported as ignored
//! where none is; on a GPU machine run `cargo test --release --test gpu --
//! --include-ignored` (scripts/gpu-run.sh also runs them under
//! compute-sanitizer memcheck and racecheck).

#[path = "../it/support/mod.rs"]
mod support;

mod attention;
mod common;
mod four_byte_pieces;
mod placement;
mod state;
mod stored;
mod streams;
