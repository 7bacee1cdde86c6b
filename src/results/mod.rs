//! Layer 3, results. Its modules, lowest first; each imports only from
//! those before it (`tests/it/module_imports.rs`).

// The facts about a worker that its records carry.
pub(crate) mod record_facts;
// A call's checksums, and what a result carries to become a record.
pub(crate) mod checksums;
