# The SGLang tests run in their own venv (make sglang-test); where SGLang or
# torch is missing (the other venvs) this folder is not collected.
import importlib.util

collect_ignore_glob = []
if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["*.py"]
