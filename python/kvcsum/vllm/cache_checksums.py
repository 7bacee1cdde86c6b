"""The worker part of kvcsum's vLLM connector: kvcsum workers over vLLM's own
KV cache tensors. It needs torch and kvcsum, never vLLM, so that it runs
(and is tested) on a GPU machine that has torch alone.

The connector (kvcsum.vllm.connector) turns vLLM's KV cache config into
`LayerSpec`s, one per layer of this worker, and hands them with the tensors
vLLM passed to `register_kv_caches` to `CacheChecksummer`, which

- registers every layer with a kvcsum worker in the layout its tensor has:
  vLLM's per-layer views `[blocks, heads, tokens, K+V]` under any stride
  order (LBNHC, LBHNC, the block-outermost ones), FlashAttention's
  `[2, blocks, tokens, heads, head_size]`, FlashInfer's
  `[blocks, 2, tokens, heads, head_size]` (HND through its strides), MLA's
  `[blocks, tokens, latent]` and `[blocks, 1, tokens, latent]`, and
  caches split into kernel blocks (more blocks in the tensor than the
  manager has, each manager block one run of them);
- gives each layer the identity the vLLM fork fingerprints
  (`repr((layer_name, spec_type, block_size, dtype))`, SPEC section 7), so
  payloads interoperate with it (kvcsum adds what those fields do not
  tell apart: `identity`); layers that share another layer's cache (KV
  sharing) count in the fingerprint and are checksummed once, under the
  lowest layer number, as the fork does;
- uses a host worker for CPU tensors and a device worker for CUDA tensors
  (and pinned host tensors beside them), queueing on torch's current
  stream (`worker_device`: what no engine of kvcsum reads is refused);
- declares the groups it cannot checksum (state layers, packed head slots,
  layers without one layer number in their name) as skipped, with the
  reason, so the verifier knows their sums are partial.

`checksum(jobs, role)` checksums a list of `Job`s (a request's token count
and its block ids per group) and returns the worker's record (bytes, for
the scheduler's kvcsum.Verifier) once `record()` is called.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from typing import Iterable, Mapping, Sequence

import kvcsum
from kvcsum._layers import _hip_version, _memory_of
from kvcsum.vllm import cache_kinds

__all__ = [
    "LayerSpec",
    "Job",
    "CacheChecksummer",
    "PendingRecord",
    "identity",
    "layer_fingerprint",
    "layer_number",
    "NULL_BLOCK_ID",
]

#: vLLM's null block (the block pool's block 0): a position whose KV is not
#: held (outside a sliding window).
NULL_BLOCK_ID = 0


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer of a worker, as the connector read it from vLLM's config.

    `num_kv_heads` is this rank's count (vLLM's spec after the TP split);
    `total_kv_heads` is the model's (needed where a rank holds one head:
    replicated or not). `kind` is "attention" for layers with per-token KV
    blocks; any other kind (e.g. "state" for Mamba) is skipped with
    `unsupported` as the reason.
    """

    name: str
    group_id: int
    spec_type: str
    block_size: int
    dtype: str
    num_kv_heads: int = 1
    head_size: int = 0
    head_size_v: int = 0
    is_mla: bool = False
    total_kv_heads: int | None = None
    kind: str = "attention"
    unsupported: str = ""
    #: Head slots of the cache where they are not one per KV head (nvfp4:
    #: 2 * num_kv_heads, K slots then V slots); 0 otherwise.
    num_slots: int = 0
    #: Two slots, K then V, each holding every head of the rank (b12x:
    #: num_head_slots 2, a slot's cell num_kv_heads x head_size elements).
    folded_slots: bool = False
    #: Bytes of one head's (slot's) cell where the spec packs it
    #: (`state_content_bytes`: quantized cells with their scales); 0: dense.
    cell_bytes: int = 0
    #: A state layer's tensors (MambaSpec: conv, then ssm): shapes and dtypes.
    state_shapes: tuple = ()
    state_dtypes: tuple = ()
    #: A state layer's mamba_type ("MAMBA2", "GDN_ATTN", ...), and how TP
    #: splits its state where that is known (kvcsum.vllm.cache_kinds.
    #: state_split: StateParts in numbering order), else () and why not.
    state_type: str = ""
    state_parts: tuple = ()
    state_unsplit: str = ""
    #: Tokens one slot of the cache summarises (compressed states), and
    #: the DCP ranks its tokens are spread over (1: not DCP-sharded).
    tokens_per_state: int = 1
    dcp_size: int = 1
    #: A cache vLLM stores as each block's data (`data_bytes` a slot), then
    #: their scales (`scale_bytes` a slot): a sparse-attention indexer's
    #: k-cache, DeepSeek V4's fp8_ds_mla states
    #: (kvcsum.vllm.cache_kinds._data_then_scales_bytes); 0 for any other.
    data_bytes: int = 0
    scale_bytes: int = 0
    #: States a token has (Whisper's block pooling: p consecutive slots a
    #: token, kvcsum.vllm.cache_kinds.states_per_token); 1 for any other cache.
    states_per_token: int = 1
    #: A ring (CircularBufferSpec): a state layer whose state is the
    #: request's one block, each head slot's rows a state tensor
    #: (kvcsum.vllm.cache_kinds.ring_tensors).
    ring: bool = False


@dataclasses.dataclass
class Job:
    """A request's blocks to checksum: `num_tokens` tokens of KV, and per
    group `(first_position, block_ids)`."""

    req_id: str
    num_tokens: int
    groups: dict

    def to_blocks(self, blocks: "kvcsum.Blocks") -> None:
        blocks.add_request(self.req_id, self.num_tokens)
        for group_id, (first_position, block_ids) in sorted(self.groups.items()):
            blocks.add_group(self.req_id, int(group_id), list(block_ids), int(first_position))


def identity(
    layer_name: str, spec_type: str, block_size: int, dtype: str, split: str = "", *, states_per_token: int = 1, state: int = 0
) -> bytes:
    """The vLLM fork's identity of a layer: the repr of
    `(layer_name, spec_type, block_size, dtype)`, to which kvcsum adds
    what the fork's four fields do not tell apart:

    - a state layer whose rows are numbered along TP's split adds the split
      (kvcsum.vllm.cache_kinds.split_identity) as a fifth element;
    - a layer of p > 1 states a token (Whisper's block pooling) is p caches,
      each registered with its own identity, the fields then
      `("states_per_token", p)` and `("state", i)`: the fork's four are the
      same at any p, so without p a side pooling by another p (or not at
      all) would be compared, its sums numbering other states; with it the
      fingerprints differ (UNVERIFIED, never MISMATCH)."""
    fields = (layer_name, spec_type, int(block_size), str(dtype)) + ((split,) if split else ())
    if states_per_token != 1:
        fields += (("states_per_token", int(states_per_token)), ("state", int(state)))
    return repr(fields).encode()


def layer_fingerprint(
    layer_name: str, spec_type: str, block_size: int, dtype: str, split: str = "", *, states_per_token: int = 1,
    slot_parts: int = 1,
) -> int:
    """First 8 bytes, little-endian, of the SHA-256 of the identity; of a
    layer of p > 1 states a token, the sum of its p caches' (SPEC section
    7: every registered cache counts). A head-slot cache registers its K
    slots and its V slots as `slot_parts` (2) caches, the V slots' with no
    identity: each of those counts the SHA-256 of no bytes, as the library
    counts it (kvcs_layer.identity NULL)."""
    total = 0
    for state in range(max(1, states_per_token)):
        ident = identity(layer_name, spec_type, block_size, dtype, split, states_per_token=states_per_token, state=state)
        total += int.from_bytes(hashlib.sha256(ident).digest()[:8], "little")
        total += (slot_parts - 1) * _NO_IDENTITY
    return total % 2**64


#: What a cache registered with no identity adds to its group's fingerprint.
_NO_IDENTITY = int.from_bytes(hashlib.sha256(b"").digest()[:8], "little")


def slot_parts(spec: "LayerSpec") -> int:
    """The caches one layer's cache is registered as per state: its K slots
    and its V slots where it holds head slots (`num_slots`), else one."""
    return 2 if spec.num_slots else 1


_NUMBER = re.compile(r"^\d+$")


def layer_number(layer_name: str) -> int:
    """The one integer among a layer name's dot-separated parts
    ("model.layers.7.self_attn.attn" -> 7); ValueError when there is not
    exactly one."""
    numbers = [int(part) for part in layer_name.split(".") if _NUMBER.match(part)]
    if len(numbers) != 1:
        raise ValueError(f"layer {layer_name!r} has {len(numbers)} numbers in its name, not one")
    return numbers[0]


#: Whether this kvcsum's device engine checksums cells of 4-byte pieces
#: (SPEC section 1), as its host engine does: it does, so a device worker
#: registers an indexer's k-cache. The one switch of that rule: False names
#: a group holding such a cache not checksummed on device workers.
DEVICE_READS_4_BYTE_PIECES = True


def worker_device(layers: Sequence[LayerSpec], kv_caches: Mapping[str, object]) -> int:
    """The kvcsum worker the caches of `layers` need: kvcsum.HOST where they
    are all in host memory, else the CUDA device ordinal they are on, whose
    device worker also reads pinned host memory (a cache in host memory
    beside CUDA ones must be pinned). Layers kvcsum does not checksum
    (`unsupported`: HiSparse's host-resident group, whose pages are in
    HiSparse's pinned host pool) are never read and do not count. ValueError,
    naming the layer and its device, for caches no engine of kvcsum reads:
    a GPU of ROCm's torch (kvcsum's device engine is CUDA's), another
    device type (XPU, HPU, ...), host memory that is not pinned beside CUDA
    caches, or caches on several CUDA devices."""
    cuda: dict[int, str] = {}
    host: list[str] = []
    for spec in layers:
        tensor = kv_caches.get(spec.name)
        if tensor is None or spec.unsupported:
            continue
        where = _memory_of(tensor)  # the binding's one rule (Worker._check_readable)
        if where == "rocm":
            raise ValueError(
                f"layer {spec.name}'s KV cache is on a GPU of ROCm's torch (HIP {_hip_version()}): kvcsum's device "
                "engine runs on CUDA only, so no KV on ROCm GPUs can be checksummed"
            )
        if where == "cuda":
            index = tensor.device.index
            cuda.setdefault(0 if index is None else int(index), spec.name)
        elif where == "host":
            if not tensor.is_pinned():
                host.append(spec.name)
        else:
            raise ValueError(
                f"layer {spec.name}'s KV cache is on device {tensor.device}: kvcsum checksums KV in host memory or on "
                "CUDA devices"
            )
    if len(cuda) > 1:
        raise ValueError(f"the KV caches are on several CUDA devices: {sorted(cuda)} (layers {sorted(cuda.values())})")
    if cuda and host:
        raise ValueError(
            f"layer {host[0]}'s KV cache is in host memory that is not pinned, beside caches on CUDA device "
            f"{next(iter(cuda))}: a device worker reads device memory and pinned host memory only"
        )
    return next(iter(cuda)) if cuda else kvcsum.HOST


def _block_slots(spec: LayerSpec) -> int:
    """The slots of one of this rank's manager blocks of a layer's cache
    (block_size is the rank's own tokens of a block under DCP; a compressed
    cache holds a slot per tokens_per_state tokens, a pooled one
    states_per_token slots a token)."""
    return spec.block_size * spec.states_per_token // max(1, spec.tokens_per_state)


def _describe(tensor, spec: LayerSpec, num_blocks: int):
    """(layout, kernel_blocks) of a layer's cache tensor; ValueError when the
    shape is not one vLLM uses for this spec."""
    shape = tuple(int(n) for n in tensor.shape)
    item = int(tensor.element_size())
    heads = spec.num_slots or (1 if spec.is_mla else spec.num_kv_heads)
    content = spec.head_size + spec.head_size_v
    cell = spec.cell_bytes or content * _dtype_bytes(spec, item)
    tokens = _block_slots(spec)

    def kernel_blocks(count: int) -> int:
        if count % num_blocks:
            raise ValueError(f"its {count} blocks are not a multiple of the {num_blocks} manager blocks")
        ratio = count // num_blocks
        if tokens % ratio:
            raise ValueError(f"{ratio} kernel blocks do not split {tokens}-token blocks")
        return ratio

    candidates = []
    if len(shape) == 4:
        # vLLM's per-layer view [B, H, N, C] (C: K then V of a head's token).
        B, H, N, C = shape
        if H == heads and C * item == cell:
            candidates.append(("BHTD", B, N))
    if len(shape) == 5 and shape[0] == 2:
        # FlashAttention [2, B, N, H, D].
        _, B, N, H, D = shape
        if H == heads and D == spec.head_size == spec.head_size_v and not spec.cell_bytes:
            candidates.append(("KBTHD", B, N))
    if len(shape) == 5 and shape[1] == 2:
        # FlashInfer [B, 2, N, H, D] (HND through its strides).
        B, _, N, H, D = shape
        if H == heads and D == spec.head_size == spec.head_size_v and not spec.cell_bytes:
            candidates.append(("BKTHD", B, N))
    if len(shape) == 3 and spec.is_mla:
        # MLA [B, N, latent].
        B, N, C = shape
        if C == content:
            candidates.append(("BTD", B, N))
    for layout, count, per_kernel_block in candidates:
        if count % num_blocks:
            continue
        ratio = kernel_blocks(count)
        if ratio * per_kernel_block == tokens:
            return layout, ratio
    raise ValueError(
        f"its cache of shape {shape} is no layout kvcsum knows for {heads} heads, "
        f"{tokens}-token blocks and {cell}-byte cells over {num_blocks} blocks"
    )


def _data_then_scales(tensor, spec: LayerSpec, num_blocks: int):
    """(data `[B, N, D]`, scales `[B, N, S]`, kernel blocks) of a cache vLLM
    stores as each block's data, then their scales (an indexer's k-cache,
    DeepSeek V4's fp8_ds_mla states: kvcsum.vllm.cache_kinds.
    _data_then_scales_bytes), from vLLM's view `[B, 1, N, C]` or `[B, N, C]`
    of bytes, C = D + S: slot t's data at byte t*D of its block's page, its
    scale at N*D + t*S. The block stride is the view's (a page padded to its
    alignment stays so); where the view splits a manager block into kernel
    blocks, each kernel block is such a page, N and the page the view's (as
    the fp8_ds_mla writer takes them: models/deepseek_v4/common/ops/
    fused_compress_quant_cache.py:129, :141). ValueError where the view is
    no such cache."""
    view = tensor.view(tensor.shape[0], *tensor.shape[2:]) if tensor.dim() == 4 and tensor.shape[1] == 1 else tensor
    shape = tuple(int(n) for n in view.shape)
    data, scale = spec.data_bytes, spec.scale_bytes
    cell = data + scale
    if len(shape) != 3 or int(view.element_size()) != 1 or shape[2] != cell or int(view.stride(2)) != 1 or int(view.stride(1)) != cell:
        raise ValueError(
            f"its view of shape {shape} and strides {tuple(view.stride())} is no [blocks, slots, {cell}] page of bytes "
            f"({data} data bytes, then {scale} scale bytes, a slot)"
        )
    blocks, slots = shape[0], shape[1]
    wanted = _block_slots(spec)
    if blocks % num_blocks or slots * (blocks // num_blocks) != wanted:
        raise ValueError(
            f"its {blocks} blocks of {slots} slots are no kernel blocks of the {num_blocks} manager blocks of {wanted} slots"
        )
    page = int(view.stride(0))
    start = int(view.storage_offset())
    data_view = view.as_strided((blocks, slots, data), (page, data, 1), start)
    scales = view.as_strided((blocks, slots, scale), (page, scale, 1), start + slots * data)
    return data_view, scales, blocks // num_blocks


def _identity_block_size(spec: LayerSpec) -> int:
    """The block size a layer's identity names: under DCP a rank's spec has
    its local block (block_size / dcp), the identity the block every rank's
    slots belong to, the scheduler's, as a DCP-1 engine's of the same block
    size does."""
    return spec.block_size * max(1, spec.dcp_size)


def _registered_identity(spec: LayerSpec, split: str = "", state: int = 0) -> bytes:
    """The identity a worker registers for a layer's cache (of a pooled
    layer, for its state `state`); `split` a state layer's
    (kvcsum.vllm.cache_kinds.split_identity) where its rows are numbered
    along TP's split."""
    return identity(
        spec.name, spec.spec_type, _identity_block_size(spec), spec.dtype, split, states_per_token=spec.states_per_token, state=state
    )


def _pooled_states(parts: list, layout: str, spec: LayerSpec, layer_heads: int) -> list:
    """The caches of a layer of p states a token (Whisper's block pooling:
    token t's state i at slot t*p + i of its block,
    kvcsum.vllm.cache_kinds.states_per_token): for each state i, each part
    `(view, first head)` viewed at slots i, i + p, ... (a token a slot, its
    token stride p slots), its heads after the `layer_heads` global heads
    of each state before it (SPEC section 1: heads one cache after the
    other). ValueError where the layout has no token dimension to stride."""
    p = spec.states_per_token
    if spec.data_bytes or "T" not in layout:
        raise ValueError(f"layer {spec.name}: {p} states a token in a {layout} cache kvcsum cannot stride by token")
    dim = layout.index("T")
    out = []
    for state in range(p):
        for view, head in parts:
            if view.shape[dim] % p:
                raise ValueError(f"layer {spec.name}: {view.shape[dim]} slots a block are no multiple of its {p} states a token")
            index = [slice(None)] * view.dim()
            index[dim] = slice(state, None, p)
            out.append((view[tuple(index)], head + state * layer_heads))
    return out


def _dtype_bytes(spec: LayerSpec, item: int) -> int:
    """Bytes of one cache element of `spec` (the tensor's own when unknown)."""
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "uint8": 1, "int8": 1, "fp8": 1}
    text = str(spec.dtype).replace("torch.", "")
    for name, size in sizes.items():
        if text.startswith(name):
            return size
    return item


@dataclasses.dataclass
class PendingRecord:
    """A checksum call in flight: its result becomes the record. `seconds`:
    the time this worker's thread spent in kvcsum for it, the call and the
    wait for its result (on a device, the wait includes the work queued
    before it on the stream)."""

    result: "kvcsum.Result"
    req_ids: tuple
    seconds: float = 0.0

    def ready(self) -> bool:
        return self.result.ready()

    def wait(self) -> "kvcsum.Result":
        """Waits for the result (its time counts in `seconds`)."""
        start = time.perf_counter()
        try:
            return self.result.wait()
        finally:
            self.seconds += time.perf_counter() - start

    def record(self) -> bytes:
        """The worker's record (waits for a device result)."""
        try:
            self.wait()
            return self.result.encode()
        finally:
            self.result.close()


class CacheChecksummer:
    """kvcsum workers over one vLLM worker's KV caches.

    Args:
        layers: every layer of this worker (LayerSpec), in any order.
        kv_caches: the tensors vLLM passed to register_kv_caches, by name.
        num_blocks: the KV cache manager's block count.
        group_block_sizes: {group_id: block_size} of every transfer group.
        tp_rank, tp_size, pp_rank: this worker's place.
        num_threads: host worker threads (0: the library's default).
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        kv_caches: Mapping[str, object],
        num_blocks: int,
        group_block_sizes: Mapping[int, int],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        num_threads: int = 0,
        algorithm: int | None = None,
        dcp_rank: int = 0,
        dcp_interleave: int = 1,
    ):
        self.tp_rank, self.tp_size, self.pp_rank = tp_rank, tp_size, pp_rank
        self.dcp_rank, self.dcp_interleave = dcp_rank, dcp_interleave
        self.skipped: dict[int, str] = {}
        #: {group: why}: state groups registered shard-keyed (compared
        #: between equal TP sizes only), where TP's split is not known.
        self.shard_keyed: dict[int, str] = {}
        #: {group: fingerprint} of the identities registered for each
        #: group (the library's sum, SPEC section 7: config.group_fingerprint's
        #: at this TP size and the group's block size).
        self.fingerprints: dict[int, int] = {}
        self.group_block_sizes = dict(group_block_sizes)
        present = [spec for spec in layers if spec.name in kv_caches]
        tensors = [kv_caches[spec.name] for spec in present]
        # The worker reads these tensors' memory: keep them alive with it.
        self._tensors = tensors
        self.device = worker_device(present, kv_caches)
        self.worker = kvcsum.Worker(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            device=self.device,
            num_threads=num_threads,
            algorithm=algorithm,
        )
        self.layers_registered = 0
        #: The KV cache manager's block count (block ids are below it).
        self.num_blocks = num_blocks
        self._register(present, kv_caches, num_blocks)

    # --- registration ----------------------------------------------------------

    def _register(self, layers: Sequence[LayerSpec], kv_caches, num_blocks: int) -> None:
        worker = self.worker
        by_group: dict[int, list[LayerSpec]] = {}
        for spec in layers:
            by_group.setdefault(spec.group_id, []).append(spec)
        for group_id, block_size in sorted(self.group_block_sizes.items()):
            worker.add_group(group_id, block_size)
        regions = {}
        for group_id, specs in sorted(by_group.items()):
            try:
                plan = self._plan_group(group_id, specs, kv_caches, num_blocks)
                placement = self._placement(specs)
            except ValueError as error:
                reason = str(error)
                worker.skip_group(group_id, reason)
                self.skipped[group_id] = reason
                continue
            if placement is not None:
                try:
                    worker.set_group_placement(group_id, **placement)
                except kvcsum.Error as error:
                    reason = f"its token placement {placement} is refused: {error}"
                    worker.skip_group(group_id, reason)
                    self.skipped[group_id] = reason
                    continue
            for tensor in plan["tensors"]:
                storage = tensor.untyped_storage()
                regions[storage.data_ptr()] = storage.nbytes()
            for address, length in sorted(regions.items()):
                worker.add_region(address, length)
            regions.clear()
            for layer in plan["layers"]:
                worker.add_layer(layer)
                self.layers_registered += 1
            for number, tensors, ident in plan["states"]:
                # Rows numbered along TP's split where it is known
                # (cache_kinds.state_split), else shard-keyed (compared
                # between equal TP sizes only; a ring's stale slots differ
                # between ranks).
                worker.add_state(group_id, number, tensors, num_blocks, split_known=plan["split_known"], identity=ident)
                self.layers_registered += 1
            if plan["states"] and not plan["split_known"]:
                self.shard_keyed[group_id] = plan["unsplit"]
            for number, target, ident in plan["aliases"]:
                worker.add_alias(group_id, number, target, ident)
            self.fingerprints[group_id] = plan["fingerprint"]

    def _plan_group(self, group_id: int, specs: list, kv_caches, num_blocks: int) -> dict:
        """The kvcsum layers, state layers and aliases of one group
        (kvcsum.vllm.cache_kinds: the rules of each kind); ValueError names
        why the group cannot be checksummed."""
        block_size = self.group_block_sizes.get(group_id)
        caches: dict = {}  # (data_ptr, strides, shape) -> [numbers, spec, tensor, identities]
        kinds = {spec.kind for spec in specs}
        if len(kinds) > 1:
            raise ValueError(f"it holds layers of kinds {sorted(kinds)}")
        # A group's state layers are all numbered along TP's split or all
        # shard-keyed (kvcs_state.split_known).
        state_specs = [spec for spec in specs if spec.kind == "state" and spec.state_shapes]
        unsplit = cache_kinds.state_split_refused(state_specs, self.tp_size) if state_specs else ""
        split_known = bool(state_specs) and not unsplit
        fingerprint = 0  # of every identity registered (SPEC section 7)
        for spec in specs:
            if spec.unsupported:
                raise ValueError(spec.unsupported)
            if spec.kind == "attention" and block_size is not None and spec.block_size * spec.dcp_size != block_size:
                raise ValueError(
                    f"layer {spec.name} has {spec.block_size}-token blocks on each of {spec.dcp_size} DCP ranks, its group {block_size}"
                )
            if spec.kind == "state" and not spec.state_shapes:
                raise ValueError(f"layer {spec.name} is a {spec.spec_type} kvcsum has no rule for")
            tensor = kv_caches[spec.name]
            cell = spec.data_bytes + spec.scale_bytes
            if cell % 8 and self.device != kvcsum.HOST and not DEVICE_READS_4_BYTE_PIECES:
                raise ValueError(
                    f"layer {spec.name} has {cell}-byte cells (a block's data, then its scales: {spec.data_bytes} + "
                    f"{spec.scale_bytes} bytes a slot), read in 4-byte pieces, which device workers are set not to checksum "
                    "(DEVICE_READS_4_BYTE_PIECES)"
                )
            number = layer_number(spec.name)
            key = (int(tensor.data_ptr()), tuple(tensor.stride()), tuple(tensor.shape))
            split = cache_kinds.split_identity(spec, self.tp_size) if split_known else ""
            ident = _registered_identity(spec, split)
            fingerprint += layer_fingerprint(
                spec.name, spec.spec_type, _identity_block_size(spec), spec.dtype, split, states_per_token=spec.states_per_token,
                slot_parts=slot_parts(spec),
            )
            entry = caches.setdefault(key, {"numbers": [], "spec": spec, "tensor": tensor, "idents": []})
            entry["numbers"].append(number)
            entry["idents"].append((number, ident))
        layers, states, aliases = [], [], []
        # Several caches of one layer number (an MLA cache and its indexer's,
        # a head-slot cache's K and V slots): heads one cache after the other,
        # in layer-name order (SPEC section 1).
        next_head: dict[int, int] = {}
        used_states: set = set()
        for entry in sorted(caches.values(), key=lambda e: (min(e["numbers"]), e["spec"].name)):
            spec, tensor = entry["spec"], entry["tensor"]
            target = min(entry["numbers"])
            target_ident = next(i for n, i in entry["idents"] if n == target)
            for number, ident in entry["idents"]:
                if ident is not target_ident:
                    aliases.append((number, target, ident))
            if spec.kind == "state":
                if target in used_states:
                    raise ValueError(f"two of its state caches share layer number {target}")
                used_states.add(target)
                if spec.ring:
                    if len(entry["numbers"]) > 1:
                        raise ValueError(f"layer {spec.name}: a ring read by another layer (KV sharing)")
                    # The attention layer of its number has a cache of its
                    # own, in another group (kvcsum.vllm.cache_kinds.RING_LAYER_NUMBERS).
                    states.append((cache_kinds.RING_LAYER_NUMBERS + target, cache_kinds.ring_tensors(tensor, spec), target_ident))
                    continue
                tensors = cache_kinds.state_tensors(tensor, spec, self.tp_rank, self.tp_size, split=split_known)
                states.append((target, tensors, target_ident))
                continue
            v_part = None
            if spec.data_bytes:
                # A block's data, then its scales: one cell of two segments.
                tensor, v_part, kernel_blocks = _data_then_scales(tensor, spec, num_blocks)
                layout = "BTD"
            else:
                layout, kernel_blocks = _describe(tensor, spec, num_blocks)
            offset = next_head.get(target, 0)
            next_head[target] = offset + cache_kinds.global_heads(spec, self.tp_size) * spec.states_per_token
            first_head, replicas, replica_index = self._heads(spec)
            parts = [(tensor, first_head + offset)]
            part_layout = layout
            if spec.folded_slots:
                # The K slot then the V slot, each [B, N, heads x head_size]:
                # numbered as K slots then V slots, a head each.
                total = cache_kinds.global_heads(spec, self.tp_size) // 2
                k, v = (tensor[:, i].unflatten(-1, (spec.num_kv_heads, -1)) for i in (0, 1))
                parts, part_layout = [(k, first_head + offset), (v, first_head + offset + total)], "BTHD"
            elif spec.num_slots:
                # K slots then V slots: the V slots' heads after every K slot's.
                half = spec.num_slots // 2
                total = cache_kinds.global_heads(spec, self.tp_size) // 2
                parts = [(tensor[:, :half], first_head + offset), (tensor[:, half:], first_head + offset + total)]
            idents = {parts[0][1]: target_ident}
            if spec.states_per_token > 1:
                if len(entry["numbers"]) > 1:
                    raise ValueError(f"layer {spec.name}: {spec.states_per_token} states a token, read by another layer (KV sharing)")
                layer_heads = cache_kinds.global_heads(spec, self.tp_size)
                parts = _pooled_states(parts, part_layout, spec, layer_heads)
                # Each state's first part carries that state's identity.
                idents = {
                    parts[0][1] + state * layer_heads: _registered_identity(spec, state=state)
                    for state in range(spec.states_per_token)
                }
            for view, head in parts:
                layers.append(
                    kvcsum.layer(
                        view,
                        part_layout,
                        layer_number=target,
                        group_id=group_id,
                        first_head=head,
                        kernel_blocks=kernel_blocks,
                        replicas=replicas,
                        replica_index=replica_index,
                        identity=idents.get(head, b""),
                        v=v_part,
                    )
                )
        return {
            "layers": layers,
            "states": states,
            "split_known": split_known,
            "unsplit": unsplit,
            "fingerprint": fingerprint % 2**64,
            "aliases": aliases,
            "tensors": [e["tensor"] for e in caches.values()],
        }

    def _placement(self, specs) -> dict | None:
        """The group's token placement (DCP shards, compressed states) for
        Worker.set_group_placement; None where every token has a slot of
        this rank's blocks in order (the default)."""
        dcp = {s.dcp_size for s in specs}
        tokens = {s.tokens_per_state for s in specs}
        if len(dcp) != 1 or len(tokens) != 1:
            raise ValueError(f"its layers disagree on DCP ({sorted(dcp)}) or tokens per state ({sorted(tokens)})")
        (dcp_size,), (tokens_per_slot,) = dcp, tokens
        if dcp_size == 1 and tokens_per_slot == 1:
            return None
        return dict(
            dcp_size=dcp_size,
            dcp_rank=self.dcp_rank if dcp_size > 1 else 0,
            interleave=self.dcp_interleave if dcp_size > 1 else 1,
            tokens_per_slot=tokens_per_slot,
        )

    def _heads(self, spec: LayerSpec) -> tuple[int, int, int]:
        """(first global head, replicas, replica index) of this rank's heads.
        With DCP, the consecutive TP ranks of a DCP group (vLLM's
        parallel_state: dcp_rank = tp_rank % dcp, where TP exceeds the KV
        heads dcp times over) hold the same heads' different tokens: no
        replicas of each other."""
        tp, rank, dcp = self.tp_size, self.tp_rank, max(1, spec.dcp_size)
        if spec.is_mla:
            return 0, max(1, tp // dcp), rank // dcp
        local = spec.num_kv_heads
        total = spec.total_kv_heads
        if total is None:
            if local > 1 or tp == 1:
                total = local * tp
            else:
                raise ValueError(
                    f"layer {spec.name}: one KV head per rank, and the model's KV head count is unknown"
                )
        heads = kvcsum.rank_heads(rank, tp, total)
        if len(heads) != local:
            raise ValueError(
                f"layer {spec.name}: rank {rank} of {tp} should hold {len(heads)} of {total} KV heads, its cache holds {local}"
            )
        replicas = max(1, tp // total) if tp > total else 1
        if dcp > 1:
            if replicas % dcp:
                raise ValueError(f"layer {spec.name}: {replicas} ranks hold each KV head, not a multiple of DCP {dcp}")
            replicas //= dcp
            return heads.start, replicas, (rank // dcp) % replicas
        return heads.start, replicas, rank % replicas

    # --- checksums ---------------------------------------------------------------

    def checksum(self, jobs: Iterable[Job], role: int, cuda_stream: int | None = None) -> PendingRecord | None:
        """Checksums (host) or queues (device, on `cuda_stream` or torch's
        current stream) the jobs' blocks; None when there are none."""
        jobs = [job for job in jobs]
        if not jobs:
            return None
        with kvcsum.Blocks() as blocks:
            for job in jobs:
                job.to_blocks(blocks)
            if self.device != kvcsum.HOST and cuda_stream is None:
                import torch

                cuda_stream = torch.cuda.current_stream(self.device).cuda_stream
            start = time.perf_counter()
            result = self.worker.checksum(blocks, role, cuda_stream)
            seconds = time.perf_counter() - start
        return PendingRecord(result, tuple(job.req_id for job in jobs), seconds)

    def close(self) -> None:
        self.worker.close()
