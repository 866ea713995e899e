"""GPU descriptions for the program compiler and the cost model.

Published figures, each with its source in `SOURCES`:
- [H100] NVIDIA H100 Tensor Core GPU datasheet (SXM5): 132 SMs, 80 GB HBM3 at 3.35 TB/s,
  989 TFLOPS dense BF16 tensor, 67 TFLOPS FP32.
- [H200] NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s; same GH100 compute
  as H100 SXM (132 SMs, 989 TFLOPS dense BF16, 67 TFLOPS FP32).
- [B200] NVIDIA Blackwell / DGX B200 datasheets: 148 SMs, 180 GB HBM3e at 8 TB/s, 2.25 PFLOPS
  dense BF16 tensor (HGX B200), 75 TFLOPS FP32 (assumed equal to the 1000 W part's figure).
- [TUNE] CUDA Hopper and Blackwell tuning guides: 228 KB shared memory per SM, at most 227 KB per
  thread block (the opt-in dynamic shared-memory limit).
- [READ] Achievable HBM read bandwidth, the rate the cost model streams at until a run measures
  one: H200 3.89 TB/s (81% of spec), measured by a public read benchmark (te42kyfo/gpu-benches,
  H200 result files; its triad reached 3.53 TB/s). H100 and B200 have no such figure here: they are
  assumed to reach the same 81% of their spec (2.72 and 6.48 TB/s), an assumption the Llama-3.2-1B
  hindcast (bench/hindcast.py) is consistent with but does not measure.
- [COPY] `copy_bw`: the bandwidth the cost model streams at and divides the floor by: the [READ]
  figure until a GPU run measures a copy (docs/COST-MODEL.md, Physical floor; `with_copy_bandwidth`
  replaces it). A prediction below bytes / this bandwidth is refused (cost.TooFastError).
- [L2] L2 -> SM read bandwidth: 2.5x the HBM spec of the H100 SXM (8.4 TB/s), an assumption from
  Chips and Cheese's H100 PCIe measurement (about 5.5 TB/s of L2 against 2 TB/s of HBM2e). The
  L2 is on the die, so the H200 (the same GH100 die and 50 MB L2 with faster HBM) gets the H100
  figure, not 2.5x its own HBM. B200: 2.5x its HBM spec, an assumption (no published B200 L2
  bandwidth figure is used). The cost model reads prefetched weights and activations from L2 at
  this bandwidth / SMs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megakernel.common.errors import UserError

SOURCES = {
    "H100": "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
    "H200": "NVIDIA H200 Tensor Core GPU datasheet (SXM)",
    "B200": "NVIDIA DGX B200 / HGX B200 datasheets",
    "TUNE": "NVIDIA Hopper and Blackwell tuning guides (shared memory per SM)",
    "READ": "H200 read 3.89 TB/s (te42kyfo/gpu-benches); H100, B200: same 81% of spec assumed",
    "COPY": "the cost model streams at the [READ] bandwidth until a run measures a copy",
    "L2": "assumption: L2 read bandwidth = 2.5x HBM spec (Chips and Cheese, H100 PCIe); "
          "H200 = H100 (same die)",
}

READ_FRACTION = 3.89 / 4.8  # [READ]: the H200 measurement's fraction of its spec
L2_FACTOR = 2.5


class GPUError(UserError, ValueError):
    """Unknown GPU name or unusable device properties."""


@dataclass(frozen=True)
class GPU:
    name: str
    arch: str  # "sm_90a" | "sm_100a"
    num_sms: int
    smem_per_block: int  # bytes of dynamic shared memory one CTA may use
    memory_bytes: int
    hbm_bw: float  # bytes/s, spec peak
    copy_bw: float  # bytes/s, what the cost model streams at (see [COPY])
    l2_bw: float  # bytes/s, L2 -> SMs (see [L2])
    bf16_tensor_flops: float  # dense, whole GPU
    fp32_flops: float  # CUDA cores, whole GPU
    read_bw: float = 0.0  # bytes/s, cited or assumed achievable HBM read bandwidth (see [READ])
    copy_bw_measured: bool = False

    @property
    def achievable_bw(self) -> float:
        """Bytes/s no decode step can beat: the measured copy bandwidth, else [READ]."""
        return self.copy_bw if self.copy_bw_measured else self.read_bw

    def with_copy_bandwidth(self, bytes_per_s: float) -> GPU:
        """This GPU with a measured copy bandwidth."""
        if not bytes_per_s > 0:
            raise GPUError(f"copy bandwidth must be positive, got {bytes_per_s}")
        return dataclasses.replace(self, copy_bw=float(bytes_per_s), copy_bw_measured=True)

    def with_sms(self, num_sms: int) -> GPU:
        """The same GPU restricted to `num_sms` SMs (bandwidth scaled down in proportion).

        Used for small test programs; a real run uses every SM.
        """
        if not 1 <= num_sms <= self.num_sms:
            raise GPUError(f"num_sms must be in [1, {self.num_sms}], got {num_sms}")
        f = num_sms / self.num_sms
        return dataclasses.replace(
            self,
            name=f"{self.name}/{num_sms}sm",
            num_sms=num_sms,
            hbm_bw=self.hbm_bw * f,
            copy_bw=self.copy_bw * f,
            read_bw=self.read_bw * f,
            l2_bw=self.l2_bw * f,
            bf16_tensor_flops=self.bf16_tensor_flops * f,
            fp32_flops=self.fp32_flops * f,
        )


def _gpu(name, arch, sms, mem_gb, hbm_tb, bf16_tf, fp32_tf, l2_hbm_tb=None,  # noqa: ANN001
         read_tb=None) -> GPU:  # noqa: ANN001
    """`l2_hbm_tb`: the HBM spec the [L2] factor applies to (the die's own part), default hbm_tb;
    `read_tb`: a published achievable read bandwidth, default READ_FRACTION of the spec."""
    hbm = hbm_tb * 1e12
    read = read_tb * 1e12 if read_tb else READ_FRACTION * hbm
    return GPU(
        name=name,
        arch=arch,
        num_sms=sms,
        smem_per_block=227 * 1024,
        memory_bytes=int(mem_gb * 1e9),
        hbm_bw=hbm,
        copy_bw=read,
        l2_bw=L2_FACTOR * (l2_hbm_tb or hbm_tb) * 1e12,
        bf16_tensor_flops=bf16_tf * 1e12,
        fp32_flops=fp32_tf * 1e12,
        read_bw=read,
    )


GPUS: dict[str, GPU] = {
    "h100": _gpu("H100 SXM", "sm_90a", 132, 80, 3.35, 989.4, 66.9),
    "h200": _gpu("H200 SXM", "sm_90a", 132, 141, 4.8, 989.4, 66.9, l2_hbm_tb=3.35, read_tb=3.89),
    "b200": _gpu("B200", "sm_100a", 148, 180, 8.0, 2250.0, 75.0),
}


def gpu(name: str) -> GPU:
    """A GPU description by name (h100, h200, b200)."""
    key = name.lower().replace(" ", "").replace("-", "").replace("sxm", "")
    if key not in GPUS:
        raise GPUError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or use from_device())")
    return GPUS[key]


def from_properties(props, copy_bw: float | None = None) -> GPU:  # noqa: ANN001
    """A description from `torch.cuda.get_device_properties(...)`-like properties.

    SM count, memory and shared memory come from the device. Bandwidth and FLOPS are not device
    properties: they are taken from the matching known GPU (by name), and `copy_bw` (bytes/s,
    measured) replaces the assumed copy bandwidth when given.
    """
    name = str(getattr(props, "name", ""))
    base = None
    for key, g in GPUS.items():
        if key in name.lower().replace(" ", ""):
            base = g
    sms = int(getattr(props, "multi_processor_count", 0))
    if sms < 1:
        raise GPUError(f"device {name!r} reports {sms} SMs")
    if base is None:
        raise GPUError(
            f"no bandwidth figures for device {name!r}; known: {', '.join(GPUS)}. "
            "Describe it with GPU(...) and a measured copy bandwidth."
        )
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or base.smem_per_block)
    mem = int(getattr(props, "total_memory", 0) or base.memory_bytes)
    major = getattr(props, "major", None)
    arch = base.arch if major is None else ("sm_100a" if major >= 10 else "sm_90a")
    scale = sms / base.num_sms
    g = dataclasses.replace(
        base,
        name=name,
        arch=arch,
        num_sms=sms,
        smem_per_block=smem,
        memory_bytes=mem,
        bf16_tensor_flops=base.bf16_tensor_flops * scale,
        fp32_flops=base.fp32_flops * scale,
    )
    return g.with_copy_bandwidth(copy_bw) if copy_bw is not None else g


def from_device(index: int = 0, copy_bw: float | None = None) -> GPU:
    """The description of live CUDA device `index` (see `from_properties`)."""
    import torch

    if not torch.cuda.is_available():
        raise GPUError("no CUDA device available; name a GPU (h100, h200, b200) instead")
    return from_properties(torch.cuda.get_device_properties(index), copy_bw)
