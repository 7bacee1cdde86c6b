//! Files that `make header` writes from the rest of src/ffi (tools/bindgen,
//! the code in tests/it/header_gen); do not edit them. `tests/it/header.rs` fails when one
//! is stale.

pub mod function_table;
pub(crate) mod struct_layout_table;
