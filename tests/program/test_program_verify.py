"""The verifier: planted bugs in the encoded records of dense and hybrid programs are named."""

from __future__ import annotations

import pytest

from megakernel import isa
from megakernel.isa import Op
from megakernel.models import preset
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from megakernel.program.verify import ProgramError, check_program

TOY = gpu("h100").with_sms(8)


def _first(rec, op: int, layer: int | None = None) -> tuple[int, int]:  # noqa: ANN001
    hit = (rec[:, :, 0] == op)
    if layer is not None:
        hit &= rec[:, :, 5] == layer
    s, p = hit.nonzero()[0].tolist()
    return s, p


def test_verifier_catches_planted_bugs() -> None:
    prog = compile_program(preset("llama-tiny"), 2, TOY)
    # a dropped wait
    rec = prog.records().clone()
    s, p = _first(rec, Op.OPROJ, 1)
    rec[s, p, 1] = -1
    with pytest.raises(ProgramError, match="waits on None, its input is produced by 'L"):
        check_program(prog, rec)
    # a wait target one too high: deadlock
    rec = prog.records().clone()
    s, p = _first(rec, Op.GATEUP)
    rec[s, p, 2] += 1
    with pytest.raises(ProgramError, match="waits for"):
        check_program(prog, rec)
    # a slab moved onto its neighbour (its first row and its address): rows covered twice
    rec = prog.records().clone()
    s, p = (rec[:, :, 0] == Op.DOWN).nonzero()[-1].tolist()
    d = isa.decode(rec[s, p].tolist())
    rec[s, p] = _moved(d, 0)
    with pytest.raises(ProgramError, match="exactly once"):
        check_program(prog, rec)
    # only its first row moved: the record no longer points at the row it names
    rec = prog.records().clone()
    rec[s, p, 8] = 0
    with pytest.raises(ProgramError, match="is not row 0 of a packed matrix"):
        check_program(prog, rec)


def _moved(d: dict, row0: int):  # noqa: ANN202
    """The record `d` with its slab moved to start at row `row0` of the same matrix."""
    import torch

    ops = {k: v for k, v in d.items() if k not in isa.COMMON_FIELDS and k not in ("W_LO", "W_HI")}
    ops["W"] = d["W"] - (d["ROW0"] - row0) * d["K"]
    ops["ROW0"] = row0
    rec = isa.encode(d["OPCODE"], wait=(d["WAIT_CID"], d["WAIT_TARGET"], d["WAIT_TOTAL"]),
                     signal=d["SIGNAL_CID"], layer=d["LAYER"], **ops)
    return torch.tensor(rec, dtype=torch.int32)


def test_symbolic_run_reports_a_deadlock() -> None:
    prog = compile_program(preset("llama-tiny"), 1, TOY)
    rec = prog.records().clone()
    # swap the first two instructions of a queue that holds a QKV and a later OPROJ in order:
    # the OPROJ then waits, at the head of its queue, for attention that needs this SM's QKV
    for s in range(rec.shape[0]):
        ops = rec[s, :, 0].tolist()
        if Op.QKV in ops and Op.OPROJ in ops:
            i, j = ops.index(Op.QKV), ops.index(Op.OPROJ)
            rec[s, [i, j]] = rec[s, [j, i]]
            break
    with pytest.raises(ProgramError, match="deadlock"):
        check_program(prog, rec)


def test_hybrid_programs_are_checked_alike() -> None:
    prog = compile_program(preset("kimi-linear-tiny"), 2, TOY, replay_window=3)
    check_program(prog)
    # a core waiting on the previous block's counter instead of its projection
    rec = prog.records().clone()
    s, p = _first(rec, Op.KDA_REPLAY, 2)
    proj_cid = rec[s, p, 1].item()
    rec[s, p, 1] = proj_cid - 1
    with pytest.raises(ProgramError, match="its input is produced by 'L2.proj'"):
        check_program(prog, rec)
    # an expert slab dropped: its rows are not covered
    rec = prog.records().clone()
    s, p = _first(rec, Op.EXPERT_DOWN)
    rec[s, p:-1] = rec[s, p + 1 :].clone()
    with pytest.raises(ProgramError, match="exactly once|increments per step"):
        check_program(prog, rec)
    # a recurrent unit run twice
    rec = prog.records().clone()
    first_layer = (rec[:, :, 0] == Op.KDA_REPLAY) & (rec[:, :, 5] == 0)
    (s, p), (s2, p2) = first_layer.nonzero()[:2].tolist()
    rec[s2, p2, 6:8] = rec[s, p, 6:8]  # B_IDX, HEAD of the first one
    with pytest.raises(ProgramError, match="exactly once"):
        check_program(prog, rec)
    # a slab that points into the middle of a row
    rec = prog.records().clone()
    s, p = _first(rec, Op.PROJ)
    rec[s, p, 6] += 8
    with pytest.raises(ProgramError, match="is not row"):
        check_program(prog, rec)


def test_a_qkv_slab_across_kv_groups_is_refused() -> None:
    prog = compile_program(preset("llama-tiny"), 1, TOY)
    rec = prog.records().clone()
    s, p = _first(rec, Op.QKV)
    rec[s, p, 8] += 32  # ROW0 half a head further
    with pytest.raises(ProgramError, match="not whole heads|not row"):
        check_program(prog, rec)
