"""The emulator behind the runtime's driver interface: a build's PTX launched on the CPU.

`EmulatedKernel(manifest)` is what the op (torch_op) loads for a build registered with
`emulate=True` and launches exactly as the CUDA driver's `LoadedKernel`: the same argument
validation before, the same device checks (against `emulated_device`) and the same marshalling
(runtime.launch_params). The tensors are CPU tensors and the kernel mutates them in place. Each
launch takes the next scheduler seed, so a run's steps interleave differently and its results
must not depend on that. With MEGAKERNEL_COVERAGE set, each launch records the PTX lines it
executed (megakernel.emulator.coverage.record).

The emulated device is an H200 with EMULATED_SMS SMs (one CTA each): the programs the emulator
backend compiles have that many queues. The same PTX serves any CTA count; fewer keep a tiny
step within seconds.
"""

from __future__ import annotations

import torch

from megakernel.emulator.coverage import record
from megakernel.emulator.machine import Emulator, LaunchStats
from megakernel.launch.runtime import (
    DeviceInfo,
    Manifest,
    ManifestError,
    check_device,
    launch_params,
)

EMULATED_SMS = 8  # CTAs of an emulated program: enough to interleave, few enough to be quick
EMULATED_ARCH = "sm_90a"  # the arch gpu-check --emulate runs (the emulator takes sm_100a's too)
# the most CTAs one emulated launch runs (an emulated device's SMs): more would be slow, not wrong
MAX_EMULATED_CTAS = 32
SMEM_OPTIN = 232448  # H100/H200 and B200: 227 KiB of dynamic shared memory per block
READ_ONLY = frozenset({"program", "weights"})  # what a step must never write


def emulated_device(arch: str) -> DeviceInfo:
    """The device the emulator stands for: `arch`'s capability and shared-memory limit, with
    MAX_EMULATED_CTAS SMs."""
    from megakernel.common.arch import CAPABILITY_ARCH

    cap = next(c for c, a in CAPABILITY_ARCH.items() if a == arch)
    return DeviceInfo(f"emulated {arch}", cap, MAX_EMULATED_CTAS, SMEM_OPTIN)


class EmulatedKernel:
    """A build's PTX parsed and decoded once, launched on CPU tensors (runtime.KernelDriver)."""

    def __init__(self, manifest: Manifest, seed: int = 0) -> None:
        self.manifest = manifest
        self.dev = emulated_device(manifest.arch)
        ptx = manifest.data.get("ptx")
        path = manifest.path / ptx if ptx else None
        if path is None or not path.is_file():
            raise ManifestError(f"the build in {manifest.path} has no PTX "
                                f"({path or 'the manifest names none'}) for the emulator")
        self.ptx_path = path
        self.emulator = Emulator(path.read_text(), manifest.smem, manifest.block)
        self.seed = seed
        self.launches = 0
        self.last: LaunchStats | None = None

    def launch(self, num_ctas: int, tensors: dict[str, torch.Tensor], ints: dict[str, int],
               stream: int | None = None) -> None:
        """One step on the emulator (`stream` is the CUDA driver's; nothing to order here)."""
        del stream
        check_device(self.manifest, self.dev, num_ctas, blocks_per_sm=1)
        params = [(name, x) for name, _, x in launch_params(self.manifest, tensors, ints)]
        self.last = self.emulator.launch(num_ctas, params, seed=self.seed + self.launches,
                                         readonly=READ_ONLY)
        self.launches += 1
        record(self.ptx_path, self.last.hits)
