"""kvcsum for SGLang (docs/sglang.md): KvcsumHiCacheStorage, a HiCache
storage backend that wraps any other and checks every page it loads; and
activate_pd(), the version-checked activation of kvcsum's check of P/D
transfers across TP sizes and layouts. Importing this package needs SGLang."""

from .hicache import HiCacheCheckStats, KvcsumHiCacheStorage
from .pd import PdActivation, PdStats, PdVerdict, SGLangMismatch, activate_pd

__all__ = [
    "HiCacheCheckStats", "KvcsumHiCacheStorage", "PdActivation", "PdStats", "PdVerdict", "SGLangMismatch", "activate_pd",
]
