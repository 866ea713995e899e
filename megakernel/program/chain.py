"""A decode step's predicted critical path, as dependent phases and the handoffs between them.

A phase is one stage of the program (the instructions that signal one counter: a layer's QKV
slabs, its attention splits, ...). The replay's trace (replay.py, TRACE_FIELDS) gives, per
instruction, when its input became visible (wait_end) and when it finished (its signal issued);
a phase runs from its first instruction's wait_end to its last instruction's finish.

Walking the phases in order of their start, the step's time splits into the time some phase runs
(a phase's `covered` time: what of it does not overlap an earlier one) and the time none does
(the `handoff` before it: the producer's last signal landing, the consumer polling it, and for
the block after attention the split merge its last split runs after signalling). The two sum to
the end of the last phase, which is the predicted step less the launch. `plan --chain` prints
the table per opcode, averaged over the layers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megakernel import isa

US = 1e6


@dataclass(frozen=True)
class Phase:
    """One stage of the step on the predicted timeline (seconds from the launch)."""

    stage: int
    op: str  # the opcode of its instructions
    layer: int
    instructions: int
    sms: int  # distinct SMs its instructions run on
    weight_bytes: int  # streamed for it (weights, cached K/V, recurrent state)
    start: float  # the first instruction's input visible
    end: float  # the last instruction's signal issued
    covered: float  # of [start, end], what no earlier phase covers
    handoff: float  # before it, the time no phase runs


def phases(prog, trace: list[np.ndarray]) -> list[Phase]:  # noqa: ANN001 (compiler.Program)
    """The program's phases on a replay trace (replay(prog, trace=[])), in order of start."""
    by: dict[int, list[tuple[int, object, float, float]]] = defaultdict(list)
    for s, q in enumerate(prog.queues):
        for pos, i in enumerate(q):
            ins = prog.instrs[i]
            by[ins.stage].append((s, ins, float(trace[s][pos, 1]), float(trace[s][pos, 2])))
    rows = sorted(by.items(), key=lambda kv: min(r[2] for r in kv[1]))
    out, t = [], 0.0
    for stage, members in rows:
        start, end = min(r[2] for r in members), max(r[3] for r in members)
        ins = members[0][1]
        out.append(Phase(stage, isa.spec(ins.op).name, ins.layer, len(members),
                         len({r[0] for r in members}), sum(r[1].w_bytes for r in members),
                         start, end, max(0.0, end - max(start, t)), max(0.0, start - t)))
        t = max(t, end)
    return out


def critical_chain(prog, params=None) -> list[Phase]:  # noqa: ANN001
    """Replay `prog` (cost parameters `params`, default the cited ones) and return its phases."""
    from megakernel.program.replay import replay

    trace: list[np.ndarray] = []
    replay(prog, params, trace=trace)
    return phases(prog, trace)


def by_opcode(chain: list[Phase]) -> list[dict]:
    """Per opcode, in order of first appearance: phases, mean SMs, instructions and weight bytes,
    mean covered and handoff microseconds, and the total each contributes to the step."""
    groups: dict[str, list[Phase]] = {}
    for p in chain:
        groups.setdefault(p.op, []).append(p)
    return [{"op": op, "phases": len(ps), "sms": float(np.mean([p.sms for p in ps])),
             "instructions": float(np.mean([p.instructions for p in ps])),
             "weight_bytes": float(np.mean([p.weight_bytes for p in ps])),
             "covered_us": float(np.mean([p.covered for p in ps])) * US,
             "handoff_us": float(np.mean([p.handoff for p in ps])) * US,
             "total_us": sum(p.covered + p.handoff for p in ps) * US}
            for op, ps in groups.items()]


def table_markdown(chain: list[Phase]) -> str:
    """The per-opcode table `plan --chain` prints."""
    rows = ["| phase | count | mean SMs | mean instructions | mean bytes | running us | "
            "handoff before us | on the chain us |", "|---|---|---|---|---|---|---|---|"]
    for r in by_opcode(chain):
        rows.append(f"| {r['op']} | {r['phases']} | {r['sms']:.0f} | {r['instructions']:.0f} | "
                    f"{r['weight_bytes'] / 1e3:.0f} KB | {r['covered_us']:.2f} | "
                    f"{r['handoff_us']:.2f} | {r['total_us']:.1f} |")
    run = sum(p.covered for p in chain) * US
    hand = sum(p.handoff for p in chain) * US
    rows.append(f"\n{len(chain)} phases: {run:.1f} us running and {hand:.1f} us of handoffs, "
                f"{run + hand:.1f} us to the last phase's end")
    return "\n".join(rows)
