"""Builds the package with libkvcsum inside it: setuptools-rust runs cargo
(release) on the repository's Cargo.toml and puts the library into the
package as kvcsum/libkvcsum.so, where kvcsum/_lib.py loads it through
ctypes before looking anywhere else. `pip install ./python` and
`pip wheel ./python` from a source checkout do this (cargo must be on
PATH); everything else about the package is in pyproject.toml.

The library is a plain cdylib with a C ABI, not a Python extension module,
hence Binding.NoBinding, the file name without the interpreter's suffix,
and a wheel tagged py3-none-<platform>: one wheel serves every Python 3.
`make python-wheel` builds it against glibc 2.28's symbols (cargo through
scripts/zigbuild-cargo.sh) and gives it the manylinux_2_28 tag with
auditwheel (docs/python.md).

cargo builds into the repository's target/ (or $CARGO_TARGET_DIR), with
Cargo.toml's own crate types, so a library that `cargo build --release
--lib` already built is reused rather than built again as a cdylib alone.
"""

import pathlib

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools_rust import Binding, RustExtension, Strip

HERE = pathlib.Path(__file__).resolve().parent
MANIFEST = HERE.parent / "Cargo.toml"

#: The file kvcsum/_lib.py looks for beside the package.
LIBRARY_FILE = "libkvcsum.so"

#: Cargo.toml's [lib] crate-type, in its order (python/tests/test_package.py
#: checks they agree). setuptools-rust would otherwise ask for a cdylib
#: alone, a different build of the crate than `cargo build --lib`, and each
#: build would undo the other's.
CRATE_TYPES = ["cdylib", "staticlib", "rlib"]


class BuildLibrary(build_ext):
    """Names the library kvcsum/libkvcsum.so, not libkvcsum.cpython-3XY-....so:
    it is loaded with ctypes, not imported, and serves every Python."""

    def get_ext_filename(self, fullname):
        if fullname.rpartition(".")[2] == "libkvcsum":
            return LIBRARY_FILE
        return super().get_ext_filename(fullname)


class WheelForAnyPython(bdist_wheel):
    """Tags the wheel py3-none-<platform>: it holds a C library and pure
    Python, nothing built against one interpreter's ABI."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


if not MANIFEST.is_file():
    raise SystemExit(
        f"kvcsum: no {MANIFEST}; the package builds libkvcsum from the repository it lives in: "
        "run `pip install ./python` (or `pip wheel ./python`) in a checkout of kvcsum"
    )

setup(
    rust_extensions=[
        RustExtension(
            "kvcsum.libkvcsum",
            path=str(MANIFEST),
            binding=Binding.NoBinding,
            strip=Strip.Debug,
            args=["--crate-type", ",".join(CRATE_TYPES)],
            cargo_manifest_args=["--locked"],  # Cargo.lock as checked in (metadata and build)
        )
    ],
    cmdclass={"build_ext": BuildLibrary, "bdist_wheel": WheelForAnyPython},
    zip_safe=False,
)
