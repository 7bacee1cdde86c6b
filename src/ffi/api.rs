//! What a program that does not read the header learns from the library
//! itself: the function table (`kvcs_api_get`, for `dlopen` plugins, one
//! symbol to resolve) and the layout of every struct the ABI passes
//! (`kvcs_struct_layout`, `kvcs_struct_field`, so that a binding such as
//! Python's ctypes compares field offsets, not only sizes). The table and
//! the layouts themselves are generated into [`super::loader`].

use std::ffi::{c_char, CStr};

use super::loader::{kvcs_api, API, STRUCT_LAYOUTS};
use super::panic::ffi_boundary;
use super::status::{fail, fail_with, kvcs_status, KVCS_ABI_VERSION};
use super::{c_str, not_null, write_out};

/// The layout of one struct of the ABI in this build.
pub(crate) struct StructLayout {
    /// The C name (`kvcs_layer`).
    pub(crate) name: &'static CStr,
    /// `sizeof` the struct.
    pub(crate) size: usize,
    /// Its fields in declaration order.
    pub(crate) fields: &'static [FieldLayout],
}

/// One field of a [`StructLayout`].
pub(crate) struct FieldLayout {
    /// The field's C name.
    pub(crate) name: &'static CStr,
    /// `offsetof` the field.
    pub(crate) offset: usize,
    /// `sizeof` the field.
    pub(crate) size: usize,
}

/// Gives the table of every call of this library for ABI version
/// `abi_version` (pass `KVCS_ABI_VERSION`): the one symbol a program that
/// loads kvcsum with `dlopen` needs to resolve. `*out` points to a static
/// table owned by the library, valid while it stays loaded, shared by all
/// threads. Another version gives `KVCS_ERR_UNSUPPORTED` naming both.
#[no_mangle]
pub extern "C" fn kvcs_api_get(abi_version: u32, out: *mut *const kvcs_api) -> kvcs_status {
    ffi_boundary! {
        not_null!(out, "out");
        if abi_version != KVCS_ABI_VERSION {
            return fail_with(
                kvcs_status::KVCS_ERR_UNSUPPORTED,
                &format!("abi_version {abi_version} is not this library's ABI version {KVCS_ABI_VERSION}"),
            );
        }
        // SAFETY: `out` is non-NULL (checked above) and writable per the contract.
        unsafe { out.write(&API) };
        kvcs_status::KVCS_OK
    }
}

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
