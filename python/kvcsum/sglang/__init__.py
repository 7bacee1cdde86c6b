"""kvcsum for SGLang (docs/sglang.md): KvcsumHiCacheStorage, a HiCache
storage backend that wraps any other and checks every page it loads.
Importing this package needs SGLang."""

from .hicache import HiCacheCheckStats, KvcsumHiCacheStorage

__all__ = ["HiCacheCheckStats", "KvcsumHiCacheStorage"]
