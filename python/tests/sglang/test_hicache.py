"""kvcsum.sglang.KvcsumHiCacheStorage in SGLang 0.5.23 on the CPU (make
sglang-test): created by SGLang's own StorageBackendFactory through the
documented dynamic backend, wrapping SGLang's file backend (HiCacheFile),
pages round-tripped between SGLang's real MHATokenToKVPoolHost (over a real
MHATokenToKVPool on the CPU) and the files through batch_set_v2 /
batch_get_v2. The reference: the bytes SGLang loaded compared with the
bytes it stored, on fresh seeded random KV.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvcsum.sglang import KvcsumHiCacheStorage

PAGE, HEADS, HEAD_DIM, LAYERS = 16, 2, 32, 3
PAGES = 6


def pools(layout: str):
    device = MHATokenToKVPool(
        1024, PAGE, torch.float16, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
        pin_memory=False,
        device_capacity_tokens=device.size if device.host_capacity_tokens is None else device.host_capacity_tokens,
        start_layer=device.start_layer, end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )
    return device, host


def backend(path: str, host, wrap: bool = True):
    inner = {"backend_name": "file", "extra_config": {"file_storage_path": path}}
    if wrap:
        extra = {"backend_name": "kvcsum", "module_path": "kvcsum.sglang", "class_name": "KvcsumHiCacheStorage", "inner": inner}
        name = "dynamic"
    else:
        extra, name = inner["extra_config"], "file"
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="tiny", extra_config=extra,
    )
    storage = StorageBackendFactory.create_backend(name, config, host)
    storage.register_mem_pool_host(host)
    storage.register_mem_host_pool_v2(host, PoolName.KV)
    return storage


def fill(host, indices: torch.Tensor, generator: torch.Generator) -> list:
    pages = []
    for i in range(0, len(indices), PAGE):
        index = int(indices[i])
        page = torch.randint(-30000, 30000, host.get_data_page(index, flat=True).shape, generator=generator, dtype=torch.int16)
        host.set_from_flat_data_page(index, page.view(torch.float16))
        pages.append(host.get_data_page(index, flat=True).clone())
    return pages


def loaded(host, indices: torch.Tensor) -> list:
    return [host.get_data_page(int(indices[i]), flat=True).clone() for i in range(0, len(indices), PAGE)]


def same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def seed(request):
    value = int.from_bytes(os.urandom(4), "little")
    print(f"\nseed {value}")
    return value


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_hicache_round_trip_through_the_wrapping_backend_matches_and_a_damaged_page_is_a_miss(tmp_path, layout, seed):
    generator = torch.Generator().manual_seed(seed)
    _, host = pools(layout)
    storage = backend(str(tmp_path), host)
    assert isinstance(storage, KvcsumHiCacheStorage), type(storage)
    keys = [f"page-{seed}-{i}" for i in range(PAGES)]
    stored_at = host.alloc(PAGES * PAGE)
    originals = fill(host, stored_at, generator)
    done = storage.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=stored_at, keys=keys)])
    assert done[PoolName.KV] == [True] * PAGES
    assert storage.stats().pages_stored == PAGES

    # Intact: every page loaded, as stored.
    loaded_at = host.alloc(PAGES * PAGE)
    done = storage.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=loaded_at, keys=keys)])
    assert done[PoolName.KV] == [True] * PAGES
    assert all(same(a, b) for a, b in zip(loaded(host, loaded_at), originals))
    assert storage.stats().pages_verified == PAGES and storage.stats().pages_failed == 0

    # A bit flipped in one page's file: that page a miss, counted apart.
    bad = int(torch.randint(0, PAGES, (1,), generator=generator))
    [path] = [p for p in glob.glob(str(tmp_path / f"{keys[bad]}_*.bin"))]
    data = bytearray(open(path, "rb").read())
    where = int(torch.randint(0, len(data), (1,), generator=generator))
    data[where] ^= 1 << int(torch.randint(0, 8, (1,), generator=generator))
    open(path, "wb").write(bytes(data))
    again = host.alloc(PAGES * PAGE)
    done = storage.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=again, keys=keys)])
    differs = [i for i, (a, b) in enumerate(zip(loaded(host, again), originals)) if not same(a, b)]
    print(f"{layout}: flipped byte {where} of page {bad}'s file; pages differing {differs}; loaded {done[PoolName.KV]}")
    assert differs == [bad]
    assert done[PoolName.KV] == [i != bad for i in range(PAGES)]
    stats = storage.stats()
    assert stats.pages_failed == 1 and stats.inner_misses == 0 and stats.pages_unverified == 0

    # The same file read by SGLang's file backend alone: loaded, wrong, no error.
    bare = backend(str(tmp_path), host, wrap=False)
    plain = host.alloc(PAGES * PAGE)
    done = bare.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=plain, keys=keys)])
    assert done[PoolName.KV] == [True] * PAGES
    assert not same(loaded(host, plain)[bad], originals[bad])

    # A page whose 16 bytes are gone: a miss, unverified, not a failure; a
    # page the file backend lacks: its own miss.
    gone = (bad + 1) % PAGES
    [entry] = glob.glob(str(tmp_path / f"{keys[gone]}.kvcsum_*.bin"))
    os.remove(entry)
    missing = (bad + 2) % PAGES
    [page_file] = [p for p in glob.glob(str(tmp_path / f"{keys[missing]}_*.bin"))]
    os.remove(page_file)
    more = host.alloc(PAGES * PAGE)
    done = storage.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=more, keys=keys)])
    assert done[PoolName.KV] == [i not in (bad, gone, missing) for i in range(PAGES)]
    stats = storage.stats()
    assert stats.pages_failed == 2 and stats.pages_unverified == 1 and stats.inner_misses == 1
    storage.close()
