"""What the recurrent cores share (layers/recurrent.py): the record's block of the state arena,
the short causal conv over the fp32 window, and the ring bookkeeping of ReplaySSM."""

from __future__ import annotations

import math

import torch

from megakernel.executor.core import Executor, ExecutorError
from megakernel.layers import kind
from reference.layers.common import shift_window, short_conv


def state_views(ex: Executor, d: dict, blk) -> dict[str, tuple[int, tuple[int, ...]]]:  # noqa: ANN001
    """name -> (offset, shape) of the layer's state block, from the record's 64-bit STATE and the
    kind's layout (conv window, state, ring entries)."""
    p, off, out = ex.prog, d["STATE"], {}
    for name, shape in kind(blk.kind).state(blk, ex.cfg, p.batch, p.buffers.ring_cap):
        out[name] = (off, shape)
        off += math.prod(shape)
    return out


def conv(ex: Executor, d: dict, blk, col0: int, segs: list[slice], taps: torch.Tensor,  # noqa: ANN001
         bias: torch.Tensor | None = None) -> list[torch.Tensor]:
    """silu(causal conv) of the T new inputs of sequence B_IDX on conv channels `segs`; channel c
    is proj column col0 + c. The window is read and shifted (written) once per channel."""
    p = ex.prog
    kd = kind(blk.kind)
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    win_off, win_shape = state_views(ex, d, blk)["conv"]
    width = kd.proj_width(blk.cfg)
    out = []
    for sg in segs:
        x = ex.read("f32", d["PROJ_OFF"], (p.rows, width), (rows, slice(col0 + sg.start,
                                                                        col0 + sg.stop)))
        win = ex.read("state", win_off, win_shape, (d["B_IDX"], sg), scratch=False)  # [c, K-1]
        pre = short_conv(win[None], x[None], taps[sg][:, None, :],
                         None if bias is None else bias[sg])[0]  # [T, c]
        ex.write("state", win_off, win_shape, (d["B_IDX"], sg), shift_window(win[None], x[None])[0])
        out.append(torch.nn.functional.silu(pre))
    return out


def proj_cols(ex: Executor, d: dict, blk, c0: int, width: int) -> torch.Tensor:  # noqa: ANN001
    """proj[rows of sequence B_IDX, c0 : c0 + width] (the block's own projection width)."""
    p = ex.prog
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    return ex.read("f32", d["PROJ_OFF"], (p.rows, kind(blk.kind).proj_width(blk.cfg)),
                   (rows, slice(c0, c0 + width)))


def ring_count(ex: Executor, d: dict, blk, unit: int) -> int:  # noqa: ANN001
    """Committed ring entries of (B_IDX, unit); ExecutorError when T more do not fit."""
    p = ex.prog
    shape = ex.prog.buffers.i32["ring_count"].shape[1:]
    n = int(ex.read("i32", d["COUNT_OFF"], shape, (d["B_IDX"], unit), scratch=False))
    if n + p.tokens > p.buffers.ring_cap:
        raise ExecutorError(f"{ex.cur_desc}: ring overflow, {n} + {p.tokens} entries > "
                            f"{p.buffers.ring_cap}")
    return n


def set_ring_count(ex: Executor, d: dict, unit: int, value: int) -> None:
    shape = ex.prog.buffers.i32["ring_count"].shape[1:]
    ex.write("i32", d["COUNT_OFF"], shape, (d["B_IDX"], slice(unit, unit + 1)),
             torch.tensor([value], dtype=torch.int32))


def folds(ex: Executor, n: int) -> bool:
    """Whether a step that starts with n committed entries folds the ring (n + T >= L)."""
    return n + ex.prog.tokens >= ex.prog.header["REPLAY_WINDOW"]
