"""What the feed-forward kinds (SwiGLU, relu^2) share: the config (an intermediate size), the
support check, the init roles and the bf16 activation between the two matrices.

Buffers: bf16 act [N, I] (the activation, the down projection's input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megakernel.common.errors import ConfigError, positive
from megakernel.isa.records import ROW_ALIGN
from megakernel.layers.base import LayerKind, Need, StepShape


@dataclass(frozen=True)
class MLPConfig:
    """A feed-forward block's intermediate size."""

    intermediate_size: int

    def __post_init__(self) -> None:
        positive(self, "intermediate_size")


class MLPKind(LayerKind):
    """A feed-forward kind: h += down(act(x)), x = RMSNorm(h), act [N, I] in bf16."""

    config = MLPConfig
    row_unit = ROW_ALIGN  # the intermediate size is a multiple of this (whole slabs)
    # the opcode of the matrix before the activation, and its rows per intermediate column
    up_op: ClassVar[str] = ""
    up_rows: ClassVar[int] = 1

    @classmethod
    def kernel_constants(cls, c: MLPConfig) -> tuple[int, ...]:
        return (c.intermediate_size,)  # KernelSpec.inter

    @classmethod
    def matvec_shapes(cls, spec) -> dict[str, list[tuple[int, int]]]:  # noqa: ANN001
        i = spec.constants(cls.name)[0]
        return {cls.up_op: [(spec.hidden, cls.up_rows * i)], "DOWN": [(i, spec.hidden)]}

    @classmethod
    def check(cls, blk, model) -> None:  # noqa: ANN001
        i = blk.cfg.intermediate_size
        if i % cls.row_unit:
            raise ConfigError(f"intermediate_size = {i} must be a multiple of {cls.row_unit}")

    @classmethod
    def quantized(cls, blk, model) -> list[str]:  # noqa: ANN001
        return list(cls.shapes(blk, model))  # every tensor of an MLP is a streamed matrix

    @classmethod
    def init_role(cls, local: str, blk) -> str:  # noqa: ANN001
        return "out" if local == "down_proj.weight" else "proj"

    @classmethod
    def needs(cls, blk, model, shape: StepShape) -> list[Need]:  # noqa: ANN001
        return [Need("bf16", "act", (shape.rows, blk.cfg.intermediate_size))]
