# The SGLang tests run in their own venv (make sglang-test); where SGLang or
# torch is missing (the other venvs) this folder is not collected. SGLang is
# looked for by its `sglang.srt` package: this folder is itself named
# sglang, and with python/tests on sys.path a bare `sglang` would be found
# as this folder (a namespace package) where SGLang is not installed.
import importlib.util


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


collect_ignore_glob = []
if not (_installed("sglang.srt") and _installed("torch")):
    collect_ignore_glob = ["*.py"]
