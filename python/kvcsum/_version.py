"""The package's version: the one place it is written (pyproject.toml reads
it from here; python/tests/test_package.py checks it equals Cargo.toml's,
the library's)."""

__version__ = "0.3.0"
