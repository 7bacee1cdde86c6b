# Markers of the Python tests. `torch` marks a test that needs torch: the
# plain venv deselects it (-m "not torch"), make vllm-test runs it in the
# vLLM venv (-m torch); a test never skips itself for a missing package.


def pytest_configure(config):
    config.addinivalue_line("markers", "torch: needs torch (run by make vllm-test)")
