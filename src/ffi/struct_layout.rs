//! What a binding learns from the library itself about the structs the ABI
//! passes: `kvcs_struct_layout` and `kvcs_struct_field` give each struct's
//! size and its fields' names, offsets and sizes in this build (generated
//! into [`super::abi_layouts`]), so that a binding such as Python's ctypes
//! compares field offsets, not only sizes, against the library it loaded.

use std::ffi::c_char;

use super::abi_layouts::{StructLayout, STRUCT_LAYOUTS};
use super::panic::ffi_boundary;
use super::status::{fail, fail_with, kvcs_status};
use super::{c_str, write_out};

/// The layout of the struct named `struct_name`.
///
/// # Safety
/// `struct_name` is NULL or a NUL-terminated string.
unsafe fn find_struct(struct_name: *const c_char) -> Result<&'static StructLayout, kvcs_status> {
    let name = c_str(struct_name, "struct_name").map_err(|e| fail(&e))?;
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
