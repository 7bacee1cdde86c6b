//! The one entry point of a program that loads kvcsum with `dlopen`:
//! `kvcs_api_get` gives the function table generated into
//! [`super::generated::function_table`], so a plugin resolves one symbol.

use super::constants::KVCS_ABI_VERSION;
use super::generated::function_table::{kvcs_api, kvcs_api_get_fn, API};
use super::not_null;
use super::panic::ffi_boundary;
use super::status::{fail_with, kvcs_status};

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

// The entry point's own type must be its type too (the table's entries
// are checked where function_table.rs fills it).
const _: kvcs_api_get_fn = kvcs_api_get;
