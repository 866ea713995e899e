"""The GPU description the CPU executor compiles programs for: an H100 (or another named GPU) cut
down to a few SMs, so that a program interleaves its SMs' queues and still runs quickly on a CPU."""

from __future__ import annotations

from megakernel.program.gpus import GPU
from megakernel.program.gpus import gpu as gpu_by_name

DEFAULT_SMS = 8  # SMs of the description the CPU backend compiles for (fewer = faster on a CPU)


def executor_gpu(num_sms: int = DEFAULT_SMS, base: str = "h100") -> GPU:
    """`base` (a program.gpus name) with `num_sms` SMs."""
    return gpu_by_name(base).with_sms(num_sms)
