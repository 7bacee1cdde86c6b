# The vLLM tests run in their own venv (make vllm-test); where vLLM or torch
# is missing (the plain Python tests' venv) this folder is not collected.
import importlib.util

import pytest

collect_ignore_glob = []
if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["*.py"]


@pytest.fixture
def ds_conv_layout(monkeypatch):
    """vLLM's Mamba conv states in its DS layout, (dim, state_len)
    (VLLM_SSM_CONV_STATE_LAYOUT=DS, as vLLM's NIXL connector requires), for
    one test: vLLM caches the layout it read (mamba_utils.
    get_conv_state_layout, an lru_cache), so the cache is cleared before
    and after (monkeypatch then restores the variable)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    get_conv_state_layout.cache_clear()
    yield
    get_conv_state_layout.cache_clear()
