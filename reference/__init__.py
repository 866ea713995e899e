"""Torch reference model for Llama and Qwen3 decode: fp32 truth and a bf16 mirror of the kernel."""

from .model import (
    KVCache,
    ReferenceError,
    ReferenceModel,
    expected_weight_shapes,
    generate,
    greedy,
)

__all__ = [
    "KVCache",
    "ReferenceError",
    "ReferenceModel",
    "expected_weight_shapes",
    "generate",
    "greedy",
]
