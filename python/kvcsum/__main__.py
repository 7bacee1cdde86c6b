"""`python -m kvcsum --version`: the versions of the package, of the
library it loads (and where from), of the C ABI and of the payload,
extension and record encodings. Exits 1, saying why, when the library
cannot be loaded."""

import argparse
import pathlib
import sys

import kvcsum


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcsum",
        description="kvcsum: layout-independent checksums of LLM KV-cache blocks (see help(kvcsum)).",
    )
    parser.add_argument(
        "--version",
        action="store_true",
        help="print the package, library, ABI and payload versions and the library's path",
    )
    arguments = parser.parse_args(argv)
    if not arguments.version:
        parser.print_help()
        return 0
    print(f"kvcsum {kvcsum.__version__} (Python package at {pathlib.Path(kvcsum.__file__).parent})")
    try:
        library = kvcsum.library()
    except ImportError as error:  # MissingLibraryError or AbiError: say which, and why
        print(f"library: none loaded: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"library: {kvcsum.version()} ({library.path})")
    print(f"ABI version: {library.kvcs_abi_version()}")
    print(
        f"payload version: {kvcsum.PAYLOAD_VERSION} "
        f"(extension {kvcsum.EXTENSION_VERSION}, record {kvcsum.RECORD_VERSION})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
