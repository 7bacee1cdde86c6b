//! Every binding of the C ABI but the header, from one reading of src/ffi
//! with a Rust parser (syn):
//!
//! - src/ffi/generated/function_table.rs: one function-pointer type
//!   `kvcs_<call>_fn` per exported call (with its parameter names, which the
//!   header's typedefs keep) and the function table `kvcs_api` that
//!   `kvcs_api_get` hands out;
//! - src/ffi/generated/struct_layout_table.rs: the layout (size, field
//!   names, offsets) of every struct the ABI passes, which
//!   `kvcs_struct_layout` / `kvcs_struct_field` report;
//! - python/kvcsum/_abi.py: the same ABI as data for ctypes (every call's
//!   signature, every struct's fields, handles, enums and constants), in C
//!   spelling; python/kvcsum/_lib.py turns it into ctypes declarations;
//! - python/kvcsum/_enums.py: one Python `IntEnum` per C enum;
//! - src/ffi/api-slots.txt: each call's slot in the table.
//!
//! The table's order is fixed: src/ffi/api-slots.txt gives each call its
//! slot, once. A new call is appended with the next slot; a slot is never
//! renumbered or reused, so a program built against an older header finds
//! every entry it knows where it was. A call that disappears is an error
//! (remove it from the ABI deliberately, with a new ABI version).
//!
//! `make header` writes them (tests/gen_header.rs); tests/it/header.rs
//! checks that the checked-in copies are what this makes now.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use syn::{Expr, Fields, Item, Lit, Type};

/// The entry point itself is resolved by name, so it is not in the table.
const ENTRY_POINT: &str = "kvcs_api_get";

/// Each C enum's Python class: (C name, class, the enumerator prefixes the
/// members drop, where the package uses it). A C enum missing here stops
/// the generator.
const PYTHON_ENUMS: &[(&str, &str, &[&str], &str)] = &[
    ("kvcs_status", "Status", &["KVCS_ERR_", "KVCS_"], "kvcsum.Error.status"),
    ("kvcs_role", "Role", &["KVCS_ROLE_"], "Worker.checksum, Verifier.expect"),
    (
        "kvcs_algorithm",
        "Algorithm",
        &["KVCS_ALGORITHM_"],
        "Worker.set_algorithm",
    ),
    ("kvcs_policy", "Policy", &["KVCS_POLICY_"], "Verifier.set_policy"),
    ("kvcs_verdict", "Verdict", &["KVCS_VERDICT_"], "Report.verdict"),
    ("kvcs_direction", "Direction", &["KVCS_DIRECTION_"], "Completion.report"),
    (
        "kvcs_unverified_reason",
        "Reason",
        &["KVCS_UNVERIFIED_"],
        "Report.reason, Finding.reason",
    ),
    (
        "kvcs_stored_outcome",
        "StoredOutcome",
        &["KVCS_STORED_"],
        "the values of Result.stored",
    ),
    (
        "kvcs_tier_outcome",
        "TierOutcome",
        &["KVCS_TIER_"],
        "the values TierIndex.check gives",
    ),
];

/// The C spelling of the Rust integer types.
fn c_int(rust: &str) -> Option<&'static str> {
    Some(match rust {
        "u8" => "uint8_t",
        "u16" => "uint16_t",
        "u32" => "uint32_t",
        "u64" => "uint64_t",
        "i8" => "int8_t",
        "i16" => "int16_t",
        "i32" => "int32_t",
        "i64" => "int64_t",
        "usize" => "size_t",
        "isize" => "ptrdiff_t",
        _ => return None,
    })
}

/// The C spelling of `std::ffi`'s types.
fn c_std(rust: &str) -> Option<&'static str> {
    Some(match rust {
        "c_char" => "char",
        "c_void" => "void",
        _ => return None,
    })
}

fn primitive(rust: &str) -> bool {
    c_int(rust).is_some() || rust == "bool"
}

/// One exported call.
struct Call {
    name: String,
    module: String,
    args: Vec<(String, Type)>,
    ret: Option<Type>,
}

/// One C enum: its C integer type, its doc, and each enumerator with its
/// value and doc.
struct CEnum {
    name: String,
    c_repr: &'static str,
    doc: String,
    variants: Vec<(String, i128, String)>,
}

/// What src/ffi declares.
#[derive(Default)]
struct Abi {
    calls: Vec<Call>,
    /// Each `kvcs_` type and the module of src/ffi that defines it.
    defined: BTreeMap<String, String>,
    /// Each `#[repr(C)]` struct's fields, in declaration order.
    structs: Vec<(String, Vec<(String, Type)>)>,
    handles: Vec<String>,
    enums: Vec<CEnum>,
    /// Each `KVCS_` constant: its value and module ("" for the engine's).
    constants: BTreeMap<String, (i128, String)>,
}

fn parse(path: &Path) -> Result<syn::File, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("read {}: {e}", path.display()))?;
    syn::parse_file(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn is_pub(vis: &syn::Visibility) -> bool {
    matches!(vis, syn::Visibility::Public(_))
}

/// The text of an item's `///` lines, joined by newlines.
fn doc_of(attrs: &[syn::Attribute]) -> String {
    let mut lines = Vec::new();
    for attr in attrs {
        if let syn::Meta::NameValue(nv) = &attr.meta {
            if nv.path.is_ident("doc") {
                if let Expr::Lit(syn::ExprLit {
                    lit: Lit::Str(text), ..
                }) = &nv.value
                {
                    let line = text.value();
                    lines.push(line.strip_prefix(' ').unwrap_or(&line).to_owned());
                }
            }
        }
    }
    lines.join("\n")
}

/// The ident of `#[repr(X)]`, if any.
fn repr_of(attrs: &[syn::Attribute]) -> Option<String> {
    let attr = attrs.iter().find(|a| a.path().is_ident("repr"))?;
    let ident: syn::Ident = attr.parse_args().ok()?;
    Some(ident.to_string())
}

fn exported(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("no_mangle")
            || (attr.path().is_ident("unsafe") && attr.parse_args::<syn::Ident>().is_ok_and(|i| i == "no_mangle"))
    })
}

/// The value of a constant's initialiser: integer literals, `<uint>::MAX`
/// and integer arithmetic of them.
fn int_value(expr: &Expr) -> Result<i128, String> {
    let bad = || format!("cannot evaluate constant initialiser `{}`", quote::quote!(#expr));
    Ok(match expr {
        Expr::Lit(syn::ExprLit { lit: Lit::Int(int), .. }) => int.base10_parse::<i128>().map_err(|_| bad())?,
        Expr::Paren(inner) => int_value(&inner.expr)?,
        Expr::Group(inner) => int_value(&inner.expr)?,
        Expr::Unary(syn::ExprUnary {
            op: syn::UnOp::Neg(_),
            expr,
            ..
        }) => -int_value(expr)?,
        Expr::Path(path) => {
            let segments: Vec<String> = path.path.segments.iter().map(|s| s.ident.to_string()).collect();
            let bits = match segments.iter().map(String::as_str).collect::<Vec<_>>()[..] {
                ["u8", "MAX"] => 8,
                ["u16", "MAX"] => 16,
                ["u32", "MAX"] => 32,
                ["u64", "MAX"] | ["usize", "MAX"] => 64,
                _ => return Err(bad()),
            };
            (1i128 << bits) - 1
        }
        Expr::Binary(binary) => {
            let (l, r) = (int_value(&binary.left)?, int_value(&binary.right)?);
            use syn::BinOp::*;
            match binary.op {
                Add(_) => l + r,
                Sub(_) => l - r,
                Mul(_) => l * r,
                Div(_) if r != 0 => l.div_euclid(r),
                Rem(_) if r != 0 => l.rem_euclid(r),
                Shl(_) => l << r,
                Shr(_) => l >> r,
                BitOr(_) => l | r,
                BitAnd(_) => l & r,
                BitXor(_) => l ^ r,
                _ => return Err(bad()),
            }
        }
        _ => return Err(bad()),
    })
}

/// The Rust spelling of an FFI type (`*mut *const c_char`, `[u8; 32]`).
fn rust_text(ty: &Type) -> Result<String, String> {
    Ok(match ty {
        Type::Ptr(ptr) => {
            let kind = if ptr.mutability.is_some() { "mut" } else { "const" };
            format!("*{kind} {}", rust_text(&ptr.elem)?)
        }
        Type::Array(array) => {
            let len = &array.len;
            format!("[{}; {}]", rust_text(&array.elem)?, quote::quote!(#len))
        }
        Type::Path(path) if path.qself.is_none() && path.path.get_ident().is_some() => {
            path.path.get_ident().unwrap().to_string()
        }
        _ => return Err(format!("no FFI spelling for type `{}`", quote::quote!(#ty))),
    })
}

/// The C spelling of an FFI type (`*mut *const c_char` -> `const char **`).
fn c_type(ty: &Type) -> Result<String, String> {
    if let Type::Array(array) = ty {
        // A struct field `[T; N]`: `T[N]`.
        return Ok(format!("{}[{}]", c_type(&array.elem)?, int_value(&array.len)?));
    }
    let mut levels = Vec::new(); // outermost first: true where the pointee is const
    let mut inner = ty;
    while let Type::Ptr(ptr) = inner {
        levels.push(ptr.mutability.is_none());
        inner = &ptr.elem;
    }
    let rust = rust_text(inner)?;
    let base = c_int(&rust)
        .or_else(|| c_std(&rust))
        .map(str::to_owned)
        .unwrap_or(rust.clone());
    if !(c_int(&rust).is_some() || c_std(&rust).is_some() || base.starts_with("kvcs_") || base == "bool") {
        return Err(format!("no C spelling for type `{rust}`"));
    }
    if levels.is_empty() {
        return Ok(base);
    }
    let mut text = format!("{}{base} ", if *levels.last().unwrap() { "const " } else { "" });
    for i in (0..levels.len()).rev() {
        text.push('*');
        if i > 0 && levels[i - 1] {
            text.push_str("const ");
        }
    }
    Ok(text.trim().to_owned())
}

impl Abi {
    fn read(root: &Path) -> Result<Abi, String> {
        let ffi = root.join("src/ffi");
        let generated = ffi.join("generated");
        let mut files = Vec::new();
        rust_files(&ffi, &mut files);
        files.retain(|path| !path.starts_with(&generated));
        files.sort();
        let mut abi = Abi::default();
        for path in &files {
            let relative = path.strip_prefix(&ffi).unwrap().with_extension("");
            let parts: Vec<String> = relative
                .components()
                .map(|c| c.as_os_str().to_str().unwrap().to_owned())
                .collect();
            let module = parts.join("::");
            let module = module.strip_suffix("::mod").unwrap_or(&module).to_owned();
            for item in parse(path)?.items {
                abi.read_item(item, &module)?;
            }
        }
        // Engine constants the header shows under a KVCS_ name (cbindgen.toml's [export.rename]).
        let cbindgen = std::fs::read_to_string(root.join("cbindgen.toml")).map_err(|e| e.to_string())?;
        let renames: BTreeMap<&str, &str> = cbindgen
            .lines()
            .filter_map(|line| {
                let (from, to) = line.split_once(" = ")?;
                let (from, to) = (
                    from.strip_prefix('"')?.strip_suffix('"')?,
                    to.strip_prefix('"')?.strip_suffix('"')?,
                );
                to.starts_with("KVCS_").then_some((from, to))
            })
            .collect();
        let mut sources = Vec::new();
        rust_files(&root.join("src"), &mut sources);
        sources.retain(|path| !path.starts_with(&ffi));
        sources.sort();
        for path in sources {
            for item in parse(&path)?.items {
                if let Item::Const(constant) = item {
                    let name = constant.ident.to_string();
                    let Some(renamed) = renames.get(name.as_str()) else {
                        continue;
                    };
                    let ty = rust_text(&constant.ty).unwrap_or_default();
                    if is_pub(&constant.vis) && primitive(&ty) {
                        abi.constants
                            .insert(renamed.to_string(), (int_value(&constant.expr)?, String::new()));
                    }
                }
            }
        }
        if !abi.calls.iter().any(|call| call.name == ENTRY_POINT) {
            return Err(format!("src/ffi defines no {ENTRY_POINT}"));
        }
        Ok(abi)
    }

    fn read_item(&mut self, item: Item, module: &str) -> Result<(), String> {
        match item {
            Item::Fn(function) => {
                let name = function.sig.ident.to_string();
                let c_abi = function
                    .sig
                    .abi
                    .as_ref()
                    .and_then(|abi| abi.name.as_ref())
                    .is_some_and(|n| n.value() == "C");
                if !(name.starts_with("kvcs_") && c_abi && is_pub(&function.vis) && exported(&function.attrs)) {
                    return Ok(());
                }
                let mut args = Vec::new();
                for input in &function.sig.inputs {
                    let syn::FnArg::Typed(typed) = input else {
                        return Err(format!("{name} takes self"));
                    };
                    let pat = &typed.pat;
                    args.push((quote::quote!(#pat).to_string(), (*typed.ty).clone()));
                }
                let ret = match &function.sig.output {
                    syn::ReturnType::Default => None,
                    syn::ReturnType::Type(_, ty) => Some((**ty).clone()),
                };
                if self.calls.iter().any(|call| call.name == name) {
                    return Err(format!("{name} is defined twice"));
                }
                self.calls.push(Call {
                    name,
                    module: module.to_owned(),
                    args,
                    ret,
                });
            }
            Item::Struct(item) if is_pub(&item.vis) && item.ident.to_string().starts_with("kvcs_") => {
                let name = item.ident.to_string();
                self.defined.insert(name.clone(), module.to_owned());
                let fields: Vec<(String, Type)> = match &item.fields {
                    Fields::Named(named) => named
                        .named
                        .iter()
                        .map(|f| (f.ident.as_ref().unwrap().to_string(), f.ty.clone()))
                        .collect(),
                    _ => Vec::new(),
                };
                if fields.len() == 1 && fields[0].0 == "_private" {
                    self.handles.push(name);
                } else if repr_of(&item.attrs).as_deref() == Some("C") {
                    self.structs.push((name, fields));
                }
            }
            Item::Enum(item) if is_pub(&item.vis) && item.ident.to_string().starts_with("kvcs_") => {
                let name = item.ident.to_string();
                self.defined.insert(name.clone(), module.to_owned());
                let repr = repr_of(&item.attrs).ok_or_else(|| format!("enum {name} has no #[repr(...)]"))?;
                let c_repr = c_int(&repr).ok_or_else(|| format!("enum {name}: #[repr({repr})] is no C integer"))?;
                let mut variants = Vec::new();
                for variant in &item.variants {
                    let (_, value) = variant
                        .discriminant
                        .as_ref()
                        .ok_or_else(|| format!("{name}::{} has no explicit value", variant.ident))?;
                    variants.push((variant.ident.to_string(), int_value(value)?, doc_of(&variant.attrs)));
                }
                self.enums.push(CEnum {
                    name,
                    c_repr,
                    doc: doc_of(&item.attrs),
                    variants,
                });
            }
            Item::Type(item) if is_pub(&item.vis) && item.ident.to_string().starts_with("kvcs_") => {
                self.defined.insert(item.ident.to_string(), module.to_owned());
            }
            Item::Const(constant) if is_pub(&constant.vis) => {
                let name = constant.ident.to_string();
                if name.starts_with("KVCS_") {
                    self.constants
                        .insert(name, (int_value(&constant.expr)?, module.to_owned()));
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn call(&self, name: &str) -> &Call {
        self.calls.iter().find(|call| call.name == name).unwrap()
    }

    /// The table's calls in slot order: api-slots.txt, then any new call appended.
    fn slots(&self, root: &Path) -> Result<Vec<String>, String> {
        let mut listed: Vec<String> = Vec::new();
        if let Ok(text) = std::fs::read_to_string(root.join("src/ffi/api-slots.txt")) {
            for line in text.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')) {
                let (slot, name) = line.split_once(' ').ok_or_else(|| format!("api-slots.txt: `{line}`"))?;
                if slot.parse::<usize>().ok() != Some(listed.len()) {
                    return Err(format!(
                        "api-slots.txt: slot {slot} of {name} should be {}",
                        listed.len()
                    ));
                }
                listed.push(name.to_owned());
            }
        }
        let gone: Vec<&str> = listed
            .iter()
            .filter(|name| !self.calls.iter().any(|call| &call.name == *name))
            .map(String::as_str)
            .collect();
        if !gone.is_empty() {
            return Err(format!(
                "{} left src/ffi but hold slots in api-slots.txt: the table is append-only; retiring a call is an \
                 ABI change (a new KVCS_ABI_VERSION)",
                gone.join(", ")
            ));
        }
        let new = self
            .calls
            .iter()
            .map(|call| call.name.clone())
            .filter(|name| !listed.contains(name) && name != ENTRY_POINT)
            .collect::<Vec<_>>();
        listed.extend(new);
        Ok(listed)
    }

    /// `use` lines for the named types of `types` and for `extra` (name -> module).
    fn rust_uses(&self, types: &[&Type], extra: &[(&str, &str)]) -> Result<(Vec<String>, Vec<String>), String> {
        let mut std_names = std::collections::BTreeSet::new();
        let mut by_module: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
        for (name, module) in extra {
            by_module
                .entry(module.to_string())
                .or_default()
                .insert(name.to_string());
        }
        for ty in types {
            let text = rust_text(ty)?;
            for word in text
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .filter(|w| w.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_'))
            {
                if word == "const" || word == "mut" || primitive(word) {
                    continue;
                }
                if c_std(word).is_some() {
                    std_names.insert(word.to_owned());
                } else if let Some(module) = self.defined.get(word) {
                    by_module.entry(module.clone()).or_default().insert(word.to_owned());
                } else if word != "kvcs_api" {
                    return Err(format!("the generator does not know where type {word} is defined"));
                }
            }
        }
        let lines = by_module
            .iter()
            .map(|(module, names)| {
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let inner = if names.len() == 1 {
                    names[0].to_owned()
                } else {
                    format!("{{{}}}", names.join(", "))
                };
                format!("use crate::ffi::{module}::{inner};")
            })
            .collect();
        Ok((std_names.into_iter().collect(), lines))
    }
}

fn rustfmt(root: &Path, text: &str) -> Result<String, String> {
    let mut child = Command::new("rustfmt")
        .args(["--edition", "2021", "--emit", "stdout", "--config-path"])
        .arg(root.join("rustfmt.toml"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running rustfmt: {e}"))?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .map_err(|e| e.to_string())?;
    let done = child.wait_with_output().map_err(|e| e.to_string())?;
    if !done.status.success() {
        return Err(format!(
            "rustfmt failed on generated code:\n{}",
            String::from_utf8_lossy(&done.stderr)
        ));
    }
    String::from_utf8(done.stdout).map_err(|e| e.to_string())
}

fn function_table_rs(root: &Path, abi: &Abi, slots: &[String]) -> Result<String, String> {
    let calls: Vec<&str> = slots.iter().map(String::as_str).chain([ENTRY_POINT]).collect();
    let mut types: Vec<&Type> = calls
        .iter()
        .flat_map(|name| abi.call(name).args.iter().map(|(_, ty)| ty))
        .collect();
    types.extend(calls.iter().filter_map(|name| abi.call(name).ret.as_ref()));
    let abi_version_module = &abi.constants["KVCS_ABI_VERSION"].1;
    let (std_names, uses) = abi.rust_uses(&types, &[("KVCS_ABI_VERSION", abi_version_module)])?;
    let mut out = String::new();
    out.push_str(
        "//! Generated by tests/it/header_gen from src/ffi; do not edit (run\n\
         //! `make header`). The function-pointer type of every exported call,\n\
         //! `kvcs_<call>_fn`, the function table [`kvcs_api`] that `kvcs_api_get`\n\
         //! hands to programs that load the library at run time. Filling the table\n\
         //! checks each type against its function, so a stale file does not build.\n\
         //! (The struct layouts are in `struct_layout_table.rs`, which the table's\n\
         //! `kvcs_struct_layout` reads: kept apart, so no module imports back.)\n\
         #![allow(non_camel_case_types)]\n\nuse std::mem::size_of;\n\n",
    );
    if !std_names.is_empty() {
        writeln!(out, "use std::ffi::{{{}}};\n", std_names.join(", ")).unwrap();
    }
    for line in uses {
        out.push_str(&line);
        out.push('\n');
    }
    out.push('\n');
    for name in &calls {
        let call = abi.call(name);
        let params: Vec<String> = call
            .args
            .iter()
            .map(|(arg, ty)| Ok(format!("{arg}: {}", rust_text(ty)?)))
            .collect::<Result<_, String>>()?;
        let arrow = match &call.ret {
            Some(ty) => format!(" -> {}", rust_text(ty)?),
            None => String::new(),
        };
        writeln!(out, "/// The type of `{name}`.").unwrap();
        writeln!(
            out,
            "pub type {name}_fn = unsafe extern \"C\" fn({}){arrow};",
            params.join(", ")
        )
        .unwrap();
    }
    out.push_str(
        "\n/// Every call of the library as one table of function pointers, for a\n\
         /// program that loads kvcsum at run time: it resolves the one symbol\n\
         /// `kvcs_api_get` and calls through the table, whose entries the compiler\n\
         /// checks. Entries keep their place forever (src/ffi/api-slots.txt): new\n\
         /// calls are appended, none moves or goes away within an ABI version, so\n\
         /// `size` says which entries a library has. A program built against a newer\n\
         /// header than the library checks an entry with `KVCS_API_HAS(api, entry)`\n\
         /// before calling it.\n\
         ///\n\
         /// Ownership: the library's, static; never freed. Thread safety: read-only,\n\
         /// shared by every thread.\n\
         #[repr(C)]\n\
         pub struct kvcs_api {\n    \
         /// `sizeof(kvcs_api)` in the library that filled it; the entries lie in\n    \
         /// its first `size` bytes.\n    \
         pub size: usize,\n    \
         /// The library's ABI version, `KVCS_ABI_VERSION`.\n    \
         pub abi_version: u32,\n",
    );
    for (slot, name) in slots.iter().enumerate() {
        writeln!(out, "    /// Slot {slot}: `{name}`.\n    pub {name}: {name}_fn,").unwrap();
    }
    out.push_str(
        "}\n\n/// The table `kvcs_api_get` gives out.\n\
         pub(crate) static API: kvcs_api = kvcs_api {\n    \
         size: size_of::<kvcs_api>(),\n    \
         abi_version: KVCS_ABI_VERSION,\n",
    );
    for name in slots {
        writeln!(out, "    {name}: crate::ffi::{}::{name},", abi.call(name).module).unwrap();
    }
    out.push_str("};\n");
    rustfmt(root, &out)
}

fn layouts_rs(root: &Path, abi: &Abi) -> Result<String, String> {
    let types: Vec<&Type> = abi
        .structs
        .iter()
        .flat_map(|(_, fields)| fields.iter().map(|(_, ty)| ty))
        .collect();
    let struct_names: Vec<Type> = abi
        .structs
        .iter()
        .map(|(name, _)| syn::parse_str::<Type>(name).unwrap())
        .collect();
    let all: Vec<&Type> = types.into_iter().chain(struct_names.iter()).collect();
    let (mut std_names, uses) = abi.rust_uses(&all, &[])?;
    // std::ffi's CStr (the names), and what the fields need (`c_char`).
    std_names.push("CStr".to_owned());
    std_names.sort();
    let mut out = String::new();
    out.push_str(
        "//! Generated by tests/it/header_gen from src/ffi; do not edit (run\n\
         //! `make header`). The layout of every struct the ABI passes, as this build\n\
         //! lays it out, for `kvcs_struct_layout` and `kvcs_struct_field`\n\
         //! (struct_layout.rs), so that a binding compares field offsets, not only\n\
         //! sizes, against the library it loaded.\n\n",
    );
    if std_names.len() == 1 {
        out.push_str("use std::ffi::CStr;\n");
    } else {
        writeln!(out, "use std::ffi::{{{}}};", std_names.join(", ")).unwrap();
    }
    out.push_str("use std::mem::{offset_of, size_of};\n\n");
    for line in uses {
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str(
        "\n/// The layout of one struct of the ABI in this build.\n\
         pub(crate) struct StructLayout {\n    \
         /// The C name (`kvcs_layer`).\n    \
         pub(crate) name: &'static CStr,\n    \
         /// `sizeof` the struct.\n    \
         pub(crate) size: usize,\n    \
         /// Its fields in declaration order.\n    \
         pub(crate) fields: &'static [FieldLayout],\n\
         }\n\n\
         /// One field of a [`StructLayout`].\n\
         pub(crate) struct FieldLayout {\n    \
         /// The field's C name.\n    \
         pub(crate) name: &'static CStr,\n    \
         /// `offsetof` the field.\n    \
         pub(crate) offset: usize,\n    \
         /// `sizeof` the field.\n    \
         pub(crate) size: usize,\n\
         }\n\n\
         /// The layout of every struct the ABI passes, as this build lays it out.\n\
         pub(crate) static STRUCT_LAYOUTS: &[StructLayout] = &[\n",
    );
    for (name, fields) in &abi.structs {
        writeln!(
            out,
            "    StructLayout {{ name: c\"{name}\", size: size_of::<{name}>(), fields: &["
        )
        .unwrap();
        for (field, ty) in fields {
            writeln!(
                out,
                "        FieldLayout {{ name: c\"{field}\", offset: offset_of!({name}, {field}), size: size_of::<{}>() }},",
                rust_text(ty)?
            )
            .unwrap();
        }
        out.push_str("    ] },\n");
    }
    out.push_str("];\n");
    rustfmt(root, &out)
}

fn python_abi(abi: &Abi, slots: &[String]) -> Result<String, String> {
    let c = |ty: &Option<Type>| ty.as_ref().map_or(Ok("void".to_owned()), c_type);
    let mut out = String::from(
        "\"\"\"The C ABI of libkvcsum as data, in the header's C spelling.\n\
         \n\
         Generated by tests/it/header_gen from src/ffi; do not edit (run\n\
         `make header`; tests/it/header.rs fails when this file is stale). _lib turns\n\
         it into ctypes declarations and checks STRUCTS against the loaded\n\
         library's own layout (kvcs_struct_layout, kvcs_struct_field).\n\
         \"\"\"\n\
         \n\
         #: Every #define of the header with an integer value.\n\
         CONSTANTS = {\n",
    );
    for (name, (value, _)) in &abi.constants {
        writeln!(out, "    \"{name}\": {value},").unwrap();
    }
    out.push_str("}\n\n#: Each enum: (its C integer type, {enumerator: value}).\nENUMS = {\n");
    for e in &abi.enums {
        writeln!(out, "    \"{}\": (\n        \"{}\",\n        {{", e.name, e.c_repr).unwrap();
        for (variant, value, _) in &e.variants {
            writeln!(out, "            \"{variant}\": {value},").unwrap();
        }
        out.push_str("        },\n    ),\n");
    }
    out.push_str("}\n\n#: Opaque handle types (passed as pointers only).\nHANDLES = (\n");
    for name in &abi.handles {
        writeln!(out, "    \"{name}\",").unwrap();
    }
    out.push_str(")\n\n#: Each struct's fields in order: (name, C type).\nSTRUCTS = {\n");
    for (name, fields) in &abi.structs {
        writeln!(out, "    \"{name}\": (").unwrap();
        for (field, ty) in fields {
            writeln!(out, "        (\"{field}\", \"{}\"),", c_type(ty)?).unwrap();
        }
        out.push_str("    ),\n");
    }
    out.push_str(
        "}\n\n#: Each call: (return type, ((parameter, C type), ...)); the table's\n\
         #: calls in slot order, then the entry point.\nCALLS = {\n",
    );
    for name in slots.iter().map(String::as_str).chain([ENTRY_POINT]) {
        let call = abi.call(name);
        writeln!(out, "    \"{name}\": (\n        \"{}\",", c(&call.ret)?).unwrap();
        if call.args.is_empty() {
            out.push_str("        (),\n");
        } else {
            out.push_str("        (\n");
            for (arg, ty) in &call.args {
                writeln!(out, "            (\"{arg}\", \"{}\"),", c_type(ty)?).unwrap();
            }
            out.push_str("        ),\n");
        }
        out.push_str("    ),\n");
    }
    out.push_str("}\n");
    Ok(out)
}

/// `text` as lines of at most `width` characters, each starting with `prefix`.
fn wrap(text: &str, width: usize, prefix: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && prefix.len() + line.len() + 1 + word.len() > width {
            lines.push(format!("{prefix}{line}"));
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(format!("{prefix}{line}"));
    }
    lines
}

fn python_enums(abi: &Abi) -> Result<String, String> {
    for e in &abi.enums {
        if !PYTHON_ENUMS.iter().any(|(c_name, ..)| *c_name == e.name) {
            return Err(format!(
                "the C enum {} has no Python class: add it to PYTHON_ENUMS in tests/it/header_gen/bindings.rs",
                e.name
            ));
        }
    }
    let mut out = String::from(
        "\"\"\"The C enums of kvcsum.h as Python IntEnums: one class per enum, each\n\
         member the header's value, named without the enumerator's prefix\n\
         (Status.INVALID_ARGUMENT is KVCS_ERR_INVALID_ARGUMENT). _constants\n\
         re-exports them with the package's other constants.\n\
         \n\
         Generated by tests/it/header_gen from src/ffi; do not edit (run\n\
         `make header`; tests/it/header.rs fails when this file is stale).\n\
         \n\
         Thread safety: enums are immutable; share them freely.\"\"\"\n\
         \n\
         import enum\n\
         \n\
         \n\
         class _CEnum(enum.IntEnum):\n    \
         \"\"\"An IntEnum that prints as its number on every Python 3 (3.11 made\n    \
         str() of an IntEnum the number; before, it was \"Verdict.MATCH\"), so\n    \
         messages read as they did with plain ints. repr() names the member.\"\"\"\n\
         \n    \
         def __str__(self) -> str:\n        \
         return int.__repr__(self)\n\
         \n    \
         __format__ = int.__format__\n",
    );
    for (c_name, class, prefixes, used) in PYTHON_ENUMS {
        let e = abi
            .enums
            .iter()
            .find(|e| e.name == *c_name)
            .ok_or_else(|| format!("PYTHON_ENUMS names {c_name}, which src/ffi does not define"))?;
        write!(out, "\n\nclass {class}(_CEnum):\n").unwrap();
        let doc = format!("{c_name} ({used}): {}", e.doc);
        let mut lines = wrap(&doc, 76, "    ");
        lines[0] = format!("    \"\"\"{}", &lines[0][4..]);
        for line in lines {
            out.push_str(&line);
            out.push('\n');
        }
        out.push_str("\n    Thread safety: immutable.\"\"\"\n\n");
        for (variant, value, doc) in &e.variants {
            let member = prefixes
                .iter()
                .find_map(|prefix| variant.strip_prefix(prefix))
                .ok_or_else(|| format!("{c_name}::{variant} has none of the prefixes {prefixes:?}"))?;
            for line in wrap(doc, 79, "    #: ") {
                out.push_str(&line);
                out.push('\n');
            }
            writeln!(out, "    {member} = {value}").unwrap();
        }
    }
    Ok(out)
}

fn slots_txt(slots: &[String]) -> String {
    let mut out = String::from(
        "# The slot of each call in kvcs_api (src/ffi/generated/function_table.rs), one per line.\n\
         # `make header` appends new calls; a slot is never renumbered,\n\
         # reused or removed within an ABI version (programs built against an\n\
         # older header find their entries where they were).\n",
    );
    for (slot, name) in slots.iter().enumerate() {
        writeln!(out, "{slot} {name}").unwrap();
    }
    out
}

/// Every generated binding but the header: (path under `root`, text).
pub fn generated_bindings(root: &Path) -> Result<Vec<(&'static str, String)>, String> {
    let abi = Abi::read(root)?;
    let slots = abi.slots(root)?;
    Ok(vec![
        ("src/ffi/api-slots.txt", slots_txt(&slots)),
        (
            "src/ffi/generated/function_table.rs",
            function_table_rs(root, &abi, &slots)?,
        ),
        ("src/ffi/generated/struct_layout_table.rs", layouts_rs(root, &abi)?),
        ("python/kvcsum/_abi.py", python_abi(&abi, &slots)?),
        ("python/kvcsum/_enums.py", python_enums(&abi)?),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ty(text: &str) -> Type {
        syn::parse_str(text).unwrap()
    }

    #[test]
    fn the_generator_spells_rust_types_in_c() {
        assert_eq!(c_type(&ty("*mut *const c_char")).unwrap(), "const char **");
        assert_eq!(c_type(&ty("*const *mut u8")).unwrap(), "uint8_t *const *");
        assert_eq!(c_type(&ty("*mut kvcs_worker")).unwrap(), "kvcs_worker *");
        assert_eq!(c_type(&ty("[u8; 4 * 8]")).unwrap(), "uint8_t[32]");
        assert_eq!(c_type(&ty("usize")).unwrap(), "size_t");
        assert!(c_type(&ty("Vec<u8>")).is_err());
        assert!(c_type(&ty("String")).is_err());
        assert_eq!(rust_text(&ty("* mut * const c_char")).unwrap(), "*mut *const c_char");
    }

    #[test]
    fn the_generator_evaluates_constant_initialisers() {
        let value = |text: &str| int_value(&syn::parse_str::<Expr>(text).unwrap());
        assert_eq!(value("0x9E37_79B1").unwrap(), 0x9E37_79B1);
        assert_eq!(value("u32::MAX").unwrap(), u32::MAX as i128);
        assert_eq!(value("-1").unwrap(), -1);
        assert_eq!(value("(1 << 16) + 4 * 2").unwrap(), 65544);
        assert!(value("f(1)").is_err());
        assert!(value("1 / 0").is_err());
    }

    #[test]
    fn python_members_drop_the_first_prefix_that_fits() {
        let (_, _, prefixes, _) = PYTHON_ENUMS.iter().find(|(c, ..)| *c == "kvcs_status").unwrap();
        let member = |variant: &str| {
            prefixes
                .iter()
                .find_map(|p| variant.strip_prefix(p))
                .unwrap()
                .to_owned()
        };
        assert_eq!(member("KVCS_OK"), "OK");
        assert_eq!(member("KVCS_ERR_NOT_READY"), "NOT_READY");
        assert_eq!(wrap("a bb ccc", 9, "  "), ["  a bb", "  ccc"]);
    }
}
