"""kvcsum inside vLLM: `KvcsumConnector`, a vLLM KV connector that wraps any
other and adds verified transfers.

    vllm serve MODEL --kv-transfer-config '{
        "kv_connector": "KvcsumConnector",
        "kv_connector_module_path": "kvcsum.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"inner": {"kv_connector": "NixlConnector"}}}'

See docs/vllm.md. The connector (kvcsum.vllm.connector, a facade
over kvcsum.vllm.scheduler and kvcsum.vllm.worker_role) imports vLLM; the
checksums over vLLM's cache tensors (kvcsum.vllm.cache_checksums) need
torch alone, and kvcsum.vllm.params neither. This package imports nothing
until asked, so `import kvcsum.vllm.cache_checksums` works on a machine
without vLLM.
"""

__all__ = ["KvcsumConnector", "KvcsumConnectorMetadata", "KvcsumWorkerMetadata", "KvcsumStats", "WrongRoleError"]


def __getattr__(name):
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
