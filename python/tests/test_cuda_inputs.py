"""What a torch or CUDA user passes: `cuda_stream` as a torch.cuda.Stream,
a CuPy stream or anything with `__cuda_stream__` (duck-typed, so fakes
check it without a GPU), and kvcsum.layer() over a DLPack producer
(`__dlpack__` alone: numpy exports it, so the CPU checks it), whose
checksums are the naive reference's."""

import numpy as np
import pytest

import kvcsum
from kvcsum._base import _stream
from test_checksums import BLOCK_IDS, NUM_TOKENS, logical_kv, reference, rng, run  # noqa: F401 - rng is a fixture


class TorchLikeStream:
    """What torch.cuda.Stream carries: the CUstream as `cuda_stream`."""

    def __init__(self, handle):
        self.cuda_stream = handle


class CupyLikeStream:
    def __init__(self, handle):
        self.ptr = handle


class ProtocolStream:
    """The CUDA stream protocol: __cuda_stream__() -> (version, handle)."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@pytest.mark.parametrize("make", [int, np.uint64, TorchLikeStream, CupyLikeStream, ProtocolStream])
def test_a_stream_object_gives_its_cuda_stream_handle(make):
    handle = 0x7F3A_5C00_1230
    assert _stream(make(handle)) == handle
    assert _stream(None) is None


@pytest.mark.parametrize(
    "bad,error,named",
    [
        (True, TypeError, "bool"),
        ("0x10", TypeError, "str"),
        (object(), TypeError, "object"),
        (TorchLikeStream(-1), ValueError, "TorchLikeStream.cuda_stream"),
        (ProtocolStream(2**64), ValueError, "__cuda_stream__"),
        (type("Odd", (), {"__cuda_stream__": lambda self: 5})(), TypeError, "(version, handle)"),
    ],
)
def test_what_is_not_a_stream_is_refused_naming_it(bad, error, named):
    with pytest.raises(error, match=named.replace("(", r"\(").replace(")", r"\)")):
        _stream(bad)


def test_a_host_worker_takes_a_stream_object_and_gives_the_reference(rng):
    kv = logical_kv(rng)
    hnd = np.ascontiguousarray(kv[0])
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [2])
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(hnd)
        worker.add_group(0, 8)
        worker.add_layer(kvcsum.layer(hnd, "HND", layer_number=2))
        blocks.add_request("req", NUM_TOKENS)
        blocks.add_group("req", 0, BLOCK_IDS)
        for stream in (TorchLikeStream(0), ProtocolStream(0), None):
            with worker.checksum(blocks, cuda_stream=stream) as result:
                np.testing.assert_array_equal(result.wait().column("req", 0), want)
        with pytest.raises(TypeError, match="cuda_stream"):
            worker.checksum(blocks, cuda_stream="default")


class DLPackOnly:
    """A producer that offers DLPack alone (as JAX and TensorFlow arrays
    do): no data_ptr, no array interface."""

    def __init__(self, array, versioned=False):
        self._array = array
        self._versioned = versioned
        self.shape = array.shape

    def __dlpack__(self, stream=None):
        if self._versioned:
            return self._array.__dlpack__(max_version=(1, 0))
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.mark.parametrize("versioned", [False, True])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_a_dlpack_producer_checksums_as_the_reference(rng, versioned, layout):
    kv = logical_kv(rng, layers=2)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [3, 9])
    if layout == "HND":
        arrays = [np.ascontiguousarray(kv[i]) for i in range(2)]
    else:
        arrays = [np.ascontiguousarray(kv[i].transpose(0, 2, 1, 3)) for i in range(2)]
    arrays = [a.view(np.uint16) for a in arrays]  # 2-byte elements, as bf16
    wrapped = [DLPackOnly(a, versioned) for a in arrays]
    assert not hasattr(wrapped[0], "__array_interface__")
    for a, w in zip(arrays, wrapped):
        assert kvcsum.region_of(w) == kvcsum.region_of(a)
    layers = [kvcsum.layer(w, layout, layer_number=n) for w, n in zip(wrapped, [3, 9])]
    np.testing.assert_array_equal(run(layers, arrays, BLOCK_IDS, NUM_TOKENS), want)


def test_a_strided_dlpack_view_is_described_by_its_strides(rng):
    # K and V as one [B, H, T, 2 * P] array, each half a strided view.
    kv = logical_kv(rng)
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [1])
    whole = np.ascontiguousarray(kv[0])
    half = whole.shape[-1] // 2
    k, v = DLPackOnly(whole[..., :half]), DLPackOnly(whole[..., half:])
    layer = kvcsum.layer(k, "HND", layer_number=1, v=v)
    np.testing.assert_array_equal(run([layer], [whole], BLOCK_IDS, NUM_TOKENS), want)


def test_something_that_is_no_tensor_is_refused_naming_dlpack():
    with pytest.raises(TypeError, match="DLPack"):
        kvcsum.layer(object(), "HND", layer_number=0)


# --- memory a worker's engine cannot read ----------------------------------------------------


class CudaInterfaceOnly:
    """Something that describes its bytes by `__cuda_array_interface__`
    alone (CuPy, Numba's device arrays): CUDA device memory. Here the
    address is a host array's, so reading it would not fault: the refusal
    comes from what the array says, before any byte is read."""

    def __init__(self, array):
        self._array = array
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (array.ctypes.data, False),
            "strides": None,
            "version": 3,
        }


class TensorOn:
    """What a torch tensor on another device says of itself (data_ptr,
    element_size, stride, shape, device.type): duck-typed, so the check
    runs without such a device."""

    def __init__(self, array, device_type):
        self._array = array
        self.shape = array.shape
        self.dtype = None
        self.device = type("Device", (), {"type": device_type, "index": 0})()

    def data_ptr(self):
        return self._array.ctypes.data

    def element_size(self):
        return self._array.itemsize

    def stride(self):
        return tuple(s // self._array.itemsize for s in self._array.strides)


class DLPackOnDevice(DLPackOnly):
    """A DLPack producer whose capsule says kDLCUDA (device memory): the
    device field of numpy's export, rewritten before it is handed on."""

    def __dlpack__(self, stream=None):
        import ctypes

        from kvcsum import _layers

        capsule = super().__dlpack__(stream)
        api = ctypes.pythonapi
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        name = b"dltensor_versioned" if self._versioned else b"dltensor"
        struct = _layers._DLManagedTensorVersioned if self._versioned else _layers._DLManagedTensor
        struct.from_address(api.PyCapsule_GetPointer(capsule, name)).dl_tensor.device.device_type = 2  # kDLCUDA
        return capsule


def _fresh_host_worker_refuses(make_array, where):
    """A host worker refuses `make_array(host array)` in add_region_of,
    add_layer (after the region of the same bytes was added as numbers)
    and add_stored_of, naming the argument and where it lives, and is
    left as it was: a layer of the same bytes given as a numpy array then
    checksums as the reference."""
    rng = np.random.default_rng(20261207)
    kv = logical_kv(rng)
    hnd = np.ascontiguousarray(kv[0])
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [2])
    foreign = make_array(hnd)
    stored = np.zeros((8, 2), dtype=np.uint64)
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
        with pytest.raises(kvcsum.InvalidArgument, match=f"array: .*{where}.*host worker reads host memory"):
            worker.add_region_of(foreign)
        worker.add_region(*kvcsum.region_of(hnd))
        worker.add_group(0, 8)
        with pytest.raises(kvcsum.InvalidArgument, match=rf"layer.arrays\[0\]: .*{where}"):
            worker.add_layer(kvcsum.layer(foreign, "HND", layer_number=2))
        if hasattr(foreign, "__cuda_array_interface__"):
            with pytest.raises(kvcsum.InvalidArgument, match=f"array: .*{where}"):
                worker.add_stored_of(0, CudaInterfaceOnly(stored))
        assert "layers=0" in repr(worker)
        worker.add_layer(kvcsum.layer(hnd, "HND", layer_number=2))
        blocks.add_request("req", NUM_TOKENS)
        blocks.add_group("req", 0, BLOCK_IDS)
        with worker.checksum(blocks) as result:
            np.testing.assert_array_equal(result.wait().column("req", 0), want)


def test_a_host_worker_refuses_cuda_device_memory_by_its_interface():
    _fresh_host_worker_refuses(CudaInterfaceOnly, "CUDA device memory")


@pytest.mark.parametrize("versioned", [False, True])
def test_a_host_worker_refuses_a_dlpack_export_of_device_memory(versioned):
    _fresh_host_worker_refuses(lambda a: DLPackOnDevice(a.view(np.uint16), versioned), "CUDA device memory")


@pytest.mark.parametrize("device_type", ["cuda", "xpu", "mps", "meta"])
def test_a_host_worker_refuses_a_tensor_on_a_device(device_type):
    where = "CUDA device memory" if device_type == "cuda" else f"a '{device_type}' device"
    _fresh_host_worker_refuses(lambda a: TensorOn(a, device_type), where)


def test_a_cuda_tensor_of_rocms_torch_is_named_rocm(monkeypatch):
    # ROCm's torch calls its GPUs "cuda" too; torch.version.hip tells them apart.
    import sys
    import types

    fake = types.SimpleNamespace(version=types.SimpleNamespace(hip="6.4.0", cuda=None))
    monkeypatch.setitem(sys.modules, "torch", fake)
    _fresh_host_worker_refuses(lambda a: TensorOn(a, "cuda"), "a ROCm GPU")


def test_host_memory_in_any_form_is_taken_by_a_host_worker(rng):
    kv = logical_kv(rng)
    hnd = np.ascontiguousarray(kv[0])
    want = reference(kv, BLOCK_IDS, NUM_TOKENS, [2])
    for host in (hnd, TensorOn(hnd, "cpu"), DLPackOnly(hnd)):
        np.testing.assert_array_equal(run([kvcsum.layer(host, "HND", layer_number=2)], [host], BLOCK_IDS, NUM_TOKENS), want)
