"""The verifier: planted bugs in the encoded records of dense and hybrid programs are named."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import pytest
import torch

from megakernel import isa
from megakernel.isa import Op
from megakernel.models import preset
from megakernel.program.compiler import Program, compile_program
from megakernel.program.gpus import gpu
from megakernel.program.verify import ProgramError, check_program

TOY = gpu("h100").with_sms(8)


@cache
def _program(name: str, batch: int, window: int | None = None) -> Program:
    return compile_program(preset(name), batch, TOY, replay_window=window)


def _first(rec: torch.Tensor, op: int, layer: int | None = None) -> tuple[int, int]:
    hit = rec[:, :, 0] == op
    if layer is not None:
        hit &= rec[:, :, 5] == layer
    s, p = hit.nonzero()[0].tolist()
    return s, p


def _moved(d: dict, row0: int) -> torch.Tensor:
    """The record `d` with its slab moved to start at row `row0` of the same matrix."""
    ops = {k: v for k, v in d.items() if k not in isa.COMMON_FIELDS and k not in ("W_LO", "W_HI")}
    ops["W"] = d["W"] - (d["ROW0"] - row0) * d["K"]
    ops["ROW0"] = row0
    rec = isa.encode(d["OPCODE"], wait=(d["WAIT_CID"], d["WAIT_TARGET"], d["WAIT_TOTAL"]),
                     signal=d["SIGNAL_CID"], layer=d["LAYER"], **ops)
    return torch.tensor(rec, dtype=torch.int32)


# ---- the planted bugs: each edits the records in place ------------------------------------------
def _drop_wait(rec: torch.Tensor) -> None:
    s, p = _first(rec, Op.OPROJ, 1)
    rec[s, p, 1] = isa.NO_COUNTER


def _target_too_high(rec: torch.Tensor) -> None:
    s, p = _first(rec, Op.GATEUP)
    rec[s, p, 2] += 1


def _last_down(rec: torch.Tensor) -> tuple[int, int]:
    s, p = (rec[:, :, 0] == Op.DOWN).nonzero()[-1].tolist()
    return s, p


def _slab_onto_neighbour(rec: torch.Tensor) -> None:
    """Its first row and its address moved: rows covered twice."""
    s, p = _last_down(rec)
    rec[s, p] = _moved(isa.decode(rec[s, p].tolist()), 0)


def _only_row0_moved(rec: torch.Tensor) -> None:
    """The record no longer points at the row it names."""
    s, p = _last_down(rec)
    rec[s, p, 8] = 0


def _swap_qkv_and_oproj(rec: torch.Tensor) -> None:
    """In a queue holding a QKV and a later OPROJ: the OPROJ then waits, at the head of its
    queue, for attention that needs this SM's QKV."""
    s = next(s for s in range(rec.shape[0])
             if Op.QKV in rec[s, :, 0].tolist() and Op.OPROJ in rec[s, :, 0].tolist())
    ops = rec[s, :, 0].tolist()
    i, j = ops.index(Op.QKV), ops.index(Op.OPROJ)
    rec[s, [i, j]] = rec[s, [j, i]]


def _qkv_across_kv_groups(rec: torch.Tensor) -> None:
    s, p = _first(rec, Op.QKV)
    rec[s, p, 8] += 32  # ROW0 half a head further


def _core_waits_on_previous_block(rec: torch.Tensor) -> None:
    s, p = _first(rec, Op.KDA_REPLAY, 2)
    rec[s, p, 1] -= 1


def _expert_slab_dropped(rec: torch.Tensor) -> None:
    s, p = _first(rec, Op.EXPERT_DOWN)
    rec[s, p:-1] = rec[s, p + 1 :].clone()


def _expert_slot_past_the_list(rec: torch.Tensor) -> None:
    s, p = _first(rec, Op.EXPERT_GATEUP)
    rec[s, p, isa.spec(Op.EXPERT_GATEUP).index("SLOT")] = 1 << 20


def _unit_run_twice(rec: torch.Tensor) -> None:
    first_layer = (rec[:, :, 0] == Op.KDA_REPLAY) & (rec[:, :, 5] == 0)
    (s, p), (s2, p2) = first_layer.nonzero()[:2].tolist()
    rec[s2, p2, 6:8] = rec[s, p, 6:8]  # B_IDX, HEAD of the first one


def _slab_mid_row(rec: torch.Tensor) -> None:
    s, p = _first(rec, Op.PROJ)
    rec[s, p, 6] += 8


KIMI = ("kimi-linear-tiny", 2, 3)
BUGS: dict[str, tuple[tuple, Callable[[torch.Tensor], None], str]] = {
    "dropped-wait": (("llama-tiny", 2), _drop_wait, "waits on None, its input is produced by 'L"),
    "target-too-high": (("llama-tiny", 2), _target_too_high, "waits for"),
    "slab-onto-neighbour": (("llama-tiny", 2), _slab_onto_neighbour, "exactly once"),
    "only-row0-moved": (("llama-tiny", 2), _only_row0_moved, "is not row 0 of a packed matrix"),
    "deadlock": (("llama-tiny", 1), _swap_qkv_and_oproj, "deadlock"),
    "qkv-across-groups": (("llama-tiny", 1), _qkv_across_kv_groups, "not whole heads|not row"),
    "core-waits-on-previous": (KIMI, _core_waits_on_previous_block,
                               "its input is produced by 'L2.proj'"),
    "expert-slab-dropped": (KIMI, _expert_slab_dropped, "exactly once|increments per step"),
    "recurrent-unit-twice": (KIMI, _unit_run_twice, "exactly once"),
    "expert-slot-past-the-list": (KIMI, _expert_slot_past_the_list, "outside the work list"),
    "slab-mid-row": (KIMI, _slab_mid_row, "is not row"),
}


@pytest.mark.parametrize("program", [("llama-tiny", 2), ("llama-tiny", 1), KIMI], ids=str)
def test_compiled_programs_pass(program: tuple) -> None:
    check_program(_program(*program))


@pytest.mark.parametrize("bug", BUGS)
def test_verifier_names_a_planted_bug(bug: str) -> None:
    program, plant, match = BUGS[bug]
    prog = _program(*program)
    rec = prog.records().clone()
    plant(rec)
    with pytest.raises(ProgramError, match=match):
        check_program(prog, rec)


@pytest.mark.parametrize("batch", [4, 16])
def test_work_list_reuse_flagged_without_the_loader_holding_its_readers(batch: int,
                                                                        monkeypatch) -> None:
    """One work list serves every MoE layer. With the kernel's rule (the consumers leave an
    expert record only once the loader has read its binding) the compiled kimi-linear-tiny
    program on 132 SMs passes; under the pre-fix kernel (consumers pass an unbound slot without
    the loader) the same program is flagged: an SM whose expert record has no tile-bearing record
    after it lets the next layer's router rewrite the list before its loader reads the binding."""
    import megakernel.program.verify as verify

    prog = compile_program(preset("kimi-linear-tiny"), batch, gpu("h200"))
    check_program(prog)
    monkeypatch.setattr(verify, "LOADER_HOLDS_READERS", False)
    with pytest.raises(ProgramError, match="may rewrite before the loader warp has read it"):
        check_program(prog)


def test_work_list_rule_has_no_false_alarm_when_every_slot_is_bound(monkeypatch) -> None:
    """At one row a step routes exactly top_k experts to its top_k slots: every expert record
    streams tiles, so the loader passes it before its consumers finish, under either rule."""
    import megakernel.program.verify as verify

    monkeypatch.setattr(verify, "LOADER_HOLDS_READERS", False)
    check_program(compile_program(preset("kimi-linear-tiny"), 1, gpu("h200")))


def test_binding_counter_must_be_the_routers() -> None:
    """The loader finds an expert record's binding counter from its WAIT_CID (gate/up: itself,
    down: the one before, kernel/moe_index.bind_counter): a program whose counters are numbered
    otherwise (the router's and the scores' swapped, every record renumbered alike, so its
    dataflow is intact) is refused by name."""
    import copy

    prog = _program(*KIMI)
    c_s = next(i for i, c in enumerate(prog.counters) if c.name == "L1.score")
    c_r = next(i for i, c in enumerate(prog.counters) if c.name == "L1.router")
    rec = prog.records().clone()
    for w in (1, 4):  # WAIT_CID, SIGNAL_CID
        col = rec[:, :, w].clone()
        rec[:, :, w] = torch.where(col == c_s, c_r, torch.where(col == c_r, c_s, col))
    swapped = copy.copy(prog)
    swapped.counters = list(prog.counters)
    swapped.counters[c_s], swapped.counters[c_r] = prog.counters[c_r], prog.counters[c_s]
    with pytest.raises(ProgramError, match="binding counter .* is not the layer's router"):
        check_program(swapped, rec)
