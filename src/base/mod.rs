//! Layer 1, arithmetic and plumbing. Its modules, lowest first; each
//! imports only from those before it (`tests/it/module_imports.rs`).

// The engine's `Error`, mapped to a `kvcs_status` once, at the boundary.
pub(crate) mod error;
// The checksum arithmetic (SPEC sections 2, 3 and 12).
pub(crate) mod checksum;
// The 16 bytes stored per block for offloaded KV (SPEC section 8).
pub(crate) mod stored_entry;
// The bounded msgpack encoder and decoder of records and payloads.
pub(crate) mod msgpack;
// Transfer topology helpers and the completion counter (SPEC section 11).
pub mod topology;
