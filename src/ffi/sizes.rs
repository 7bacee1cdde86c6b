//! The size of every struct the C ABI passes, so that a binding that does
//! not read the header (Python's ctypes, a dlopen loader) can check its own
//! definitions against the loaded library: `KVCS_ABI_VERSION` says which
//! calls exist, these say whether the structs still have the shape it knows.

use std::mem::size_of;

use super::layout_string::kvcs_tensor;
use super::repair::kvcs_repair_block;
use super::report::{kvcs_layer_difference, kvcs_mismatch};
use super::topology::{kvcs_head_source, kvcs_local_engine, kvcs_remote_engine};
use super::worker::{kvcs_layer, kvcs_segment, kvcs_state, kvcs_state_tensor, kvcs_worker_options};

/// `sizeof(kvcs_worker_options)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_worker_options_size() -> usize {
    size_of::<kvcs_worker_options>()
}

/// `sizeof(kvcs_segment)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_segment_size() -> usize {
    size_of::<kvcs_segment>()
}

/// `sizeof(kvcs_layer)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_layer_size() -> usize {
    size_of::<kvcs_layer>()
}

/// `sizeof(kvcs_state_tensor)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_state_tensor_size() -> usize {
    size_of::<kvcs_state_tensor>()
}

/// `sizeof(kvcs_state)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_state_size() -> usize {
    size_of::<kvcs_state>()
}

/// `sizeof(kvcs_mismatch)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_mismatch_size() -> usize {
    size_of::<kvcs_mismatch>()
}

/// `sizeof(kvcs_layer_difference)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_layer_difference_size() -> usize {
    size_of::<kvcs_layer_difference>()
}

/// `sizeof(kvcs_local_engine)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_local_engine_size() -> usize {
    size_of::<kvcs_local_engine>()
}

/// `sizeof(kvcs_remote_engine)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_remote_engine_size() -> usize {
    size_of::<kvcs_remote_engine>()
}

/// `sizeof(kvcs_head_source)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_head_source_size() -> usize {
    size_of::<kvcs_head_source>()
}

/// `sizeof(kvcs_tensor)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_tensor_size() -> usize {
    size_of::<kvcs_tensor>()
}

/// `sizeof(kvcs_repair_block)` in this library.
#[no_mangle]
pub extern "C" fn kvcs_repair_block_size() -> usize {
    size_of::<kvcs_repair_block>()
}
