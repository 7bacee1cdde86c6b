#!/usr/bin/env python3
"""Writes every binding of the C ABI that is not the header, from src/ffi:

- src/ffi/generated/function_table.rs: one function-pointer type `kvcs_<call>_fn` per
  exported call (with its parameter names, which the header's typedefs
  keep) and the function table `kvcs_api` that `kvcs_api_get` hands out;
- src/ffi/generated/struct_layout_table.rs: the layout (size, field names, offsets) of every
  struct the ABI passes, which `kvcs_struct_layout` / `kvcs_struct_field`
  report (apart from function_table.rs, whose table points at those calls, so that
  no module of src/ffi imports back);
- python/kvcsum/_abi.py: the same ABI as data for ctypes (every call's
  signature, every struct's fields, handles, enums and constants), in C
  spelling; python/kvcsum/_lib.py turns it into ctypes declarations.

The table's order is fixed: src/ffi/api-slots.txt gives each call its
slot, once. A new call is appended with the next slot; a slot is never
renumbered or reused, so a program built against an older header finds
every entry it knows where it was. A call that disappears stops this
script (remove it from the ABI deliberately, with a new ABI version).

Run after adding or changing an exported call, a struct, an enum or a
constant; `make header` runs it, then cbindgen:

    python3 scripts/gen-bindings.py && make header

`--check` writes nothing and exits 1 naming each stale file (tests/it/header.rs
runs it, so a stale binding fails `cargo test`).
"""
from __future__ import annotations

import difflib
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FFI = ROOT / "src" / "ffi"
GENERATED = FFI / "generated"
FUNCTION_TABLE = GENERATED / "function_table.rs"
LAYOUTS = GENERATED / "struct_layout_table.rs"
SLOTS = FFI / "api-slots.txt"
PYTHON_ABI = ROOT / "python" / "kvcsum" / "_abi.py"
CBINDGEN = ROOT / "cbindgen.toml"

#: The entry point itself is resolved by name, so it is not in the table.
ENTRY_POINT = "kvcs_api_get"

FN = re.compile(
    r'#\[(?:unsafe\()?no_mangle\)?\]\s*(?:#\[[^\]]*\]\s*)*pub (?:unsafe )?extern "C" fn (kvcs_\w+)\s*\(([^)]*)\)\s*(?:->\s*([^{]+?))?\s*\{',
    re.S,
)
ITEM = re.compile(r"^pub (struct|enum|type) (kvcs_\w+)\b", re.M)
CONST = re.compile(r"^pub const (\w+)\s*:\s*(\w+)\s*=\s*([^;]+);", re.M)
RUST_INTS = {
    "u8": "uint8_t",
    "u16": "uint16_t",
    "u32": "uint32_t",
    "u64": "uint64_t",
    "i8": "int8_t",
    "i16": "int16_t",
    "i32": "int32_t",
    "i64": "int64_t",
    "usize": "size_t",
    "isize": "ptrdiff_t",
}
STD_FFI = {"c_char": "char", "c_void": "void"}
PRIMITIVE = set(RUST_INTS) | {"bool"}


class Problem(Exception):
    """Something in src/ffi this script cannot describe."""


def split_top(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside brackets, pieces stripped, empty ones dropped."""
    pieces, depth, current = [], 0, ""
    for ch in text:
        if ch in "([<":
            depth += 1
        elif ch in ")]>" and not current.endswith("-"):
            depth -= 1
        if ch == sep and depth == 0:
            pieces.append(current)
            current = ""
        else:
            current += ch
    pieces.append(current)
    return [" ".join(p.split()) for p in pieces if p.strip()]


def strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def body_after(text: str, start: int) -> str:
    """The text between the `{` at or after `start` and its matching `}`."""
    open_at = text.index("{", start)
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1 : i]
    raise Problem(f"unbalanced braces after offset {start}")


def attributes_before(text: str, start: int) -> str:
    """The attribute and doc lines directly above the item at `start`."""
    lines = text[:start].split("\n")
    kept = []
    for line in reversed(lines[:-1]):
        stripped = line.strip()
        if stripped.startswith("#[") or stripped.startswith("///"):
            kept.append(stripped)
        else:
            break
    return "\n".join(reversed(kept))


def c_type(rust: str) -> str:
    """The C spelling of a Rust FFI type (`*mut *const c_char` -> `const char **`)."""
    rust = rust.strip()
    array = re.fullmatch(r"\[(.+);\s*(\w+)\]", rust)
    if array:  # a struct field `[T; N]`: `T[N]`
        return f"{c_type(array.group(1))}[{int_value(array.group(2), 'usize')}]"
    levels = []  # outermost first: True where the pointee is const
    while rust.startswith("*"):
        match = re.match(r"\*(const|mut)\s+", rust)
        if not match:
            raise Problem(f"cannot read pointer type {rust!r}")
        levels.append(match.group(1) == "const")
        rust = rust[match.end() :]
    base = RUST_INTS.get(rust) or STD_FFI.get(rust) or rust
    if not re.fullmatch(r"\w+", base) or not (base in RUST_INTS.values() or base in STD_FFI.values()
                                              or base.startswith("kvcs_") or base == "bool"):
        raise Problem(f"no C spelling for type {rust!r}")
    if not levels:
        return base
    text = ("const " if levels[-1] else "") + base + " "
    for i in reversed(range(len(levels))):
        text += "*"
        if i > 0 and levels[i - 1]:
            text += "const "
    return text.strip()


def int_value(expr: str, ty: str) -> int:
    """The value of a constant's initialiser: an integer literal or `<int>::MAX`."""
    expr = expr.strip()
    match = re.fullmatch(r"(u8|u16|u32|u64|usize)::MAX", expr)
    if match:
        return 2 ** {"u8": 8, "u16": 16, "u32": 32, "u64": 64, "usize": 64}[match.group(1)] - 1
    literal = re.sub(r"(?<=[0-9a-fA-F])(u8|u16|u32|u64|usize|i8|i16|i32|i64|isize)\b", "", expr.replace("_", ""))
    # Integer arithmetic of literals only (`1 << 16`, `4 * 4`); anything else is refused.
    if not re.fullmatch(r"[0-9a-fA-FxX()+\-*/%<>|&^ ]+", literal):
        raise Problem(f"cannot evaluate constant initialiser {expr!r} ({ty}): give it as integer arithmetic")
    try:
        return int(eval(literal.replace("/", "//"), {"__builtins__": {}}))  # noqa: S307 (checked above)
    except (SyntaxError, ValueError, ZeroDivisionError):
        raise Problem(f"cannot evaluate constant initialiser {expr!r} ({ty})") from None


class Abi:
    """What src/ffi declares."""

    def __init__(self) -> None:
        self.calls: dict[str, dict] = {}  # name -> {module, args: [(name, rust)], ret}
        self.defined: dict[str, str] = {}  # kvcs_ type -> module
        self.structs: dict[str, list[tuple[str, str]]] = {}  # name -> [(field, rust)]
        self.handles: list[str] = []
        self.enums: dict[str, tuple[str, list[tuple[str, int]]]] = {}
        self.constants: dict[str, tuple[str, int, str]] = {}  # name -> (rust type, value, module)

    def read(self) -> None:
        files = sorted(p for p in FFI.rglob("*.rs") if GENERATED not in p.parents)
        for path in files:
            module = "::".join(path.relative_to(FFI).with_suffix("").parts)
            module = module.removesuffix("::mod")
            text = path.read_text()
            for name, args, ret in FN.findall(text):
                parsed = []
                for arg in split_top(strip_comments(args)):
                    arg_name, _, arg_type = arg.partition(":")
                    parsed.append((arg_name.strip(), arg_type.strip()))
                if name in self.calls:
                    raise Problem(f"{name} is defined twice")
                self.calls[name] = {"module": module, "args": parsed, "ret": (ret or "").strip()}
            for match in ITEM.finditer(text):
                kind, name = match.groups()
                self.defined[name] = module
                attrs = attributes_before(text, match.start())
                if kind == "struct":
                    fields = []
                    for field in split_top(strip_comments(body_after(text, match.end()))):
                        field_name, _, field_type = field.removeprefix("pub ").partition(":")
                        fields.append((field_name.strip(), field_type.strip()))
                    if [f for f, _ in fields] == ["_private"]:
                        self.handles.append(name)
                    elif "repr(C)" in attrs:
                        self.structs[name] = fields
                elif kind == "enum":
                    repr_match = re.search(r"repr\((\w+)\)", attrs)
                    if not repr_match:
                        raise Problem(f"enum {name} has no #[repr(...)]")
                    variants = []
                    for variant in split_top(strip_comments(body_after(text, match.end()))):
                        variant_name, equals, value = variant.partition("=")
                        if not equals:
                            raise Problem(f"{name}::{variant_name.strip()} has no explicit value")
                        variants.append((variant_name.strip(), value.strip()))
                    self.enums[name] = (
                        RUST_INTS[repr_match.group(1)],
                        [(v, int_value(e, repr_match.group(1))) for v, e in variants],
                    )
            for name, ty, expr in CONST.findall(text):
                if name.startswith("KVCS_"):
                    self.constants[name] = (ty, int_value(expr, ty), module)
        # Engine constants the header shows under a KVCS_ name (cbindgen.toml's [export.rename]).
        renames = dict(re.findall(r'^"(\w+)" = "(KVCS_\w+)"$', CBINDGEN.read_text(), flags=re.M))
        for path in sorted((ROOT / "src").rglob("*.rs")):
            if FFI in path.parents:
                continue
            for name, ty, expr in CONST.findall(path.read_text()):
                if name in renames and ty in PRIMITIVE:
                    self.constants[renames[name]] = (ty, int_value(expr, ty), "")
        if ENTRY_POINT not in self.calls:
            raise Problem(f"src/ffi defines no {ENTRY_POINT}")

    def slots(self) -> list[str]:
        """The table's calls in slot order: api-slots.txt, then any new call appended."""
        listed = []
        if SLOTS.exists():
            for line in SLOTS.read_text().splitlines():
                if line.strip() and not line.startswith("#"):
                    slot, name = line.split()
                    if int(slot) != len(listed):
                        raise Problem(f"{SLOTS.name}: slot {slot} of {name} should be {len(listed)}")
                    listed.append(name)
        gone = [name for name in listed if name not in self.calls]
        if gone:
            raise Problem(
                f"{', '.join(gone)} left src/ffi but hold slots in {SLOTS.name}: the table is "
                "append-only; retiring a call is an ABI change (a new KVCS_ABI_VERSION)"
            )
        return listed + [n for n in self.calls if n not in listed and n != ENTRY_POINT]


def rust_uses(abi: Abi, types: list[str], extra: dict[str, str]) -> list[str]:
    """`use` lines for the named types of `types` (Rust type texts) and for
    `extra` (name -> module)."""
    std, by_module = set(), {}
    for name, module in extra.items():
        by_module.setdefault(module, set()).add(name)
    for text in types:
        for word in re.findall(r"[A-Za-z_]\w*", text):
            if word in ("const", "mut") or word in PRIMITIVE:
                continue
            if word in STD_FFI:
                std.add(word)
            elif word in abi.defined:
                by_module.setdefault(abi.defined[word], set()).add(word)
            elif word not in ("kvcs_api",):
                raise Problem(f"the generator does not know where type {word} is defined")
    lines = []
    if std:
        lines += [f"use std::ffi::{{{', '.join(sorted(std))}}};", ""]
    for module in sorted(by_module):
        names = sorted(by_module[module])
        inner = names[0] if len(names) == 1 else "{" + ", ".join(names) + "}"
        lines.append(f"use crate::ffi::{module}::{inner};")
    return lines


def function_table_rs(abi: Abi, slots: list[str]) -> str:
    calls = slots + [ENTRY_POINT]
    types = [t for n in calls for _, t in abi.calls[n]["args"]] + [abi.calls[n]["ret"] for n in calls]
    extra = {"KVCS_ABI_VERSION": abi.constants["KVCS_ABI_VERSION"][2]}
    out = [
        "//! Generated by `scripts/gen-bindings.py` from src/ffi; do not edit (run",
        "//! `make header`). The function-pointer type of every exported call,",
        "//! `kvcs_<call>_fn`, the function table [`kvcs_api`] that `kvcs_api_get`",
        "//! hands to programs that load the library at run time. Filling the table",
        "//! checks each type against its function, so a stale file does not build.",
        "//! (The struct layouts are in `struct_layout_table.rs`, which the table's",
        "//! `kvcs_struct_layout` reads: kept apart, so no module imports back.)",
        "#![allow(non_camel_case_types)]",
        "",
        "use std::mem::size_of;",
        "",
        *rust_uses(abi, types, extra),
        "",
    ]
    for name in calls:
        call = abi.calls[name]
        params = ", ".join(f"{arg}: {ty}" for arg, ty in call["args"])
        arrow = f" -> {call['ret']}" if call["ret"] else ""
        out.append(f"/// The type of `{name}`.")
        out.append(f'pub type {name}_fn = unsafe extern "C" fn({params}){arrow};')
    out += [
        "",
        "/// Every call of the library as one table of function pointers, for a",
        "/// program that loads kvcsum at run time: it resolves the one symbol",
        "/// `kvcs_api_get` and calls through the table, whose entries the compiler",
        "/// checks. Entries keep their place forever (src/ffi/api-slots.txt): new",
        "/// calls are appended, none moves or goes away within an ABI version, so",
        "/// `size` says which entries a library has. A program built against a newer",
        "/// header than the library checks an entry with `KVCS_API_HAS(api, entry)`",
        "/// before calling it.",
        "///",
        "/// Ownership: the library's, static; never freed. Thread safety: read-only,",
        "/// shared by every thread.",
        "#[repr(C)]",
        "pub struct kvcs_api {",
        "    /// `sizeof(kvcs_api)` in the library that filled it; the entries lie in",
        "    /// its first `size` bytes.",
        "    pub size: usize,",
        "    /// The library's ABI version, `KVCS_ABI_VERSION`.",
        "    pub abi_version: u32,",
    ]
    for slot, name in enumerate(slots):
        out.append(f"    /// Slot {slot}: `{name}`.")
        out.append(f"    pub {name}: {name}_fn,")
    out += [
        "}",
        "",
        "/// The table `kvcs_api_get` gives out.",
        "pub(crate) static API: kvcs_api = kvcs_api {",
        "    size: size_of::<kvcs_api>(),",
        "    abi_version: KVCS_ABI_VERSION,",
    ]
    for name in slots:
        out.append(f"    {name}: crate::ffi::{abi.calls[name]['module']}::{name},")
    out += [
        "};",
    ]
    return rustfmt("\n".join(out) + "\n")


def layouts_rs(abi: Abi) -> str:
    types = [t for fields in abi.structs.values() for _, t in fields] + list(abi.structs)
    uses = rust_uses(abi, types, {})
    # std::ffi's CStr (the names), and what the fields need (`c_char`).
    std = {"CStr"}
    for line in uses:
        if line.startswith("use std::ffi::{"):
            std |= {name.strip() for name in line[len("use std::ffi::{") : -len("};")].split(",")}
    out = [
        "//! Generated by `scripts/gen-bindings.py` from src/ffi; do not edit (run",
        "//! `make header`). The layout of every struct the ABI passes, as this build",
        "//! lays it out, for `kvcs_struct_layout` and `kvcs_struct_field`",
        "//! (struct_layout.rs), so that a binding compares field offsets, not only",
        "//! sizes, against the library it loaded.",
        "",
        "use std::ffi::CStr;" if std == {"CStr"} else f"use std::ffi::{{{', '.join(sorted(std))}}};",
        "use std::mem::{offset_of, size_of};",
        "",
        *[line for line in uses if not line.startswith("use std::ffi")],
        "",
        "/// The layout of one struct of the ABI in this build.",
        "pub(crate) struct StructLayout {",
        "    /// The C name (`kvcs_layer`).",
        "    pub(crate) name: &'static CStr,",
        "    /// `sizeof` the struct.",
        "    pub(crate) size: usize,",
        "    /// Its fields in declaration order.",
        "    pub(crate) fields: &'static [FieldLayout],",
        "}",
        "",
        "/// One field of a [`StructLayout`].",
        "pub(crate) struct FieldLayout {",
        "    /// The field's C name.",
        "    pub(crate) name: &'static CStr,",
        "    /// `offsetof` the field.",
        "    pub(crate) offset: usize,",
        "    /// `sizeof` the field.",
        "    pub(crate) size: usize,",
        "}",
        "",
        "/// The layout of every struct the ABI passes, as this build lays it out.",
        "pub(crate) static STRUCT_LAYOUTS: &[StructLayout] = &[",
    ]
    for name, fields in abi.structs.items():
        out.append(f'    StructLayout {{ name: c"{name}", size: size_of::<{name}>(), fields: &[')
        for field, ty in fields:
            out.append(
                f'        FieldLayout {{ name: c"{field}", offset: offset_of!({name}, {field}), size: size_of::<{ty}>() }},'
            )
        out.append("    ] },")
    out.append("];")
    return rustfmt("\n".join(out) + "\n")


def rustfmt(text: str) -> str:
    done = subprocess.run(
        ["rustfmt", "--edition", "2021", "--config-path", str(ROOT / "rustfmt.toml"), "--emit", "stdout"],
        input=text,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise Problem(f"rustfmt failed on the generated function_table.rs:\n{done.stderr}")
    return done.stdout


def python_abi(abi: Abi, slots: list[str]) -> str:
    def c(rust: str) -> str:
        return c_type(rust) if rust else "void"

    out = [
        '"""The C ABI of libkvcsum as data, in the header\'s C spelling.',
        "",
        "Generated by scripts/gen-bindings.py from src/ffi; do not edit (run",
        "`make header`; tests/it/header.rs fails when this file is stale). _lib turns",
        "it into ctypes declarations and checks STRUCTS against the loaded",
        "library's own layout (kvcs_struct_layout, kvcs_struct_field).",
        '"""',
        "",
        "#: Every #define of the header with an integer value.",
        "CONSTANTS = {",
    ]
    for name, (_, value, _) in sorted(abi.constants.items()):
        out.append(f'    "{name}": {value},')
    out += ["}", "", "#: Each enum: (its C integer type, {enumerator: value}).", "ENUMS = {"]
    for name, (repr_type, variants) in abi.enums.items():
        out.append(f'    "{name}": (')
        out.append(f'        "{repr_type}",')
        out.append("        {")
        for variant, value in variants:
            out.append(f'            "{variant}": {value},')
        out.append("        },")
        out.append("    ),")
    out += ["}", "", "#: Opaque handle types (passed as pointers only).", "HANDLES = ("]
    out += [f'    "{name}",' for name in abi.handles]
    out += [")", "", "#: Each struct's fields in order: (name, C type).", "STRUCTS = {"]
    for name, fields in abi.structs.items():
        out.append(f'    "{name}": (')
        out += [f'        ("{field}", "{c(ty)}"),' for field, ty in fields]
        out.append("    ),")
    out += [
        "}",
        "",
        "#: Each call: (return type, ((parameter, C type), ...)); the table's",
        "#: calls in slot order, then the entry point.",
        "CALLS = {",
    ]
    for name in slots + [ENTRY_POINT]:
        call = abi.calls[name]
        out.append(f'    "{name}": (')
        out.append(f'        "{c(call["ret"])}",')
        if call["args"]:
            out.append("        (")
            out += [f'            ("{arg}", "{c(ty)}"),' for arg, ty in call["args"]]
            out.append("        ),")
        else:
            out.append("        (),")
        out.append("    ),")
    out.append("}")
    return "\n".join(out) + "\n"


def slots_txt(slots: list[str]) -> str:
    lines = [
        "# The slot of each call in kvcs_api (src/ffi/generated/function_table.rs), one per line.",
        "# scripts/gen-bindings.py appends new calls; a slot is never renumbered,",
        "# reused or removed within an ABI version (programs built against an",
        "# older header find their entries where they were).",
    ]
    return "\n".join(lines + [f"{slot} {name}" for slot, name in enumerate(slots)]) + "\n"


def main() -> int:
    check = sys.argv[1:] == ["--check"]
    if sys.argv[1:] not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        return 2
    abi = Abi()
    try:
        abi.read()
        slots = abi.slots()
        outputs = {
            SLOTS: slots_txt(slots),
            FUNCTION_TABLE: function_table_rs(abi, slots),
            LAYOUTS: layouts_rs(abi),
            PYTHON_ABI: python_abi(abi, slots),
        }
    except Problem as problem:
        print(f"gen-bindings: {problem}", file=sys.stderr)
        return 1
    stale = []
    for path, text in outputs.items():
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        stale.append(path)
        if check:
            relative = str(path.relative_to(ROOT))
            diff = difflib.unified_diff(
                current.splitlines(), text.splitlines(), relative, relative + " (generated)", lineterm="", n=1
            )
            print("\n".join(list(diff)[:40]), file=sys.stderr)
        else:
            path.write_text(text)
    names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
    if check:
        if stale:
            print(f"gen-bindings: stale: {names}; run `make header` and commit", file=sys.stderr)
            return 1
        return 0
    print(f"gen-bindings: {len(slots)} table entries, {len(abi.structs)} structs; wrote {names or 'nothing (current)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
