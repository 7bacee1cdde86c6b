# The SGLang tests run in their own venv (make sglang-test); where SGLang or
# torch is missing (the other venvs) this folder is not collected. SGLang is
# looked for by its `sglang.srt` package: this folder is itself named
# sglang, and with python/tests on sys.path a bare `sglang` would be found
# as this folder (a namespace package) where SGLang is not installed.
import importlib.util
import os

import pytest


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


collect_ignore_glob = []
if not (_installed("sglang.srt") and _installed("torch")):
    collect_ignore_glob = ["*.py"]


@pytest.fixture
def plugin_site(tmp_path) -> str:
    """A folder whose distribution declares kvcsum's SGLang entry point as
    python/pyproject.toml does: what installing the kvcsum wheel gives
    importlib.metadata (these tests import kvcsum from the source tree)."""
    import tomllib

    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "pyproject.toml"), "rb") as f:
        points = tomllib.load(f)["project"]["entry-points"]["sglang.srt.plugins"]
    info = tmp_path / "site" / "kvcsum_sglang_entry-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcsum-sglang-entry\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
    )
    return str(tmp_path / "site")
