# The vLLM tests run in their own venv (make vllm-test); where vLLM or torch
# is missing (the plain Python tests' venv) this folder is not collected.
import importlib.util

collect_ignore_glob = []
if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["*.py"]
