//! What a binding learns from the library itself about the structs the ABI
//! passes, so that a binding that does not read the header (Python's
//! ctypes, a dlopen loader) can check its own definitions against the
//! library it loaded: `KVCS_ABI_VERSION` says which calls exist, these say
//! whether the structs still have the shape it knows. `kvcs_<struct>_size`
//! gives one struct's `sizeof`; `kvcs_struct_layout` and `kvcs_struct_field`
//! give each struct's size and its fields' names, offsets and sizes in this
//! build (generated into [`super::generated::struct_layout_table`]), so that a binding
//! compares field offsets, not only sizes.

use std::ffi::c_char;
use std::mem::size_of;

use super::generated::struct_layout_table::{StructLayout, STRUCT_LAYOUTS};
use super::layout_string::kvcs_tensor;
use super::panic::ffi_boundary;
use super::repair::kvcs_repair_block;
use super::report::{kvcs_layer_difference, kvcs_mismatch};
use super::status::{fail, fail_with, kvcs_status};
use super::topology::{kvcs_head_source, kvcs_local_engine, kvcs_remote_engine};
use super::worker::{kvcs_layer, kvcs_segment, kvcs_state, kvcs_state_tensor, kvcs_worker_options};
use super::{c_str, write_out};

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

/// The layout of the struct named `struct_name`.
///
/// # Safety
/// `struct_name` is NULL or a NUL-terminated string.
unsafe fn find_struct(struct_name: *const c_char) -> Result<&'static StructLayout, kvcs_status> {
    // SAFETY: `struct_name` is NULL or a NUL-terminated string (this
    // function's own contract), which lives through the call.
    let name = unsafe { c_str(struct_name, "struct_name") }.map_err(|e| fail(&e))?;
    STRUCT_LAYOUTS
        .iter()
        .find(|s| s.name.to_bytes() == name.as_bytes())
        .ok_or_else(|| {
            fail_with(
                kvcs_status::KVCS_ERR_NOT_FOUND,
                &format!("struct_name \"{name}\" is no struct of the ABI (kvcs_layer, kvcs_segment, ...)"),
            )
        })
}

/// The layout of the ABI struct `struct_name` (`"kvcs_layer"`, say) in this
/// library: `*size` its `sizeof`, `*num_fields` how many fields it has (read
/// each with `kvcs_struct_field`). NULL out-parameters are skipped. A name
/// that is no struct of the ABI gives `KVCS_ERR_NOT_FOUND`.
#[no_mangle]
pub extern "C" fn kvcs_struct_layout(
    struct_name: *const c_char,
    size: *mut usize,
    num_fields: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the contract says `struct_name` is NULL or a C string.
        let layout = match unsafe { find_struct(struct_name) } {
            Ok(layout) => layout,
            Err(status) => return status,
        };
        // SAFETY: each is NULL or writable per the contract.
        unsafe {
            write_out(size, layout.size);
            write_out(num_fields, layout.fields.len());
        }
        kvcs_status::KVCS_OK
    }
}

/// Field `index` (declaration order, below `num_fields` of
/// `kvcs_struct_layout`) of the ABI struct `struct_name` in this library:
/// `*field_name` its name (a static string), `*offset` its `offsetof`,
/// `*size` its `sizeof`. NULL out-parameters are skipped. An unknown
/// struct gives `KVCS_ERR_NOT_FOUND`, an index past the last field
/// `KVCS_ERR_OUT_OF_BOUNDS`.
#[no_mangle]
pub extern "C" fn kvcs_struct_field(
    struct_name: *const c_char,
    index: usize,
    field_name: *mut *const c_char,
    offset: *mut usize,
    size: *mut usize,
) -> kvcs_status {
    ffi_boundary! {
        // SAFETY: the contract says `struct_name` is NULL or a C string.
        let layout = match unsafe { find_struct(struct_name) } {
            Ok(layout) => layout,
            Err(status) => return status,
        };
        let Some(field) = layout.fields.get(index) else {
            let name = layout.name.to_string_lossy();
            let count = layout.fields.len();
            return fail_with(
                kvcs_status::KVCS_ERR_OUT_OF_BOUNDS,
                &format!("index {index} is past the last field of {name}, which has {count}"),
            );
        };
        // SAFETY: each is NULL or writable per the contract.
        unsafe {
            write_out(field_name, field.name.as_ptr());
            write_out(offset, field.offset);
            write_out(size, field.size);
        }
        kvcs_status::KVCS_OK
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_list_fields_in_order_within_the_struct() {
        for layout in STRUCT_LAYOUTS {
            let mut end = 0;
            for field in layout.fields {
                assert!(field.offset >= end, "{:?}.{:?} overlaps", layout.name, field.name);
                end = field.offset + field.size;
            }
            assert!(end <= layout.size, "{:?}", layout.name);
        }
    }
}
