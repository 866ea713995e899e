"""The runtime's whole driver-API call sequence against a fake `cuda.bindings.driver` (no GPU).

The fake records every call, checks each argument's type the way cuda-python's signatures take
them (handles vs ints, bytes, enums), reads the packed kernel parameters back out of the argument
array while the launch call runs, and returns cuda-python's (CUresult, value) tuples. The
manifest and cubin come from a real AOT build (llama-tiny, B = 1, sm_90a), the tensors from the
host state Megakernel hands the op (CPU tensors: the fake only records their data_ptr()).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
from types import SimpleNamespace

import pytest
import torch

from megakernel.launch.checks import ArgumentError, validate_args
from megakernel.launch.runtime import DeviceInfo, LoadedKernel, Manifest, load_manifest
from megakernel.models import preset

ARCH = "sm_90a"
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448)
STREAM = 0x5EED0  # what the fake torch stream hands the launch


# ---- the fake driver ----------------------------------------------------------------------------
class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720


class CUfunction_attribute(enum.IntEnum):
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CUlaunchAttributeID(enum.IntEnum):
    CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2


class _Handle:
    """An opaque driver handle: constructible from an int, int() gives it back."""

    def __init__(self, value: int = 0):
        if not isinstance(value, int) or isinstance(value, _Handle):
            raise TypeError(f"{type(self).__name__}() takes an int, got {type(value).__name__}")
        self.value = value

    def __int__(self) -> int:
        return self.value

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


class CUlibrary(_Handle): ...


class CUkernel(_Handle): ...


class CUfunction(_Handle): ...


class CUdevice(_Handle): ...


class CUstream(_Handle): ...


class CUlaunchAttribute:
    def __init__(self):
        self.id = None
        self.value = SimpleNamespace(cooperative=0)


class CUlaunchConfig:
    def __init__(self):
        self.gridDimX = self.gridDimY = self.gridDimZ = 0
        self.blockDimX = self.blockDimY = self.blockDimZ = 0
        self.sharedMemBytes = 0
        self.hStream = CUstream(0)
        self.attrs: list = []
        self.numAttrs = 0


def _want(call: str, what: str, value, *types) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise TypeError(f"{call}: {what} must be {' or '.join(t.__name__ for t in types)}, got "
                        f"{type(value).__name__} {value!r}")


class FakeDriver:
    """A stand-in for the `cuda.bindings.driver` module: records and validates every call."""

    CUresult = CUresult
    CUfunction_attribute = CUfunction_attribute
    CUlaunchAttributeID = CUlaunchAttributeID
    CUlibrary, CUkernel, CUfunction, CUdevice, CUstream = (CUlibrary, CUkernel, CUfunction,
                                                           CUdevice, CUstream)
    CUlaunchAttribute, CUlaunchConfig = CUlaunchAttribute, CUlaunchConfig

    def __init__(self, params: list[dict], occupancy: int = 1,
                 fail: dict[str, CUresult] | None = None):
        self.params = params  # the manifest's parameters: how to read the argument array
        self.occupancy = occupancy
        self.fail = fail or {}
        self.calls: list[tuple[str, tuple]] = []
        self.launched: list[dict] = []  # what each launch decoded from its arguments

    def _ret(self, name: str, args: tuple, value=None):
        """Record the call; (err,) or (err, value) as cuda-python returns (value None on
        error), err as `fail` says."""
        self.calls.append((name, args))
        err = self.fail.get(name, CUresult.CUDA_SUCCESS)
        if value is None:
            return (err,)
        return (err, None if err else value)

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def cuGetErrorString(self, err):
        return CUresult.CUDA_SUCCESS, f"fake {CUresult(int(err)).name}".encode()

    def cuLibraryLoadData(self, code, jit_opts, jit_vals, n_jit, lib_opts, lib_vals,
                          n_lib):
        c = "cuLibraryLoadData"
        _want(c, "code", code, bytes)
        if not code.startswith(b"\x7fELF"):
            raise ValueError(f"{c}: the code is not a cubin (ELF)")
        for what, v in (("jitOptions", jit_opts), ("jitOptionsValues", jit_vals),
                        ("libraryOptions", lib_opts), ("libraryOptionValues", lib_vals)):
            if v is not None:
                _want(c, what, v, list, tuple)
        _want(c, "numJitOptions", n_jit, int)
        _want(c, "numLibraryOptions", n_lib, int)
        return self._ret(c, (code, jit_opts, jit_vals, n_jit, lib_opts, lib_vals, n_lib),
                         CUlibrary(0x11B))

    def cuLibraryGetKernel(self, library, name):
        _want("cuLibraryGetKernel", "library", library, CUlibrary)
        _want("cuLibraryGetKernel", "name", name, bytes)
        return self._ret("cuLibraryGetKernel", (library, name), CUkernel(0xC0DE))

    def cuDeviceGet(self, ordinal):
        _want("cuDeviceGet", "ordinal", ordinal, int)
        return self._ret("cuDeviceGet", (ordinal,), CUdevice(ordinal))

    def cuKernelSetAttribute(self, attrib, val, kernel, dev):
        c = "cuKernelSetAttribute"
        _want(c, "attrib", attrib, CUfunction_attribute)
        _want(c, "val", val, int)
        _want(c, "kernel", kernel, CUkernel)
        _want(c, "dev", dev, CUdevice)
        return self._ret(c, (attrib, val, kernel, dev))

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, func, block_size, smem):
        c = "cuOccupancyMaxActiveBlocksPerMultiprocessor"
        _want(c, "func", func, CUfunction)
        _want(c, "blockSize", block_size, int)
        _want(c, "dynamicSMemSize", smem, int)
        return self._ret(c, (func, block_size, smem), self.occupancy)

    def cuLaunchKernelEx(self, config, f, kernel_params, extra):
        c = "cuLaunchKernelEx"
        _want(c, "config", config, CUlaunchConfig)
        _want(c, "f", f, CUfunction)
        _want(c, "kernelParams", kernel_params, int)
        if extra not in (0, None):
            raise TypeError(f"{c}: extra must be 0/None when kernelParams is given")
        for k in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ",
                  "sharedMemBytes", "numAttrs"):
            _want(c, f"config.{k}", getattr(config, k), int)
        _want(c, "config.hStream", config.hStream, CUstream)
        if config.numAttrs != len(config.attrs):
            raise ValueError(f"{c}: numAttrs {config.numAttrs} != {len(config.attrs)} attrs")
        for a in config.attrs:
            _want(c, "config.attrs[i]", a, CUlaunchAttribute)
            _want(c, "attr.id", a.id, CUlaunchAttributeID)
        # the argument array (void*[n]) must be readable now: decode it as the kernel will
        slots = (ctypes.c_void_p * len(self.params)).from_address(kernel_params)
        args = {}
        for p, addr in zip(self.params, slots, strict=True):
            ctype = ctypes.c_uint64 if p["kind"] == "ptr" else ctypes.c_int32
            if ctypes.sizeof(ctype) != p["size"]:
                raise ValueError(f"{c}: parameter {p['name']} is {p['size']} B in the manifest")
            args[p["name"]] = ctype.from_address(addr).value
        self.launched.append({
            "grid": (config.gridDimX, config.gridDimY, config.gridDimZ),
            "block": (config.blockDimX, config.blockDimY, config.blockDimZ),
            "smem": config.sharedMemBytes, "stream": int(config.hStream),
            "attrs": {a.id.name: a.value.cooperative for a in config.attrs},
            "func": int(f), "args": args})
        return self._ret(c, (config, f, kernel_params, extra))

    def cuLibraryUnload(self, library):
        _want("cuLibraryUnload", "library", library, CUlibrary)
        return self._ret("cuLibraryUnload", (library,))


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Manifest:
    """A real AOT build: the manifest's symbol, block, shared memory and parameters."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")
    from megakernel.kernel.toolchain.build import build_arch

    root = tmp_path_factory.mktemp("build")
    build_arch(preset("llama-tiny"), ARCH, root, 1, 1)
    return load_manifest(root, ARCH)


@pytest.fixture(scope="module")
def state():
    """The buffers Megakernel hands the op, on the CPU (llama-tiny, B = 1, an 8-SM program)."""
    from megakernel.executor import executor_gpu
    from megakernel.launch.device_state import allocate_state
    from megakernel.models.weights import random_weights
    from megakernel.program.compiler import compile_program

    cfg = preset("llama-tiny")
    prog = compile_program(cfg, 1, executor_gpu(8), tokens=1, max_seq_len=40)
    return allocate_state(cfg, random_weights(cfg, seed=3), prog, "cpu")


@pytest.fixture
def fake_cuda(monkeypatch) -> list:
    """torch's side of the launch without a GPU: the devices it was asked to make current."""
    entered: list = []

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda d=None: SimpleNamespace(cuda_stream=STREAM))
    monkeypatch.setattr(torch.cuda, "device", device)
    return entered


def _launch(m: Manifest, st, drv: FakeDriver, dev: DeviceInfo = H200) -> LoadedKernel:
    """What decode_step does: validate (here without the CUDA-device check), load, launch."""
    validate_args(m.spec, st.tensors(), lengths_off=st.offsets[0], max_seq_len=st.offsets[3],
                  require_cuda=False)
    k = LoadedKernel(m, 0, driver=drv, dev=dev)
    k.launch(st.program.shape[0], st.tensors(),
             dict(queue_len=st.program.shape[1], s_max=st.k_cache.shape[3],
                  lengths_off=st.offsets[0]))
    return k


# ---- tests --------------------------------------------------------------------------------------
def test_call_sequence_types_and_argument_packing(manifest, state, fake_cuda):
    drv = FakeDriver(manifest.params)
    k = _launch(manifest, state, drv)
    assert drv.names() == ["cuLibraryLoadData", "cuLibraryGetKernel", "cuDeviceGet",
                           "cuKernelSetAttribute", "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                           "cuLaunchKernelEx"]
    calls = dict(drv.calls)
    assert calls["cuLibraryLoadData"][0] == manifest.cubin_bytes()
    assert calls["cuLibraryGetKernel"] == (CUlibrary(0x11B), manifest.symbol.encode())
    assert calls["cuDeviceGet"] == (0,)
    attr, smem, kern, dev = calls["cuKernelSetAttribute"]
    assert attr is CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert (smem, kern, dev) == (manifest.smem, CUkernel(0xC0DE), CUdevice(0))
    assert calls["cuOccupancyMaxActiveBlocksPerMultiprocessor"] == (
        CUfunction(0xC0DE), manifest.block[0], manifest.smem)
    (got,) = drv.launched
    num_ctas = state.program.shape[0]
    assert got["grid"] == (num_ctas, 1, 1) and got["block"] == manifest.block
    assert manifest.block[0] == manifest.spec["num_threads"] + 32  # + the loader warp
    assert got["smem"] == manifest.smem > 0 and got["stream"] == STREAM
    assert got["attrs"] == {"CU_LAUNCH_ATTRIBUTE_COOPERATIVE": 1} and got["func"] == 0xC0DE
    ts = state.tensors()
    want = {n: t.data_ptr() for n, t in ts.items()}
    want.update(queue_len=state.program.shape[1], s_max=state.k_cache.shape[3],
                lengths_off=state.offsets[0])
    assert list(got["args"]) == [p["name"] for p in manifest.params]  # manifest order
    assert got["args"] == want
    assert fake_cuda == [state.program.device]  # the tensors' device made current
    # a second step: no second occupancy query, one more launch
    k.launch(num_ctas, ts, dict(queue_len=1, s_max=2, lengths_off=3))
    assert drv.names()[-1] == "cuLaunchKernelEx" and len(drv.launched) == 2
    assert drv.launched[1]["args"]["lengths_off"] == 3
    del k
    assert drv.names()[-1] == "cuLibraryUnload"


@pytest.mark.parametrize("call", ["cuLibraryLoadData", "cuLibraryGetKernel",
                                  "cuKernelSetAttribute",
                                  "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                                  "cuLaunchKernelEx"])
def test_a_failed_call_is_named(manifest, state, fake_cuda, call):
    drv = FakeDriver(manifest.params, fail={call: CUresult.CUDA_ERROR_INVALID_VALUE})
    with pytest.raises(RuntimeError, match=f"{call}.* failed: CUDA driver error 1: fake "
                                           "CUDA_ERROR_INVALID_VALUE"):
        _launch(manifest, state, drv)
    names = drv.names()
    after = names[names.index(call) + 1:]
    assert after in ([], ["cuLibraryUnload"])  # nothing runs past a failed call


def test_low_occupancy_is_refused_before_the_launch(manifest, state, fake_cuda):
    num_ctas = state.program.shape[0]  # 8 CTAs
    few = DeviceInfo("NVIDIA H200", (9, 0), num_ctas - 1, 232448)
    with pytest.raises(ArgumentError, match=f"{num_ctas} CTA queues but NVIDIA H200 has "
                                            f"{num_ctas - 1} SMs"):
        _launch(manifest, state, FakeDriver(manifest.params), few)
    drv = FakeDriver(manifest.params, occupancy=0)  # e.g. shared memory the SM cannot hold
    with pytest.raises(ArgumentError, match=rf"occupancy is 0 block\(s\) of "
                                            rf"{manifest.block[0]} threads with {manifest.smem} "
                                            rf"B .* x 132 SMs = 0 < {num_ctas}"):
        _launch(manifest, state, drv)
    assert "cuLaunchKernelEx" not in drv.names()
    drv = FakeDriver(manifest.params, occupancy=1)
    _launch(manifest, state, drv, DeviceInfo("NVIDIA H200", (9, 0), num_ctas, 232448))
    assert len(drv.launched) == 1  # exactly enough SMs


def test_the_fake_rejects_wrong_argument_types(manifest):
    """The fake is strict: a handle where an int belongs (or the reverse) is a TypeError."""
    drv = FakeDriver(manifest.params)
    with pytest.raises(TypeError, match="f must be CUfunction, got CUkernel"):
        drv.cuLaunchKernelEx(CUlaunchConfig(), CUkernel(1), 0, 0)
    with pytest.raises(TypeError, match="func must be CUfunction"):
        drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(0xC0DE, 288, 1024)
    with pytest.raises(TypeError, match="val must be int"):
        drv.cuKernelSetAttribute(
            CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 1.0,
            CUkernel(1), CUdevice(0))
    with pytest.raises(TypeError, match="name must be bytes"):
        drv.cuLibraryGetKernel(CUlibrary(1), "kernel")
