"""KindEngine: the harness's engine (vLLM's real Scheduler and worker glue)
over any kind of KV cache vLLM 0.33 allocates, built from vLLM's own spec
classes (a KVCacheConfig of `groups`, each layer a region of one backing
allocation, viewed by allocate_kv_cache / create_kv_cache_views).

The stand-in model works on bytes, whatever the kind:

- a per-token cache ([B, H, N, C] view, any dtype): the cell of (token,
  position, layer, head slot) is bytes that depend only on them (so a
  quantized cell's scales, a head slot's packed data, an MLA latent and an
  indexer key are all "what the model computes" for that token); a cache
  vLLM stores as each block's data, then their scales (an indexer's keys,
  fp8_ds_mla states: data_scale_pages.py) gets the C bytes of a slot as
  its data (the first D) and its scales (the rest), where vLLM puts them;
- a compressed cache (`tokens_per_state` k > 1, DeepSeek V4's compressed
  MLA and indexer caches): slot u of the request summarises tokens
  u*k .. (u+1)*k, written by the step that computes the last of them, its
  bytes depending only on those tokens, u, the layer and the head slot;
- a pooled cache (`tokens_per_state` Fraction(1, p), Whisper's block
  pooling): token t's p states at slots t*p .. t*p + p of its block
  (whisper_causal.py:238-241), state i's bytes depending only on the
  token, its position, i, the layer and the head slot;
- a ring (CircularBufferSpec: one block a request): a step writes the row
  of each of its positions at slot position % capacity (bytes depending
  only on the token, its position and the layer, alike on every rank), and
  first reads the rows of the RING_READS positions before its first (a
  compressor's open group): a row that is not what the model computed is
  noted as for a state;
- a state cache (MambaSpec: a raw [B, 1, 1, content] page): after a step,
  the request's state block holds bytes that depend only on the layer and
  the tokens computed so far; a forward reads it first and finds it is
  not what the model computed (then `Trace.bad_kv_steps` gets the step).
  A state one token ahead of the step's first token is what the model
  computed too: vLLM computes a fully loaded prompt's last token again,
  reading the state after it. Where vLLM's NIXL connector derives how TP
  splits the state (Mamba1, Mamba2, GDN in the DS conv layout:
  mamba_states.nixl_split), the state is one global state and each rank's
  page holds its slice (each conv sub-projection's channels, then the ssm
  state's first dimension), so that engines of any TP size hold the same
  global state; otherwise each rank's bytes are its own. Only the state's
  bytes count, not the page's padding.
"""

from __future__ import annotations

import hashlib

import torch

import mamba_states
from harness import Engine, RankState
from data_scale_pages import read_rows, split_pages, write_rows
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

#: The ring rows a step reads before its first position (the stand-in
#: compressor's open group).
RING_READS = 3


def kinds_config(groups, num_blocks: int) -> KVCacheConfig:
    """vLLM's KV cache config of `groups` ([(layer names, spec)])."""
    pages = []
    for names, spec in groups:
        for name in names:
            own = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            pages.append((name, own.page_size_bytes))
    total = sum(page * num_blocks for _, page in pages)
    tensors, offset = [], 0
    for name, page in pages:
        tensors.append(KVCacheTensor(size=total, layers=[name], layer_stride=page * num_blocks, block_stride=page, offset=offset))
        offset += page * num_blocks
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(list(n), s) for n, s in groups]
    )


def layer_of(name: str) -> int:
    return next(int(part) for part in name.split(".") if part.isdigit())


class KindEngine(Engine):
    """An engine whose KV cache is `groups(tp)` ([(layer names, spec)])."""

    def __init__(self, name: str, *, groups, **kw):
        self._groups_of = groups
        # Several groups: vLLM's hybrid KV cache manager (the harness turns
        # it on with a sliding window; the groups are ours).
        kw.setdefault("sliding_window", -1)
        # vLLM's scheduler gets one representative spec per group where the
        # workers' group is a UniformTypeKVCacheSpecs
        # (generate_scheduler_kv_cache_config), as vLLM's engine core does.
        import harness

        real = harness.Scheduler

        def scheduler(*args, kv_cache_config, **kwargs):
            return real(*args, kv_cache_config=generate_scheduler_kv_cache_config([kv_cache_config]), **kwargs)

        harness.Scheduler = scheduler
        try:
            super().__init__(name, **kw)
        finally:
            harness.Scheduler = real

    def _kv_cache_config(self, num_blocks: int, sliding_window) -> KVCacheConfig:
        return kinds_config(self._groups_of(self.tp), num_blocks)

    # --- the stand-in model ----------------------------------------------------------

    def _is_ring(self, group_id: int) -> bool:
        return isinstance(self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec, CircularBufferSpec)

    def _is_state(self, group_id: int) -> bool:
        return isinstance(self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec, MambaSpec)

    def cells(self, req_id: str, positions: torch.Tensor, layer: int, first_slot: int, slots: int, width: int) -> torch.Tensor:
        """[tokens, slots, width] bytes of the given positions."""
        tokens = torch.tensor([self.token_at(req_id, int(p)) for p in positions], dtype=torch.int64)
        return self.cells_of(tokens, positions, layer, first_slot, slots, width)

    def unit_cells(self, req_id: str, units: torch.Tensor, k: int, layer: int, first_slot: int, slots: int, width: int) -> torch.Tensor:
        """[units, slots, width] bytes of compressed states: unit u from the
        k tokens u*k .. (u+1)*k."""
        summary = torch.tensor(
            [sum(self.token_at(req_id, int(u) * k + i) * (2 * i + 1) for i in range(k)) for u in units], dtype=torch.int64
        )
        return self.cells_of(summary, units, layer, first_slot, slots, width)

    def state_cells(self, req_id: str, positions: torch.Tensor, state: int, p: int, layer: int, first_slot: int, slots: int, width: int) -> torch.Tensor:
        """[tokens, slots, width] bytes of state `state` of the given
        positions' tokens, of p states a token (a pooled cache)."""
        tokens = torch.tensor([self.token_at(req_id, int(t)) for t in positions], dtype=torch.int64)
        return self.cells_of(tokens, positions * p + state, layer, first_slot, slots, width)

    def ring_rows(self, req_id: str, positions: torch.Tensor, layer: int, ring: torch.Tensor) -> torch.Tensor:
        """[positions, H, C] bytes of the ring rows of the given positions
        (the same on every rank)."""
        return self.cells(req_id, positions, layer, 0, ring.shape[0], ring.shape[2])

    @staticmethod
    def states_per_token(spec) -> int:
        """p of a pooled cache (tokens_per_state Fraction(1, p)); 1 otherwise."""
        from kvcsum.vllm.cache_kinds import states_per_token

        return states_per_token(spec)

    @staticmethod
    def cells_of(values: torch.Tensor, places: torch.Tensor, layer: int, first_slot: int, slots: int, width: int) -> torch.Tensor:
        slot = torch.arange(first_slot, first_slot + slots, dtype=torch.int64).view(1, slots, 1)
        byte = torch.arange(width, dtype=torch.int64).view(1, 1, -1)
        value = values.view(-1, 1, 1) * 131 + places.view(-1, 1, 1) * 7 + layer * 1009 + slot * 97 + byte * 13
        return (value % 251).to(torch.uint8)

    def state(self, req_id: str, layer: int, rank: int, num_tokens: int, width: int, split=None) -> torch.Tensor:
        """The state bytes after the request's first `num_tokens` tokens: with
        `split` (mamba_states.nixl_split), the rank's slice of one global
        state, the page's padding zeros."""
        tokens = [self.token_at(req_id, p) for p in range(num_tokens)]
        if split is None:
            seed = int.from_bytes(hashlib.sha256(repr((layer, rank, tokens)).encode()).digest()[:4], "little")
            return torch.randint(0, 256, (width,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        seed = int.from_bytes(hashlib.sha256(repr((layer, tokens)).encode()).digest()[:4], "little")
        generator = torch.Generator().manual_seed(seed)
        whole = torch.randint(0, 256, (mamba_states.global_bytes(split, self.tp),), dtype=torch.uint8, generator=generator)
        content = mamba_states.rank_slice(whole, split, self.tp, rank)
        return torch.cat([content, torch.zeros(width - content.numel(), dtype=torch.uint8)])

    def state_split(self, group_id: int):
        """mamba_states.nixl_split of a state group's spec at this engine's
        TP size (None where vLLM derives no split)."""
        splits = self.__dict__.setdefault("_state_splits", {})
        if group_id not in splits:
            splits[group_id] = mamba_states.nixl_split(self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec, self.tp)
        return splits[group_id]

    @staticmethod
    def _layer_spec(group, name: str):
        spec = group.kv_cache_spec
        return spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec

    def _first_slot(self, name: str, rank: int, slots: int) -> int:
        """The stand-in's number of the rank's first head slot: an MLA
        cache (one latent, or an indexer's key) is the same on every rank."""
        group = next(g for g in self.kv_cache_config.kv_cache_groups if name in g.layer_names)
        spec = self._layer_spec(group, name)
        if type(spec).__name__ in ("MLAAttentionSpec", "SlidingWindowMLASpec"):
            return 0
        # The ranks of a DCP group hold the same heads (their tokens differ).
        return (rank // self.dcp) * slots

    @staticmethod
    def tokens_per_state(spec) -> int:
        k = getattr(spec, "tokens_per_state", 1)
        return int(k) if isinstance(k, int) and k > 1 else 1

    def token_slots(self, spec, rank: int, positions: torch.Tensor, ids):
        """(the positions this rank holds, their blocks, their slots): with
        DCP a manager block covers block_size x dcp tokens, the token at
        in-block offset o on DCP rank (o // I) % dcp at local slot
        (o // (dcp I)) I + o % I (vllm.v1.worker.block_table). A compressed
        cache's `positions` are its units (slots of k tokens each), placed
        alike over block_size / k slots a block."""
        size, dcp, interleave = int(spec.block_size) // self.tokens_per_state(spec), self.dcp, self.interleave
        if dcp == 1 or not getattr(spec, "dcp_sharded", False):
            return positions, torch.tensor(ids)[positions // size], positions % size
        span = size * dcp
        offsets = positions % span
        mine = (offsets // interleave) % dcp == rank % dcp
        positions, offsets = positions[mine], offsets[mine]
        slots = (offsets // (dcp * interleave)) * interleave + offsets % interleave
        return positions, torch.tensor(ids)[positions // span], slots

    def state_column(self, group_id: int, num_tokens: int) -> int:
        """The column of a request's block list holding its state after
        `num_tokens` tokens: 0 with mamba_cache_mode "none"; with "align"
        (a state per block) (num_tokens - 1) // block_size, where vLLM's
        kernels read and write it (vllm/v1/worker/mamba_utils.py,
        preprocess_mamba)."""
        spec = self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
        if spec.mamba_cache_mode != "align":
            return 0
        return max(0, num_tokens - 1) // spec.block_size

    def _state_view(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(torch.uint8).reshape(cache.shape[0], -1)

    def _forward(self, rank: int, state: RankState, out) -> None:
        self._read_bad = getattr(self, "_read_bad", set())
        for req_id, (start, count) in self._step_tokens.items():
            table = state.tables[req_id]
            positions = torch.arange(start, start + count)
            for group_id, group in enumerate(self.kv_cache_config.kv_cache_groups):
                ids = table[group_id]
                for name in group.layer_names:
                    if name not in state.caches:
                        continue  # another PP stage's
                    layer, cache = layer_of(name), state.caches[name]
                    if self._is_ring(group_id):
                        ring = cache.view(torch.uint8)[ids[0]]  # [H, capacity, C]
                        capacity = ring.shape[1]
                        read = torch.arange(max(0, start - RING_READS), start)
                        if len(read) and not torch.equal(ring[:, read % capacity], self.ring_rows(req_id, read, layer, ring).transpose(0, 1)):
                            self._read_bad.add((req_id, rank))
                        written = positions[-capacity:]
                        ring[:, written % capacity] = self.ring_rows(req_id, written, layer, ring).transpose(0, 1)
                        continue
                    if self._is_state(group_id):
                        page = self._state_view(cache)
                        width, split = page.shape[1], self.state_split(group_id)
                        content = group.kv_cache_spec.state_content_size_bytes
                        if start > 0:
                            got = page[ids[self.state_column(group_id, start)]][:content]
                            wants = (self.state(req_id, layer, rank, n, width, split)[:content] for n in (start, start + 1))
                            if not any(torch.equal(got, want) for want in wants):
                                self._read_bad.add((req_id, rank))
                        state_after = self.state(req_id, layer, rank, start + count, width, split)
                        page[ids[self.state_column(group_id, start + count)]] = state_after
                        continue
                    raw = cache.view(torch.uint8)
                    slots, width = raw.shape[1], raw.shape[3]
                    first = self._first_slot(name, rank, slots)
                    spec = self._layer_spec(group, name)
                    k = self.tokens_per_state(spec)
                    if k > 1:
                        # The units whose last token this step computes.
                        units = torch.arange(start // k, (start + count) // k)
                        held, blocks, local = self.token_slots(spec, rank, units, ids)
                        parts = split_pages(name, spec, cache)
                        if parts is not None:
                            # A block's states' data, then their scales, as vLLM writes them.
                            write_rows(parts, blocks, local, self.unit_cells(req_id, held, k, layer, first, slots, width)[:, 0])
                            continue
                        raw[blocks, :, local] = self.unit_cells(req_id, held, k, layer, first, slots, width)
                        continue
                    held, blocks, local = self.token_slots(spec, rank, positions, ids)
                    p = self.states_per_token(spec)
                    if p > 1:
                        # Whisper's block pooling: token t's state i at slot t*p + i.
                        for i in range(p):
                            raw[blocks, :, local * p + i] = self.state_cells(req_id, held, i, p, layer, first, slots, width)
                        continue
                    parts = split_pages(name, spec, cache)
                    if parts is not None:
                        # A block's data (an indexer's keys), then their scales, as vLLM writes them.
                        write_rows(parts, blocks, local, self.cells(req_id, held, layer, first, slots, width)[:, 0])
                        continue
                    raw[blocks, :, local] = self.cells(req_id, held, layer, first, slots, width)

    def _kv_as_computed(self, rank: int, state: RankState, req_id: str, num_tokens: int) -> bool:
        if (req_id, rank) in getattr(self, "_read_bad", set()):
            self._read_bad.discard((req_id, rank))
            return False
        table = state.tables[req_id]
        for group_id, group in enumerate(self.kv_cache_config.kv_cache_groups):
            if self._is_state(group_id) or self._is_ring(group_id):
                continue  # read (and judged) by the forward, before it writes
            for name in group.layer_names:
                if name not in state.caches:
                    continue
                spec = self._layer_spec(group, name)
                k = self.tokens_per_state(spec)
                # A compressed cache: its complete units.
                places = torch.arange(num_tokens // k)
                held, blocks, local = self.token_slots(spec, rank, places, table[group_id])
                raw = state.caches[name].view(torch.uint8)
                slots, width = raw.shape[1], raw.shape[3]
                p = self.states_per_token(spec)
                if p > 1:
                    first = self._first_slot(name, rank, slots)
                    for i in range(p):
                        want = self.state_cells(req_id, held, i, p, layer_of(name), first, slots, width)
                        if not torch.equal(raw[blocks, :, local * p + i], want):
                            return False
                    continue
                parts = split_pages(name, spec, state.caches[name])
                if parts is not None:
                    got = read_rows(parts, blocks, local).unsqueeze(1)
                else:
                    got = raw[blocks, :, local]
                first = self._first_slot(name, rank, slots)
                if k > 1:
                    want = self.unit_cells(req_id, held, k, layer_of(name), first, slots, width)
                else:
                    want = self.cells(req_id, held, layer_of(name), first, slots, width)
                if not torch.equal(got, want):
                    return False
        return True
