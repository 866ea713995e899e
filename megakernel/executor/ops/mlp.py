"""GATEUP (SwiGLU, layers/swiglu.py) and UP_RELU2 (layers/relu2.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel import isa
from megakernel.executor.core import Executor, op


@op("GATEUP")
def gateup(ex: Executor, d: dict, epoch: int) -> None:
    acc = ex.matvec(d)  # [N, NROWS], blocks of [gate 16 | up 16]
    n = ex.prog.rows
    blk = acc.view(n, -1, 2, isa.GATEUP_BLOCK)
    act = (F.silu(blk[:, :, 0]) * blk[:, :, 1]).reshape(n, -1)
    c0, width = d["ROW0"] // 2, ex.block(d, "swiglu").cfg.intermediate_size
    ex.write("bf16", d["OUT_OFF"], (n, width), (slice(None), slice(c0, c0 + d["NROWS"] // 2)),
             act)


@op("UP_RELU2")
def up_relu2(ex: Executor, d: dict, epoch: int) -> None:
    acc = ex.matvec(d)  # [N, NROWS]
    r0, n = d["ROW0"], ex.prog.rows
    width = ex.block(d, "relu2").cfg.intermediate_size
    ex.write("bf16", d["OUT_OFF"], (n, width), (slice(None), slice(r0, r0 + d["NROWS"])),
             torch.relu(acc).square())
