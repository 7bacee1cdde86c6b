//! Layer 2, inputs: what a caller registers and hands to a call. Its
//! modules, lowest first; each imports only from those before it
//! (`tests/it/module_imports.rs`).

// How an engine reads a layer's bytes back (element type, head size, scales).
pub(crate) mod decoding;
// Where a group's tokens sit in a worker's caches (SPEC section 16).
pub(crate) mod placement;
// State (Mamba) layers.
pub(crate) mod state;
// Which columns a worker computes (SPEC section 4).
pub(crate) mod role;
// Regions, layers, segments, aliases, replicas.
pub(crate) mod layout;
// A layer's geometry from a strided tensor and a layout string (SPEC section 14).
pub(crate) mod layout_string;
// A call's requests and their block ids.
pub(crate) mod blocks;
// Group fingerprints (SPEC section 7).
pub(crate) mod fingerprint;
// The caller's CUDA stream.
pub(crate) mod stream;
