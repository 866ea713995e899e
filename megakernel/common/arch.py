"""The GPU architectures the kernel is built for, and the facts about them the build and the cost
model size things by. A leaf module (the standard library only): the kernel spec, the runtime and
the CLI's `info` all read the one table.

L2 capacities: H100 SXM5 and H200 (the same GH100 die) 50 MB (NVIDIA H100 Tensor Core GPU
Architecture whitepaper; `l2CacheSize` = 50 MiB); B200 126 MB over its two dies (Chips and
Cheese, "Nvidia's B200: Keeping the CUDA Juggernaut Rolling", 2025). SM counts: the largest part
of each arch (H100/H200 SXM 132, B200 148).
"""

from __future__ import annotations

ARCHS = ("sm_90a", "sm_100a")
# compute capability -> the arch a cubin must be built for
CAPABILITY_ARCH = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
L2_BYTES = {"sm_90a": 50 * 2**20, "sm_100a": 126 * 2**20}
ARCH_SMS = {"sm_90a": 132, "sm_100a": 148}
