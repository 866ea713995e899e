"""What the feed-forward kinds (SwiGLU, relu^2) share: the config (an intermediate size), the
support check, the init roles and the bf16 activation between the two matrices.

Buffers: bf16 act [N, I] (the activation, the down projection's input).
"""

from __future__ import annotations

from dataclasses import dataclass

from megakernel.isa.records import ROW_ALIGN
from megakernel.layers.base import LayerKind, Need, StepShape
from megakernel.models.config import ConfigError, positive


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

    @classmethod
    def check(cls, blk, model) -> None:  # noqa: ANN001
        i = blk.cfg.intermediate_size
        if i % cls.row_unit:
            raise ConfigError(f"intermediate_size = {i} must be a multiple of {cls.row_unit}")

    @classmethod
    def init_role(cls, local: str, blk) -> str:  # noqa: ANN001
        return "out" if local == "down_proj.weight" else "proj"

    @classmethod
    def needs(cls, blk, model, shape: StepShape) -> list[Need]:  # noqa: ANN001
        return [Need("bf16", "act", (shape.rows, blk.cfg.intermediate_size))]
