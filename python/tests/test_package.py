"""The package as Python users meet it (issue 22): every public name of
before the split by job still there, __version__ from one place, py.typed,
a missing library as its own exception, the enums equal to kvcsum.h,
reprs, `python -m kvcsum --version`, and a thread-safety line per class.
Runs over the source tree (PYTHONPATH) and over the installed wheel alike
(make python-test). Random data is seeded; the seed is printed (and named
in failures), and KVCS_SEED changes it."""

import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import pytest

import kvcsum
from kvcsum import _lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = pathlib.Path(kvcsum.__file__).resolve().parent

#: Every public kvcsum.X before the package was split by job (recorded
#: from dir(kvcsum) then, less the modules and names it imported).
PUBLIC_BEFORE_THE_SPLIT = """
    ABI_VERSION ALGORITHM_DIFFERS AbiError BLOCK_CHECKSUM_BYTES BLOCK_SIZE_UNKNOWN
    Blocks BufferTooSmall CONSUMER COVERAGE_DIFFERS Completion DeviceError Error
    FAIL_CLOSED FAIL_OPEN FINGERPRINT_DIFFERS Finding HOST HeadSource
    INVALID_CHECKSUMS InternalError InvalidArgument Layer LayerDifference MATCH
    MISMATCH MIXED Malformed Mismatch NOTHING_READ NOT_LOAD_CHECK NO_CHECKSUMS
    NO_COMMON_POSITION NotFound NotReady ONE_SIDED_GROUP OTHER_BLOCKS OutOfBounds
    PRODUCER RECEIVING REPLICA_MISSING ROLE_DIFFERS RemoteEngine RepairBlock
    Report Result SENDING STATE_TP_DIFFERS STORED_FAILED STORED_MATCHED
    STORED_NOT_CHECKED STORED_OTHER_ALGORITHM STORED_OTHER_FINGERPRINT StateTensor
    Topology UNCOMPARED_POSITIONS UNVERIFIED Unsupported Verifier WEIGHTED
    WHOLE_LOAD WORKERS_MISSING Worker base64_decode base64_encode
    block_size_ratio handshake_targets head_sources layer library
    local_kv_replicated rank_heads region_of remote_kv_replicated remote_ranks
    repair_plan tp_ratio version
""".split()


def run_python(*args, env=None) -> subprocess.CompletedProcess:
    """A fresh interpreter that imports this same package (and library)."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    environment.update(env or {})
    return subprocess.run([sys.executable, *args], env=environment, capture_output=True, text=True, timeout=120)


def cargo_version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), flags=re.M).group(1)


# --- Names, version, py.typed ----------------------------------------------------


def test_every_public_name_of_before_the_split_is_still_there():
    missing = [name for name in PUBLIC_BEFORE_THE_SPLIT if not hasattr(kvcsum, name)]
    assert not missing, f"kvcsum lost {missing}"
    # Each is kvcsum.X to users (reprs, messages, pickles), not kvcsum._module.X.
    for name in PUBLIC_BEFORE_THE_SPLIT:
        value = getattr(kvcsum, name)
        if isinstance(value, type) or callable(value):
            assert value.__module__ == "kvcsum", (name, value.__module__)
    assert set(kvcsum.__all__) <= set(dir(kvcsum)), set(kvcsum.__all__) - set(dir(kvcsum))
    assert len(kvcsum.__all__) == len(set(kvcsum.__all__))


def test_version_is_written_once_and_is_the_librarys():
    assert kvcsum.__version__ == cargo_version()
    assert kvcsum.version() == kvcsum.__version__, "the library loaded is of another version than the package"
    # pyproject.toml takes it from kvcsum/_version.py rather than stating it again.
    pyproject = (ROOT / "python" / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "kvcsum._version.__version__" in pyproject
    assert not re.search(r"^version\s*=\s*\"", pyproject, flags=re.M), "pyproject.toml states a version"
    # Where this is an installed distribution, its metadata agrees.
    try:
        distribution = importlib.metadata.distribution("kvcsum")
    except importlib.metadata.PackageNotFoundError:
        return
    if pathlib.Path(distribution.locate_file("kvcsum/__init__.py")).resolve() == PACKAGE / "__init__.py":
        assert distribution.version == kvcsum.__version__


def test_the_package_is_typed():
    assert (PACKAGE / "py.typed").is_file(), f"no py.typed in {PACKAGE}"
    assert '"py.typed"' in (ROOT / "python" / "pyproject.toml").read_text()


def test_the_wheel_build_asks_cargo_for_cargo_tomls_crate_types():
    """Else the wheel's cargo build and `cargo build --lib` would each
    rebuild the crate the other built."""
    cargo = re.search(r"^\[lib\]\s*\ncrate-type = \[([^\]]*)\]", (ROOT / "Cargo.toml").read_text(), flags=re.M)
    assert cargo, "no [lib] crate-type in Cargo.toml"
    setup = ast.parse((ROOT / "python" / "setup.py").read_text())
    [assigned] = [
        node.value
        for node in setup.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CRATE_TYPES"
    ]
    assert ast.literal_eval(assigned) == re.findall(r'"([^"]+)"', cargo.group(1))


# --- A missing library --------------------------------------------------------------


def test_a_missing_library_is_its_own_error_saying_where_it_looked(monkeypatch, tmp_path):
    assert issubclass(kvcsum.MissingLibraryError, ImportError)
    assert not issubclass(kvcsum.MissingLibraryError, kvcsum.AbiError)
    assert not issubclass(kvcsum.AbiError, kvcsum.MissingLibraryError)
    places = [str(tmp_path / "package" / "libkvcsum.so"), str(tmp_path / "target" / "libkvcsum.so"), "libkvcsum-absent.so.0"]
    monkeypatch.delenv("KVCSUM_LIBRARY", raising=False)
    monkeypatch.setattr(_lib, "search_path", lambda: places)
    with pytest.raises(kvcsum.MissingLibraryError) as caught:
        _lib.load()
    message = str(caught.value)
    for place in places:
        assert place in message, message
    for fix in ("pip install ./python", "cargo build --release", "make install", "KVCSUM_LIBRARY"):
        assert fix in message, message

    # $KVCSUM_LIBRARY naming no file: the message says so.
    monkeypatch.setenv("KVCSUM_LIBRARY", str(tmp_path / "gone.so"))
    with pytest.raises(kvcsum.MissingLibraryError, match=r"\$KVCSUM_LIBRARY is .*gone\.so, which does not exist"):
        _lib.load()
    # A file that is there but no library is an AbiError, not a missing one.
    (tmp_path / "gone.so").write_bytes(b"\x7fELF and nothing else")
    with pytest.raises(kvcsum.AbiError, match="cannot load libkvcsum") as caught:
        _lib.load()
    assert not isinstance(caught.value, kvcsum.MissingLibraryError)


def test_import_needs_no_library_and_the_first_call_says_it_is_missing(tmp_path):
    code = (
        "import kvcsum\n"
        "try:\n"
        "    kvcsum.Blocks()\n"
        "except kvcsum.MissingLibraryError as error:\n"
        "    print('missing:', error)\n"
    )
    done = run_python("-c", code, env={"KVCSUM_LIBRARY": str(tmp_path / "nowhere" / "libkvcsum.so")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("missing: kvcsum: libkvcsum not found"), done.stdout
    assert str(tmp_path / "nowhere" / "libkvcsum.so") in done.stdout
