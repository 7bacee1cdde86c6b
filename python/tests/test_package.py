"""The package as Python users meet it: every public name of
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
    paths = [str(PACKAGE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    environment["PYTHONPATH"] = os.pathsep.join(paths)
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
    # Where this package was installed (by pip, not an egg-info a build left
    # in the source tree), its metadata agrees.
    try:
        distribution = importlib.metadata.distribution("kvcsum")
    except importlib.metadata.PackageNotFoundError:
        return
    installed = distribution.read_text("INSTALLER") is not None
    if installed and pathlib.Path(distribution.locate_file("kvcsum/__init__.py")).resolve() == PACKAGE / "__init__.py":
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
    places = [str(tmp_path / "package" / "libkvcsum.so"), str(tmp_path / "libkvcsum.so"), "libkvcsum-no.so.2"]
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
    "TierOutcome": ("kvcs_tier_outcome", "KVCS_TIER_"),
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
    for name in ("WEIGHTED", "MIXED", "MIXED2"):
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


def test_the_encoding_versions_are_the_headers():
    header = (ROOT / "include" / "kvcsum.h").read_text()
    for name in ("ABI_VERSION", "PAYLOAD_VERSION", "EXTENSION_VERSION", "RECORD_VERSION"):
        defined = re.search(rf"^#define KVCS_{name} (\d+)$", header, flags=re.M)
        assert defined, f"no KVCS_{name} in kvcsum.h"
        assert getattr(kvcsum, name) == int(defined.group(1)), name


# --- python -m kvcsum --version -------------------------------------------------------


def test_python_m_kvcsum_version_prints_every_version():
    done = run_python("-m", "kvcsum", "--version")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        f"kvcsum {kvcsum.__version__} (Python package at {PACKAGE})",
        f"library: {kvcsum.version()} ({kvcsum.library().path})",
        f"ABI version: {kvcsum.ABI_VERSION}",
        f"payload version: {kvcsum.PAYLOAD_VERSION} (extension {kvcsum.EXTENSION_VERSION}, "
        f"record {kvcsum.RECORD_VERSION})",
    ], done.stdout


def test_python_m_kvcsum_version_without_a_library_says_why(tmp_path):
    done = run_python("-m", "kvcsum", "--version", env={"KVCSUM_LIBRARY": str(tmp_path / "absent.so")})
    assert done.returncode == 1
    assert done.stdout.startswith(f"kvcsum {kvcsum.__version__} ")
    assert "MissingLibraryError" in done.stderr and str(tmp_path / "absent.so") in done.stderr, done.stderr
    done = run_python("-m", "kvcsum", "--no-such-option")
    assert done.returncode == 2 and "--no-such-option" in done.stderr


# --- Reprs ---------------------------------------------------------------------------


def two_block_load(rng, flip: bool):
    """A producer's payload and a consumer's record of one request over two
    blocks, the consumer's cache with one bit flipped in block position 1
    when `flip`."""
    cache = rng.integers(0, 2**16, (3, 8, 2, 32), dtype=np.uint16)  # NHD
    loaded = cache.copy()
    if flip:
        loaded[0, int(rng.integers(0, 8)), int(rng.integers(0, 2)), int(rng.integers(0, 32))] ^= 4

    def record(array, role):
        with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
            worker.add_region_of(array)
            worker.add_group(0, 8)
            worker.add_layer(kvcsum.layer(array, "NHD", layer_number=0))
            blocks.add_request("req", 16).add_group("req", 0, [2, 0])
            with worker.checksum(blocks, role) as result:
                return result.encode()

    with kvcsum.Verifier(1) as producer, kvcsum.Blocks() as blocks:
        blocks.add_request("req", 16).add_group("req", 0, [2, 0])
        producer.expect(blocks, kvcsum.PRODUCER)
        producer.add_record(record(cache, kvcsum.PRODUCER))
        return producer.payload("req"), record(loaded, kvcsum.CONSUMER)


def test_handles_say_what_they_are(seed):
    rng = np.random.default_rng(seed)
    cache = rng.integers(0, 2**16, (4, 8, 2, 32), dtype=np.uint16)
    worker = kvcsum.Worker(tp_rank=1, tp_size=2, num_threads=1)
    assert repr(worker) == (
        "<kvcsum.Worker tp_rank=1 tp_size=2 pp_rank=0 device=host num_threads=1 algorithm=MIXED2 layers=0>"
    )
    worker.set_algorithm(kvcsum.WEIGHTED)
    worker.add_region_of(cache)
    worker.add_group(0, 8)
    worker.add_layer(kvcsum.layer(cache, "NHD", layer_number=0, first_head=2))
    assert repr(worker).endswith("num_threads=1 algorithm=WEIGHTED layers=1>"), repr(worker)
    assert repr(kvcsum.Worker()).startswith("<kvcsum.Worker tp_rank=0 tp_size=1 pp_rank=0 device=host num_threads=all ")

    blocks = kvcsum.Blocks()
    assert repr(blocks) == "<kvcsum.Blocks requests=0 groups=0>"
    blocks.add_request("req", 12).add_group("req", 0, [3, 1])
    with pytest.raises(kvcsum.NotFound):
        blocks.add_group("unknown", 0, [0])
    assert repr(blocks) == "<kvcsum.Blocks requests=1 groups=1>"

    result = worker.checksum(blocks)
    assert repr(result) == "<kvcsum.Result ready>"
    # A repr never waits: with the result held alone elsewhere, it says so.
    with result._use(exclusive=True):
        assert repr(result) == "<kvcsum.Result (in use by another thread)>"
    for handle, name in ((result, "Result"), (worker, "Worker"), (blocks, "Blocks")):
        handle.close()
        assert repr(handle) == f"<kvcsum.{name} closed>"

    verifier = kvcsum.Verifier(2)
    assert repr(verifier) == "<kvcsum.Verifier num_workers=2 policy=FAIL_CLOSED>"
    verifier.set_policy(kvcsum.FAIL_OPEN)
    with pytest.raises(kvcsum.InvalidArgument):
        verifier.set_policy(7)
    assert repr(verifier) == "<kvcsum.Verifier num_workers=2 policy=FAIL_OPEN>"
    verifier.close()

    topology = kvcsum.Topology("local", tp_rank=0, tp_size=2, total_kv_heads=8, block_size=16)
    remote = kvcsum.RemoteEngine(tp_size=4, block_bytes=4096, block_size=16)
    assert topology.add_remote("far", remote) and not topology.add_remote("far", remote)
    assert repr(topology) == (
        "<kvcsum.Topology 'local' tp_rank=0 tp_size=2 total_kv_heads=8 block_size=16 is_mla=False remotes=1>"
    )
    completion = kvcsum.Completion(4)
    completion.set_expected(2)
    assert repr(completion) == "<kvcsum.Completion expected_workers=2>"


@pytest.mark.parametrize("flip", [False, True])
def test_a_report_says_its_verdict_reason_and_mismatches(seed, flip):
    payload, record = two_block_load(np.random.default_rng(seed), flip)
    with kvcsum.Verifier(1) as verifier, kvcsum.Blocks() as scheduled:
        scheduled.add_request("req", 16).add_group("req", 0, [2, 0])
        verifier.expect(scheduled, kvcsum.CONSUMER)
        verifier.add_record(record)
        with verifier.check("req", payload) as report:
            expected = "MATCH passed=True reason=NONE mismatches=0"
            if flip:
                expected = "MISMATCH passed=False reason=NONE mismatches=1"
            assert repr(report) == f"<kvcsum.Report {expected} compared_positions=2>", f"seed {seed:#x}"
            if flip:
                assert repr(report.mismatches[0]).startswith("Mismatch(group_id=0, first_position=1, num_positions=1,")
        with verifier.check("req", None) as report:
            assert repr(report) == (
                "<kvcsum.Report UNVERIFIED passed=False reason=NO_CHECKSUMS mismatches=0 compared_positions=0>"
            )
            assert repr(report.findings[0]).startswith("Finding(reason=<Reason.NO_CHECKSUMS: 1>, ")


# --- Thread safety ---------------------------------------------------------------------


def test_every_public_class_states_its_thread_safety():
    for name in kvcsum.__all__:
        value = getattr(kvcsum, name)
        if isinstance(value, type) and not issubclass(value, BaseException):
            assert "Thread safety:" in (value.__doc__ or ""), f"kvcsum.{name} does not say whether threads may share it"
    assert "needs exclusive use" in kvcsum.Worker.__doc__
