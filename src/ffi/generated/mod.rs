//! Files that `scripts/gen-bindings.py` writes from the rest of src/ffi
//! (`make header`); do not edit them. `tests/it/header.rs` fails when one
//! is stale.

pub mod function_table;
pub(crate) mod struct_layout_table;
