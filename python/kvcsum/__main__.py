"""`python -m kvcsum --version`: the versions of the package, of the
library it loads (and where from), of the C ABI and of the payload,
extension and record encodings. Exits 1, saying why, when the library
cannot be loaded.

`python -m kvcsum inspect PAYLOAD [PAYLOAD]` (or `--file F`): what a
payload (the base64 of kv_transfer_params["kv_checksums"]) says, and with
two the differences (docs/operations.md). Exits 2 for input that is not a
payload, 1 when two payloads differ."""

import argparse
import pathlib
import sys

import kvcsum


def _version() -> int:
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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="print what a payload says (two: and what differs)",
        description=(
            "Print what a payload says: its version, tokens, groups, fingerprints, algorithm, block sizes and "
            "values per position and short last values; with two payloads, also what differs (exit status 1 when something does). "
            "A payload is the base64 text of kv_transfer_params['kv_checksums'] (a pasted log line or "
            "dump holding kv_checksums works too), or a file of that text or of the payload's bytes. "
            "Input that is not a payload exits with status 2."
        ),
    )
    inspect.add_argument("payloads", nargs="*", metavar="PAYLOAD", help="base64 text of kv_checksums")
    inspect.add_argument(
        "--file", action="append", metavar="F", help="read a payload from file F (base64 text or bytes); twice for two"
    )
    inspect.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: {'payloads': [...], 'differences': [...]} (the same facts, for scripts)",
    )
    arguments = parser.parse_args(argv)
    if arguments.command == "inspect":
        from kvcsum._inspect import main as inspect_main

        return inspect_main(arguments)
    if not arguments.version:
        parser.print_help()
        return 0
    return _version()


if __name__ == "__main__":
    sys.exit(main())
