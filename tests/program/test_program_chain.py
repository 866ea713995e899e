"""The critical-path decomposition (program/chain.py, `plan --chain`): every stage is one phase,
running time and handoffs sum to the last phase's end, and each responds to its own cost term."""

from __future__ import annotations

import dataclasses

import pytest

from megakernel.cli.main import main as cli_main
from megakernel.models import preset
from megakernel.program.chain import by_opcode, critical_chain
from megakernel.program.compiler import compile_program
from megakernel.program.cost import CostParams
from megakernel.program.gpus import gpu


@pytest.fixture(scope="module")
def prog():  # noqa: ANN201
    return compile_program(preset("llama-tiny"), 1, gpu("h200"))


@pytest.mark.parametrize("model", ["llama-tiny", "kimi-linear-tiny"])
def test_phases_are_the_stages_and_sum_to_the_step(model: str) -> None:
    """Kimi Linear's phases overlap (the MoE router and experts run beside the shared expert):
    what an earlier phase covers is not counted twice."""
    prog = compile_program(preset(model), 1, gpu("h200"))
    chain = critical_chain(prog)
    stages = {i.stage for i in prog.instrs}
    assert sorted(p.stage for p in chain) == sorted(stages)
    for p in chain:  # SMs and instructions counted from the queues themselves
        on = [s for s, q in enumerate(prog.queues) for i in q if prog.instrs[i].stage == p.stage]
        assert (p.sms, p.instructions) == (len(set(on)), len(on))
        assert p.start <= p.end and 0 <= p.covered <= p.end - p.start + 1e-15
    last = max(p.end for p in chain)
    assert sum(p.covered + p.handoff for p in chain) == pytest.approx(last, rel=1e-12)
    p0 = CostParams()
    assert 0 < prog.cost.predicted_s - last <= p0.launch + 2 * p0.mem_latency
    ops = [r["op"] for r in by_opcode(chain)]
    assert ops[0] == "EMBED" and ops[-1] == "ARGMAX"


def test_each_cost_term_moves_its_own_column(prog) -> None:  # noqa: ANN001
    """A slower handoff (twice the memory latency) shows as handoffs; a slower instruction
    (twice the fixed cost) as running time, the handoffs unchanged."""
    base = critical_chain(prog)
    run = sum(p.covered for p in base)
    hand = sum(p.handoff for p in base)
    slow_mem = critical_chain(prog, dataclasses.replace(CostParams(),
                                                        mem_latency=2 * CostParams().mem_latency))
    assert sum(p.handoff for p in slow_mem) > 1.5 * hand
    fixed = CostParams().fixed_per_instr
    slow_fix = critical_chain(prog, dataclasses.replace(CostParams(), fixed_per_instr=2 * fixed))
    assert sum(p.handoff for p in slow_fix) == pytest.approx(hand, rel=1e-6)
    assert sum(p.covered for p in slow_fix) >= run + 0.9 * fixed * len(base)


def test_plan_prints_the_chain(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--model", "llama-tiny", "--chain"]) == 0
    out = capsys.readouterr().out
    assert "critical path" in out and "| OPROJ | 2 |" in out
    assert "us of handoffs" in out
