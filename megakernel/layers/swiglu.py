"""SwiGLU MLP: h += down(silu(gate x) * up x), x = RMSNorm(h) (Llama, Qwen, Qwen3.5, Kimi's dense
layers; MoE experts use the same math, layers/moe.py).

Packed gate/up: blocks of GATEUP_BLOCK rows alternate, [gate rows 16j .. 16j+15, up rows 16j ..
16j+15] for j = 0 .. I/16 - 1, so a slab of whole block pairs has the matching gate and up rows
(its output columns are ROW0 / 2 .. (ROW0 + NROWS) / 2 - 1 of the activation). Rounding: gate and
up in fp32, silu(gate) * up in fp32, rounded to bf16 (the down projection's input).
"""

from __future__ import annotations

import torch

from megakernel.isa.records import GATEUP_BLOCK
from megakernel.isa.registry import MATVEC, OpSpec, register
from megakernel.isa.stages import Instr, Stage
from megakernel.layers.base import register_kind
from megakernel.layers.frame import DOWN, residual_stage
from megakernel.layers.mlp import MLPConfig, MLPKind

SwiGLUConfig = MLPConfig


GATEUP = register(OpSpec(
    6, "GATEUP", "swiglu", "RMSNorm(h) -> slab of interleaved gate/up -> silu(gate) * up (bf16)",
    MATVEC, notes="OUT_OFF = bf16 act [N, I]: act[n, ROW0/2 + c] = bf16(silu(g) * u).",
    slab=True, matvec="epilogues.GateUp", device=True))


def gateup_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [I, H] -> [2 I, H] in alternating blocks of GATEUP_BLOCK rows."""
    i, hid = gate.shape
    nb = i // GATEUP_BLOCK
    return torch.stack((gate.reshape(nb, GATEUP_BLOCK, hid), up.reshape(nb, GATEUP_BLOCK, hid)),
                       dim=1).reshape(2 * i, hid)


def gateup_pairs_error(d: dict) -> str:
    """Why a (decoded) gate/up slab record is not whole GATEUP_BLOCK-row (gate, up) block pairs,
    as the epilogue pairs them ('' when it is)."""
    if d["NROWS"] % (2 * GATEUP_BLOCK) or d["ROW0"] % (2 * GATEUP_BLOCK):
        return (f"a GATEUP slab of {d['NROWS']} rows at row {d['ROW0']} is not whole "
                f"{GATEUP_BLOCK}-row gate/up block pairs")
    return ""


def gateup_stage(ctx, blk, matrix: str, inter: int, wait: int, counter: str,  # noqa: ANN001
                 op=GATEUP, out: str = "act", **extra) -> tuple[Stage, int]:  # noqa: ANN001, ANN003
    """RMSNorm(h) -> packed gate/up `L{layer}.{name}.{matrix}` [2 I, H] in units of whole block
    pairs -> bf16 `out`."""
    layer, hid, n = blk.layer, ctx.model.hidden_size, ctx.rows
    w_off, norm = ctx.lay[f"{blk.key}.{matrix}"].offset, ctx.lay[f"{blk.key}.norm"].offset
    rows_unit, c = 2 * GATEUP_BLOCK, ctx.ctr(counter)
    h_off, out_off = ctx.buf.f32["h"].offset, ctx.buf.bf16[out].offset

    def mk(u0: int, u1: int) -> Instr:
        r0, rows = u0 * rows_unit, (u1 - u0) * rows_unit
        return ctx.matvec(op, layer, w_off, r0, rows, hid, norm, h_off, out_off, wait, c,
                          n * rows, **extra)

    return Stage(counter, op, layer, 2 * inter // rows_unit, True, mk, rows_unit), c


@register_kind
class SwiGLU(MLPKind):
    name = "swiglu"
    row_unit = GATEUP_BLOCK
    flow = {"GATEUP": None, "DOWN": "GATEUP"}
    up_op, up_rows = "GATEUP", 2  # interleaved gate and up rows

    @classmethod
    def check_kernel_record(cls, d: dict, spec) -> str:  # noqa: ANN001 (KernelSpec)
        return gateup_pairs_error(d) if d["OPCODE"] == GATEUP else ""

    @classmethod
    def shapes(cls, blk, model) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
        i, h = blk.cfg.intermediate_size, model.hidden_size
        return {"gate_proj.weight": (i, h), "up_proj.weight": (i, h), "down_proj.weight": (h, i)}

    @classmethod
    def header(cls, blk, model) -> dict[str, int]:  # noqa: ANN001
        return {"I": blk.cfg.intermediate_size}

    @classmethod
    def matrices(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        i, h = blk.cfg.intermediate_size, model.hidden_size
        return [("gateup", (2 * i, h)), ("down", (h, i))]

    @classmethod
    def pack(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        return {"gateup": gateup_rows(w("gate_proj.weight"), w("up_proj.weight")),
                "down": w("down_proj.weight")}

    @classmethod
    def stages(cls, blk, ctx, wait: int) -> tuple[list[Stage], int]:  # noqa: ANN001
        inter, layer = blk.cfg.intermediate_size, blk.layer
        gu, c_gu = gateup_stage(ctx, blk, "gateup", inter, wait, f"L{layer}.gateup")
        dn, c_dn = residual_stage(ctx, DOWN, blk, "down", inter, ctx.buf.bf16["act"].offset, c_gu,
                                  f"L{layer}.down")
        return [gu, dn], c_dn
