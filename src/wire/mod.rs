//! Layer 7, the verifier's inputs as bytes. Its modules, lowest first;
//! each imports only from those before it (`tests/it/module_imports.rs`).

// A worker's checksums as a record (SPEC section 5).
pub mod record;
// The producer's payload (SPEC section 9).
pub mod payload;
