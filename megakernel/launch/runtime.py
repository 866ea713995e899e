"""Load a prebuilt megakernel and launch it: with the CUDA driver API (cuda-python), or its PTX on
the emulator (megakernel.launch.emulated), through one driver interface (`KernelDriver`).

Needs torch and cuda-python only, never the DSL: this is what runs on a GPU machine that cannot
install the compiler. Both drivers share the manifest checks, the device checks (the emulator
describes an emulated device, `emulated_device`) and the argument marshalling (`launch_params`). A
build directory (megakernel.kernel.toolchain.build) holds DIR/<arch>/manifest.json next to the
cubin. Before anything touches CUDA the runtime checks, with errors that name the problem:
- the manifest: schema, program FORMAT_VERSION (a stale build is refused), arch;
- the device: compute capability -> arch (9.0 -> sm_90a, 10.0 -> sm_100a), SM count >= CTAs of
  the program (all CTAs must be co-resident: they spin on each other), shared-memory opt-in limit,
  and, before the first launch, the driver's occupancy (blocks per SM x SMs >= CTAs);
- every tensor argument, the program header and its records: launch/checks.py.
The launch goes on torch's current stream with the cooperative attribute (co-residency is then
guaranteed or the launch fails), so it is stream-ordered with torch work and graph-capturable.
A step whose counter wait does not complete within 10 s (a deadlock) ends with CUDA's "an illegal
instruction was encountered": the kernel's watchdog trap (megakernel/kernel/device/sync.py).
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from megakernel import isa
from megakernel.common.arch import ARCHS, CAPABILITY_ARCH
from megakernel.common.errors import KernelUnavailable, UserError
from megakernel.launch.checks import ArgumentError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


class ManifestError(UserError, ValueError):
    """A build directory or manifest that this runtime refuses (stale, wrong arch, damaged)."""


# ---- manifest -----------------------------------------------------------------------------------
_REQUIRED = ("manifest_version", "arch", "symbol", "cubin", "block", "dynamic_smem_bytes",
             "params", "program_format_version", "fingerprint", "spec", "resources")


@dataclass(frozen=True)
class Manifest:
    path: Path  # the directory holding manifest.json and the cubin
    data: dict[str, Any]

    @property
    def arch(self) -> str:
        return self.data["arch"]

    @property
    def spec(self) -> dict[str, Any]:
        return self.data["spec"]

    @property
    def symbol(self) -> str:
        return self.data["symbol"]

    @property
    def block(self) -> tuple[int, int, int]:
        b = self.data["block"]
        return int(b[0]), int(b[1]), int(b[2])

    @property
    def smem(self) -> int:
        return int(self.data["dynamic_smem_bytes"])

    @property
    def params(self) -> list[dict[str, Any]]:
        return self.data["params"]

    @property
    def rows(self) -> int:
        return int(self.spec["batch"]) * int(self.spec["tokens"])

    def cubin_bytes(self) -> bytes:
        p = self.path / self.data["cubin"]
        if not p.is_file():
            raise ManifestError(f"cubin {p} named by the manifest is missing")
        return p.read_bytes()


def parse_manifest(data: dict[str, Any], path: Path, arch: str | None = None) -> Manifest:
    """Validate a manifest dict; refuses other manifest/program versions and the wrong arch."""
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ManifestError(f"manifest in {path} lacks {', '.join(missing)}")
    if data["manifest_version"] != MANIFEST_VERSION:
        raise ManifestError(f"manifest in {path} has version {data['manifest_version']}; this "
                            f"runtime reads version {MANIFEST_VERSION}: rebuild the kernel")
    if data["program_format_version"] != isa.FORMAT_VERSION:
        raise ManifestError(
            f"stale build in {path}: compiled for program format version "
            f"{data['program_format_version']}, but the program compiler now emits version "
            f"{isa.FORMAT_VERSION}; rebuild with `python -m megakernel build`")
    if data["arch"] not in ARCHS:
        raise ManifestError(f"manifest in {path} is for unsupported arch {data['arch']!r}")
    if arch is not None and data["arch"] != arch:
        raise ManifestError(f"manifest in {path} is for {data['arch']}, the device needs {arch}")
    from megakernel.kernel.config.spec import PARAMS  # pure Python: no DSL import

    names = [p["name"] for p in data["params"]]
    if names != [p.name for p in PARAMS]:
        raise ManifestError(f"manifest in {path} has parameters {names}; this runtime launches "
                            f"{[p.name for p in PARAMS]}: rebuild the kernel")
    return Manifest(path, data)


def load_manifest(build_dir: str | Path, arch: str) -> Manifest:
    """The manifest of `arch` in a build directory (DIR/<arch>/manifest.json, or DIR itself)."""
    d = Path(build_dir)
    for cand in (d / arch, d):
        f = cand / MANIFEST_NAME
        if f.is_file():
            try:
                data = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise ManifestError(f"{f} is not valid JSON: {e}") from None
            return parse_manifest(data, cand, arch)
    raise KernelUnavailable(f"no {arch} build in {d} (expected {d / arch / MANIFEST_NAME}); build "
                            f"one with `python -m megakernel build --arch {arch} --out {d}`")


# ---- device -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_optin: int  # bytes of dynamic shared memory one block may opt into

    @property
    def arch(self) -> str:
        return arch_for_capability(self.capability)


def arch_for_capability(cap: tuple[int, int]) -> str:
    if tuple(cap) not in CAPABILITY_ARCH:
        raise KernelUnavailable(f"GPU compute capability {cap[0]}.{cap[1]} is not a kernel "
                                f"target; the kernel runs on 9.0 (sm_90a) and 10.0 (sm_100a)")
    return CAPABILITY_ARCH[tuple(cap)]


def device_info(device: int | torch.device | None = None) -> DeviceInfo:
    if not torch.cuda.is_available():
        raise KernelUnavailable("no CUDA GPU is available (torch.cuda.is_available() is False); "
                                "the kernel needs an sm_90a or sm_100a GPU")
    idx = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    p = torch.cuda.get_device_properties(idx)
    smem = int(getattr(p, "shared_memory_per_block_optin", 0) or 0)
    return DeviceInfo(p.name, (p.major, p.minor), int(p.multi_processor_count), smem)


def check_device(m: Manifest, dev: DeviceInfo, num_ctas: int,
                 blocks_per_sm: int | None = None) -> None:
    """The build fits the device: arch, co-residency of every CTA, shared memory.

    `blocks_per_sm`: the driver's occupancy of the kernel at the manifest's block size and
    dynamic shared memory (cuOccupancyMaxActiveBlocksPerMultiprocessor); a cooperative launch
    needs blocks_per_sm * SMs >= CTAs, else the launch would fail (or, without the cooperative
    attribute, the CTAs would spin on CTAs that never start)."""
    if dev.arch != m.arch:
        raise ManifestError(f"the build in {m.path} is for {m.arch}, but {dev.name} is "
                            f"{dev.arch}: build for {dev.arch}")
    if num_ctas > dev.sm_count:
        raise ArgumentError(f"the program has {num_ctas} CTA queues but {dev.name} has "
                            f"{dev.sm_count} SMs: the CTAs spin on each other and must all be "
                            f"resident; compile the program for this GPU")
    if dev.smem_optin and m.smem > dev.smem_optin:
        raise ManifestError(f"the kernel needs {m.smem} B of shared memory per CTA, {dev.name} "
                            f"allows {dev.smem_optin} B")
    if blocks_per_sm is not None and blocks_per_sm * dev.sm_count < num_ctas:
        raise ArgumentError(
            f"the cooperative launch needs all {num_ctas} CTAs resident, but the driver's "
            f"occupancy is {blocks_per_sm} block(s) of {m.block[0]} threads with {m.smem} B of "
            f"dynamic shared memory per SM x {dev.sm_count} SMs = "
            f"{blocks_per_sm * dev.sm_count} < {num_ctas}")


# ---- the driver interface ------------------------------------------------------------------------
class KernelDriver(Protocol):
    """A build loaded for launching: the CUDA driver's (`LoadedKernel`) or the emulator's
    (`megakernel.launch.emulated.EmulatedKernel`). The op validates the arguments first
    (launch.checks.validate_args); `launch` checks the device and runs one step."""

    manifest: Manifest

    def launch(self, num_ctas: int, tensors: dict[str, torch.Tensor], ints: dict[str, int],
               stream: int | None = None) -> None: ...


def launch_params(m: Manifest, tensors: dict[str, torch.Tensor], ints: dict[str, int]
                  ) -> list[tuple[str, str, torch.Tensor | int]]:
    """The kernel's parameters in the manifest's (the ABI's, kernel/spec.PARAMS) order:
    (name, kind "ptr" | "i32", tensor or int). Both drivers marshal from this."""
    out: list[tuple[str, str, torch.Tensor | int]] = []
    for p in m.params:
        name, kind = p["name"], p["kind"]
        src = tensors if kind == "ptr" else ints
        if name not in src:
            raise ArgumentError(f"missing kernel parameter {name!r} ({kind})")
        out.append((name, kind, src[name] if kind == "ptr" else int(src[name])))
    return out


# ---- the driver-API launcher --------------------------------------------------------------------
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 layout
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError:
            raise KernelUnavailable("cuda-python is not installed (pip install cuda-python)") \
                from None
    return driver


def _check(result, call: str, drv=None):  # noqa: ANN001 (cuda-python objects)
    """cuda-python returns (err, *values): raise naming `call` on error, return the values."""
    drv = drv or _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != int(drv.CUresult.CUDA_SUCCESS):
        _, msg = drv.cuGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise RuntimeError(f"{call} failed: CUDA driver error {int(err)}: {text}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


class LoadedKernel:
    """A cubin loaded into the current CUDA context, ready to launch on torch's streams.

    `driver` (default: cuda.bindings.driver) and `dev` (default: device_info(device)) are
    injectable so that the whole call sequence can be checked against a fake driver."""

    def __init__(self, manifest: Manifest, device: int | None = None, *, driver=None,  # noqa: ANN001
                 dev: DeviceInfo | None = None):
        self.manifest = manifest
        self.dev = dev or device_info(device)
        if self.dev.arch != manifest.arch:
            raise ManifestError(f"the build in {manifest.path} is for {manifest.arch}, but "
                                f"{self.dev.name} is {self.dev.arch}")
        self.drv = drv = driver or _driver()
        self.blocks_per_sm: int | None = None  # the driver's occupancy (first launch)
        torch.cuda.init()  # torch owns the primary context; the driver API uses it
        torch.cuda.current_stream()
        self._cubin = manifest.cubin_bytes()
        self.library = _check(drv.cuLibraryLoadData(self._cubin, None, None, 0, None, None, 0),
                              "cuLibraryLoadData", drv)
        self.kernel = _check(drv.cuLibraryGetKernel(self.library, manifest.symbol.encode()),
                             "cuLibraryGetKernel", drv)
        dev_idx = torch.cuda.current_device() if device is None else int(device)
        cu_dev = _check(drv.cuDeviceGet(dev_idx), "cuDeviceGet", drv)
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(drv.cuKernelSetAttribute(attr, manifest.smem, self.kernel, cu_dev),
               "cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", drv)

    def launch(self, num_ctas: int, tensors: dict[str, torch.Tensor], ints: dict[str, int],
               stream: int | None = None) -> None:
        """One step. Validation is the caller's (validate_args) - this only launches."""
        drv = self.drv
        check_device(self.manifest, self.dev, num_ctas)
        vals, keep = [], []
        for _, kind, x in launch_params(self.manifest, tensors, ints):
            v = ctypes.c_uint64(x.data_ptr()) if kind == "ptr" else ctypes.c_int32(x)
            keep.append(v)
            vals.append(ctypes.addressof(v))
        argv = (ctypes.c_void_p * len(vals))(*vals)
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = num_ctas, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.manifest.block
        cfg.sharedMemBytes = self.manifest.smem
        # the tensors' device, not whichever device is current: its context and its stream
        dev = next(iter(tensors.values())).device  # validate_args: all on one device
        func = drv.CUfunction(int(self.kernel))  # the CUkernel, resolved in the current context
        with torch.cuda.device(dev):  # makes that device's primary context current
            if self.blocks_per_sm is None:  # the co-residency a cooperative launch needs
                self.blocks_per_sm = int(_check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    func, self.manifest.block[0], self.manifest.smem),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor", drv))
            check_device(self.manifest, self.dev, num_ctas, self.blocks_per_sm)
            s = torch.cuda.current_stream(dev).cuda_stream if stream is None else stream
            cfg.hStream = drv.CUstream(s)
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attr.value.cooperative = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            _check(drv.cuLaunchKernelEx(cfg, func, ctypes.addressof(argv), 0),
                   "cuLaunchKernelEx", drv)
        del keep

    def __del__(self):
        lib = getattr(self, "library", None)
        if lib is not None:
            try:
                self.drv.cuLibraryUnload(lib)
            except Exception:  # interpreter shutdown: the context may be gone already
                pass
