//! Layer 5, engines, which take a layout and a plan (or the blocks to
//! plan), not a worker. Its modules, lowest first; each imports only from
//! those before it (`tests/it/module_imports.rs`).

// The host engine, its SIMD forms and its helper threads.
pub(crate) mod host;
// The device engine over cudarc.
pub(crate) mod cuda;
// Per-layer partials (detail mode).
pub(crate) mod detail;
// Stored checksums of offloaded KV (SPEC section 8).
pub(crate) mod stored;
