//! kvcsum: connector-agnostic checksums of LLM KV-cache blocks.
//!
//! The engine (this crate's modules outside `ffi`) is plain Rust: layouts
//! ([`layout`]), request block sets ([`blocks`]), the definition
//! ([`checksum`]), the host and device engines, and results. [`ffi`] is the C
//! boundary and nothing else.

#![warn(missing_docs)]

pub mod blocks;
pub mod checksum;
pub mod cuda;
pub mod detail;
pub mod error;
pub mod ffi;
pub mod fingerprint;
pub mod host;
pub mod layout;
pub(crate) mod msgpack;
pub mod payload;
pub mod plan;
pub mod record;
pub mod result;
pub mod topology;
pub mod verify;
pub mod worker;

pub use blocks::BlockSet;
pub use error::{Error, Result};
pub use layout::{LayerSpec, Layout, Region, ReplicaKey, Role, Segment};
pub use result::Checksums;
pub use worker::{StreamHandle, Worker, WorkerOptions};
