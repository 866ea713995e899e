"""relu^2 MLP (Nemotron-H `-` blocks): h += down(relu(up x)^2), x = RMSNorm(h), no gate.

Packed: up [I, H], down [H, I]. Rounding: relu(up x)^2 in fp32, rounded to bf16 (down's input).
"""

from __future__ import annotations

import torch

from megakernel.isa.records import ROW_ALIGN
from megakernel.isa.registry import MATVEC, OpSpec, register
from megakernel.isa.stages import Instr, Stage
from megakernel.layers.base import register_kind
from megakernel.layers.frame import DOWN, residual_stage
from megakernel.layers.mlp import MLPConfig, MLPKind

Relu2Config = MLPConfig


UP_RELU2 = register(OpSpec(
    19, "UP_RELU2", "relu2", "RMSNorm(h) -> slab of up_proj -> relu(x)^2 (bf16)", MATVEC,
    notes="OUT_OFF = bf16 act [N, I]: act[n, ROW0 + r] = bf16(relu(acc)^2).",
    slab=True, matvec="epilogues.Relu2", device=True))


@register_kind
class Relu2MLP(MLPKind):
    name = "relu2"
    flow = {"UP_RELU2": None, "DOWN": "UP_RELU2"}
    up_op = "UP_RELU2"

    @classmethod
    def shapes(cls, blk, model) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
        i, h = blk.cfg.intermediate_size, model.hidden_size
        return {"up_proj.weight": (i, h), "down_proj.weight": (h, i)}

    @classmethod
    def matrices(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        i, h = blk.cfg.intermediate_size, model.hidden_size
        return [("up", (i, h)), ("down", (h, i))]

    @classmethod
    def pack(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        return {"up": w("up_proj.weight"), "down": w("down_proj.weight")}

    @classmethod
    def stages(cls, blk, ctx, wait: int) -> tuple[list[Stage], int]:  # noqa: ANN001
        inter, layer, n, hid = blk.cfg.intermediate_size, blk.layer, ctx.rows, ctx.model.hidden_size
        w_off, norm = ctx.lay[f"{blk.key}.up"].offset, ctx.lay[f"{blk.key}.norm"].offset
        act, c_up = ctx.buf.bf16["act"].offset, ctx.ctr(f"L{layer}.up")

        def mk_up(u0: int, u1: int) -> Instr:
            r0, rows = u0 * ROW_ALIGN, (u1 - u0) * ROW_ALIGN
            return ctx.matvec(UP_RELU2, layer, w_off, r0, rows, hid, norm,
                              ctx.buf.f32["h"].offset, act, wait, c_up, n * rows * 2)

        up = Stage(f"L{layer}.up", UP_RELU2, layer, inter // ROW_ALIGN, True, mk_up, ROW_ALIGN)
        dn, c_dn = residual_stage(ctx, DOWN, blk, "down", inter, act, c_up, f"L{layer}.down")
        return [up, dn], c_dn
