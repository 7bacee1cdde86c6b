"""kvcsum inside vLLM: `KvcsumConnector`, a vLLM KV connector that wraps any
other and adds verified transfers.

    vllm serve MODEL --kv-transfer-config '{
        "kv_connector": "KvcsumConnector",
        "kv_connector_module_path": "kvcsum.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"inner": {"kv_connector": "NixlConnector"}}}'

See docs/vllm.md. The connector (kvcsum.vllm.connector) imports
vLLM; the worker part (kvcsum.vllm.worker) needs torch alone. This package
imports neither until asked, so `import kvcsum.vllm.worker` works on a
machine without vLLM.
"""

__all__ = ["KvcsumConnector", "KvcsumConnectorMetadata", "KvcsumWorkerMetadata", "KvcsumStats"]


def __getattr__(name):
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
