"""A HiCache storage backend that wraps any other one and checks every page
it loads (docs/sglang.md).

SGLang's HiCache moves KV pages between its host pool and an L3 storage
backend; the backend gets the pages' keys and the host pool indices
(`batch_set_v2` / `batch_get_v2`). This backend passes each call to the
wrapped backend and, around it:

- on a set: checksums each page in the host pool (a kvcsum host worker
  over the pool's K and V buffers, one block a page, bound to the page's
  key) and writes its 16-byte stored entry (SPEC section 8) through the
  wrapped backend as an object of its own, under the page's key with
  ".kvcsum" appended;
- on a get: after the wrapped backend filled the pages, reads each page's
  16 bytes back and checks the page (`Worker.check_stored`). A page that
  fails, or whose 16 bytes are missing, is reported to SGLang as not
  loaded: a miss, which SGLang computes again. These are counted apart
  from the wrapped backend's own misses (`stats()`, `get_stats()`).

Enabled through SGLang's documented dynamic backend, with no patch:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
      "backend_name": "kvcsum", "module_path": "kvcsum.sglang",
      "class_name": "KvcsumHiCacheStorage",
      "inner": {"backend_name": "file", "extra_config": {"file_storage_path": "/data/hicache"}}}'

`inner` names the wrapped backend as `--hicache-storage-backend` would
(`backend_name`) and gives it its own extra config (`extra_config`, which
may itself be a dynamic backend's). Tested with SGLang 0.5.23; on another
SGLang whose HiCache interface differs, construction fails with a message
saying what is missing.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np

import kvcsum

TESTED_SGLANG = "0.5.23"
ENTRY_SUFFIX = ".kvcsum"

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolName
except ImportError as error:  # pragma: no cover - only without SGLang
    raise ImportError(f"kvcsum.sglang needs SGLang's HiCache (sglang.srt.mem_cache.hicache_storage): {error}") from error


@dataclass
class HiCacheCheckStats:
    """What the checks did, counted apart from the wrapped backend's misses."""

    pages_stored: int = 0  # pages set with their 16 bytes
    pages_verified: int = 0  # pages loaded and matched
    pages_failed: int = 0  # pages loaded whose check failed (reported as misses)
    pages_unverified: int = 0  # pages loaded that could not be checked: no 16 bytes, another configuration (misses)
    inner_misses: int = 0  # pages the wrapped backend itself did not load


def _page_views(pool) -> list:
    """[(layer, k view, v view, layout string)] with block = page, for each
    layout of SGLang 0.5.23's MHA host pool."""
    layout = getattr(pool, "layout", None)
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    missing = [name for name in ("layout", "k_buffer", "v_buffer", "page_size", "layer_num", "head_num") if not hasattr(pool, name)]
    if missing:
        raise TypeError(
            f"kvcsum.sglang: the host pool {type(pool).__name__} has no {', '.join(missing)} "
            f"(tested: SGLang {TESTED_SGLANG}'s MHATokenToKVPoolHost)"
        )
    page = int(pool.page_size)
    views = []
    for layer in range(int(pool.layer_num)):
        if layout == "layer_first":  # [layers, tokens, heads, dim]
            kl, vl = (x[layer].unflatten(0, (-1, page)) for x in (k, v))
            views.append((layer, kl, vl, "NHD"))
        elif layout == "page_first":  # [tokens, layers, heads, dim]
            kl, vl = (x[:, layer].unflatten(0, (-1, page)) for x in (k, v))
            views.append((layer, kl, vl, "NHD"))
        elif layout == "page_first_direct":  # [pages, layers, page, heads, dim]
            views.append((layer, k[:, layer], v[:, layer], "NHD"))
        elif layout == "page_head":  # [pages, heads, page, layers, dim]
            views.append((layer, k[:, :, :, layer], v[:, :, :, layer], "HND"))
        else:
            raise TypeError(
                f"kvcsum.sglang: host pool layout {layout!r} is not supported "
                "(layer_first, page_first, page_first_direct, page_head)"
            )
    return views


class KvcsumHiCacheStorage(HiCacheStorage):
    """Wraps the HiCache storage backend named in extra_config["inner"]."""

    def __init__(self, storage_config, kwargs: Optional[dict] = None):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        for method in ("batch_get_v2", "batch_set_v2", "batch_exists_v2", "register_mem_host_pool_v2"):
            if not hasattr(HiCacheStorage, method):
                raise RuntimeError(
                    f"kvcsum.sglang: SGLang's HiCacheStorage has no {method} (tested with SGLang {TESTED_SGLANG})"
                )
        extra = dict(storage_config.extra_config or {})
        inner = extra.get("inner")
        if not isinstance(inner, dict) or not isinstance(inner.get("backend_name"), str):
            raise ValueError(
                'kvcsum.sglang: extra_config["inner"] must be {"backend_name": NAME, "extra_config": {...}}, '
                f"got {inner!r}"
            )
        inner_config = copy.copy(storage_config)
        inner_config.extra_config = inner.get("extra_config")
        self._inner = StorageBackendFactory.create_backend(inner["backend_name"], inner_config, None, **(kwargs or {}))
        self._tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        self._tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        self._worker = None
        self._stored = None
        self._pool = None
        self._lock = threading.Lock()
        self.check_stats = HiCacheCheckStats()

    # --- pools ----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        self._inner.register_mem_pool_host(mem_pool_host)
        self._attach(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._inner.register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool_name == PoolName.KV:
            self._attach(host_pool)

    def on_host_pools_registered(self) -> None:
        self._inner.on_host_pools_registered()

    def _attach(self, pool) -> None:
        if self._pool is pool:
            return
        views = _page_views(pool)
        worker = kvcsum.Worker(tp_rank=self._tp_rank, tp_size=self._tp_size)
        worker.add_region_of(pool.k_buffer)
        worker.add_region_of(pool.v_buffer)
        worker.add_group(0, int(pool.page_size))
        first_head = self._tp_rank * int(pool.head_num)
        for layer, k, v, layout in views:
            worker.add_layer(kvcsum.layer(k, layout, layer_number=layer, first_head=first_head, v=v))
        pages = int(views[0][1].shape[0])
        self._stored = np.zeros((pages, 2), dtype=np.uint64)
        worker.add_stored_of(0, self._stored)
        if self._worker is not None:
            self._worker.close()
        self._worker, self._pool, self._page_size = worker, pool, int(pool.page_size)

    # --- the checked path -----------------------------------------------------------

    @staticmethod
    def _hash(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    def _pages(self, transfer) -> list:
        indices = transfer.host_indices
        keys = transfer.keys or []
        return [int(indices[i * self._page_size]) // self._page_size for i in range(len(keys))]

    def _blocks(self, req: str, keys: list, pages: list) -> kvcsum.Blocks:
        blocks = kvcsum.Blocks().add_request(req, len(pages) * self._page_size)
        blocks.add_group(req, 0, pages)
        blocks.set_hashes(req, 0, [self._hash(k) for k in keys])
        return blocks

    def _kv_transfer(self, transfers):
        for transfer in transfers:
            if transfer.name == PoolName.KV and transfer.keys:
                return transfer
        return None

    def batch_set_v2(self, transfers, extra_info=None):
        results = self._inner.batch_set_v2(transfers, extra_info)
        transfer = self._kv_transfer(transfers)
        if transfer is None or self._worker is None:
            return results
        keys, pages = list(transfer.keys), self._pages(transfer)
        done = list(results.get(transfer.name, [False] * len(keys)))
        with self._lock:
            for i, (key, page) in enumerate(zip(keys, pages)):
                if not done[i]:
                    continue
                with self._blocks("set", [key], [page]) as blocks:
                    self._worker.store(blocks).close()
                entry = self._entry_tensor(self._stored[page])
                if not self._inner.set(key + ENTRY_SUFFIX, entry):
                    done[i] = False  # the page without its 16 bytes is no use
                    continue
                self.check_stats.pages_stored += 1
        results[transfer.name] = done
        return results

    def batch_get_v2(self, transfers, extra_info=None):
        results = self._inner.batch_get_v2(transfers, extra_info)
        transfer = self._kv_transfer(transfers)
        if transfer is None or self._worker is None:
            return results
        keys, pages = list(transfer.keys), self._pages(transfer)
        done = list(results.get(transfer.name, [False] * len(keys)))
        with self._lock:
            for i, (key, page) in enumerate(zip(keys, pages)):
                if not done[i]:
                    self.check_stats.inner_misses += 1
                    continue
                entry = self._entry_tensor(np.zeros(2, dtype=np.uint64))
                got = self._inner.get(key + ENTRY_SUFFIX, entry)
                if got is None:
                    done[i] = False
                    self.check_stats.pages_unverified += 1
                    continue
                self._stored[page] = got.view(-1).numpy().view(np.uint64)[:2]
                with self._blocks("get", [key], [page]) as blocks, self._worker.check_stored(blocks) as result:
                    outcome = int(result.stored("get", 0)[0])
                if outcome == kvcsum.STORED_MATCHED:
                    self.check_stats.pages_verified += 1
                elif outcome == kvcsum.STORED_FAILED:
                    done[i] = False
                    self.check_stats.pages_failed += 1
                else:
                    done[i] = False
                    self.check_stats.pages_unverified += 1
        results[transfer.name] = done
        return results

    @staticmethod
    def _entry_tensor(words: np.ndarray):
        import torch

        return torch.from_numpy(np.ascontiguousarray(words, dtype=np.uint64).view(np.uint8).copy())

    # --- passed through -------------------------------------------------------------

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        return self._inner.batch_exists_v2(keys, pool_transfers, extra_info)

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self._inner.get(key, target_location, target_sizes)

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self._inner.batch_get(keys, target_locations, target_sizes)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self._inner.set(key, value, target_location, target_sizes)

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self._inner.batch_set(keys, values, target_locations, target_sizes)

    def exists(self, key: str) -> bool:
        return self._inner.exists(key)

    def batch_exists(self, keys, extra_info=None) -> int:
        return self._inner.batch_exists(keys, extra_info)

    def clear(self) -> None:
        return self._inner.clear()

    def stats(self) -> HiCacheCheckStats:
        return self.check_stats

    def get_stats(self):
        return self._inner.get_stats()

    def close(self):
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        closer = getattr(self._inner, "close", None)
        if closer is not None:
            closer()
