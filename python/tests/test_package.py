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

import numpy as np
import pytest

import kvcsum
from kvcsum import _lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("KVCS_SEED", "0x706B67"), 0)
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


@pytest.fixture
def seed(request):
    value = SEED + sum(map(ord, request.node.name))
    print(f"random data seed {value:#x} (KVCS_SEED={SEED:#x})")
    return value


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


# --- Enums --------------------------------------------------------------------------

#: Each IntEnum with its C enum and the prefix its names drop.
ENUMS = {
    "Status": ("kvcs_status", "KVCS_(?:ERR_)?"),
    "Role": ("kvcs_role", "KVCS_ROLE_"),
    "Algorithm": ("kvcs_algorithm", "KVCS_ALGORITHM_"),
    "Policy": ("kvcs_policy", "KVCS_POLICY_"),
    "Verdict": ("kvcs_verdict", "KVCS_VERDICT_"),
    "Direction": ("kvcs_direction", "KVCS_DIRECTION_"),
    "Reason": ("kvcs_unverified_reason", "KVCS_UNVERIFIED_"),
    "StoredOutcome": ("kvcs_stored_outcome", "KVCS_STORED_"),
}


def header_enum(name: str, prefix: str) -> dict:
    """{name without prefix: value} of `enum name { ... }` in kvcsum.h."""
    header = (ROOT / "include" / "kvcsum.h").read_text()
    body = re.search(rf"^enum {name}\b[^{{]*{{(.*?)^}};", header, flags=re.M | re.S)
    assert body, f"no enum {name} in kvcsum.h"
    entries = re.findall(rf"^\s*{prefix}(\w+) = (\d+),", body.group(1), flags=re.M)
    assert entries, f"enum {name} has no {prefix}* entry"
    return {entry: int(value) for entry, value in entries}


@pytest.mark.parametrize("enum_name", sorted(ENUMS))
def test_each_enum_is_its_c_enum(enum_name):
    c_name, prefix = ENUMS[enum_name]
    enum_type = getattr(kvcsum, enum_name)
    assert enum_name in kvcsum.__all__
    assert {member.name: member.value for member in enum_type} == header_enum(c_name, prefix)
    for member in enum_type:
        assert isinstance(member, int) and member == member.value
        assert str(member) == str(member.value) and f"{member}" == str(member.value)
        assert repr(member) == f"<{enum_name}.{member.name}: {member.value}>"


def test_the_constants_of_before_are_the_enum_members():
    aliases = {"STORED_": kvcsum.StoredOutcome}
    for name in ("PRODUCER", "CONSUMER"):
        assert getattr(kvcsum, name) is kvcsum.Role[name]
    for name in ("WEIGHTED", "MIXED"):
        assert getattr(kvcsum, name) is kvcsum.Algorithm[name]
    for name in ("FAIL_OPEN", "FAIL_CLOSED"):
        assert getattr(kvcsum, name) is kvcsum.Policy[name]
    for name in ("MATCH", "MISMATCH", "UNVERIFIED"):
        assert getattr(kvcsum, name) is kvcsum.Verdict[name]
    for name in ("SENDING", "RECEIVING"):
        assert getattr(kvcsum, name) is kvcsum.Direction[name]
    for member in kvcsum.Reason:
        if member.name != "NONE":
            assert getattr(kvcsum, member.name) is member
    for prefix, enum_type in aliases.items():
        for member in enum_type:
            assert getattr(kvcsum, prefix + member.name) is member
    assert kvcsum.HOST == -1 and kvcsum.WHOLE_LOAD == 0xFFFFFFFF


def test_reports_and_errors_give_enum_members(seed):
    rng = np.random.default_rng(seed)
    cache = rng.integers(0, 2**16, (4, 8, 2, 32), dtype=np.uint16)
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(cache)
        worker.add_group(0, 8)
        worker.add_layer(kvcsum.layer(cache, "NHD", layer_number=0))
        blocks.add_request("req", 20).add_group("req", 0, [2, 0, 3])
        with worker.checksum(blocks, kvcsum.Role.CONSUMER) as result:
            record = result.encode()
        with kvcsum.Verifier(1) as verifier:
            verifier.expect(blocks, kvcsum.Role.CONSUMER)
            verifier.add_record(record)
            with verifier.check("req", None) as report:
                assert report.verdict is kvcsum.Verdict.UNVERIFIED, f"seed {seed:#x}"
                assert report.reason is kvcsum.Reason.NO_CHECKSUMS
                assert [f.reason for f in report.findings] == [kvcsum.Reason.NO_CHECKSUMS]
                assert type(report.findings[0].reason) is kvcsum.Reason
            with pytest.raises(kvcsum.NotFound) as caught:
                verifier.check("never expected", None)
            assert caught.value.status is kvcsum.Status.NOT_FOUND
