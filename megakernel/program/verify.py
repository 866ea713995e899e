"""Symbolic checks of an encoded program (no arithmetic, cheap enough for 8B models at B = 64).

`check_program(prog, records)` decodes the int32 records (by default `prog.records()`) and checks:
- coverage: every op of every layer appears exactly once per step (QKV head slots, attention
  (sequence, kv head, split) triples, o_proj/down/LM-head rows, gate/up rows, embedding rows);
- counters: each counter's per-step total equals the number of instructions that signal it (the
  merge counters: one per (sequence, kv head)); every wait's target equals its counter's total;
- dataflow: every instruction waits on the counter of the stage that produces its input (QKV of
  layer l on layer l-1's down_proj, attention on its kv group's QKV, ...), so a dropped or
  misdirected wait is reported by name;
- deadlock freedom: a symbolic run of the queues with counter counts reaches the end.
"""

from __future__ import annotations

from megakernel.program import isa
from megakernel.program.compiler import Program
from megakernel.program.isa import Op


class ProgramError(ValueError):
    """The program violates an invariant (named in the message)."""


def _decode_all(records) -> list[list[tuple[int, dict]]]:  # noqa: ANN001
    out = []
    for s, q in enumerate(records.tolist()):
        rows = []
        for pos, rec in enumerate(q):
            if rec[0] == Op.END:
                if any(any(r) for r in q[pos:]):
                    raise ProgramError(f"SM {s}: records after END at position {pos}")
                break
            try:
                rows.append((pos, isa.decode(rec)))
            except ValueError as e:
                raise ProgramError(f"SM {s} position {pos}: bad record {rec}: {e}") from None
        out.append(rows)
    return out


def expected_wait(prog: Program, d: dict) -> str | None:
    """Name of the counter an instruction must wait on (None: no wait)."""
    op, layer, L = d["OPCODE"], d["LAYER"], prog.cfg.num_layers
    if op == Op.EMBED:
        return None
    if op == Op.QKV:
        return "embed" if layer == 0 else f"L{layer - 1}.down"
    if op == Op.ATTN_PARTIAL:
        return f"L{layer}.qkv.g{d['KV_HEAD']}"
    if op == Op.OPROJ:
        return f"L{layer}.attn"
    if op == Op.GATEUP:
        return f"L{layer}.oproj"
    if op == Op.DOWN:
        return f"L{layer}.gateup"
    if op == Op.LMHEAD:
        return f"L{L - 1}.down"
    if op == Op.ARGMAX:
        return "lmhead"
    raise ProgramError(f"unexpected opcode {op!r}")


def check_program(prog: Program, records=None) -> None:  # noqa: ANN001
    recs = _decode_all(prog.records() if records is None else records)
    cfg = prog.cfg
    names = [c.name for c in prog.counters]
    totals = [c.total for c in prog.counters]
    L, H, inter, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    d_, hkv, slots = cfg.head_dim, cfg.num_kv_heads, cfg.group_size + 2
    B, N, S = prog.batch, prog.rows, prog.n_splits

    cover: dict[tuple, list[tuple[int, int]]] = {}
    signals = [0] * len(names)
    merges = [0] * len(names)

    def mark(key: tuple, lo: int, hi: int) -> None:
        cover.setdefault(key, []).append((lo, hi))

    for s, q in enumerate(recs):
        for pos, d in q:
            op = d["OPCODE"]
            where = f"SM {s} position {pos} {op.name} (layer {d['LAYER']})"
            want = expected_wait(prog, d)
            cid = d["WAIT_CID"]
            have = None if cid == isa.NO_COUNTER else names[cid] if 0 <= cid < len(names) else "?"
            if have != want:
                raise ProgramError(f"{where} waits on {have!r}, its input is produced by "
                                   f"{want!r}")
            if cid != isa.NO_COUNTER and not (d["WAIT_TARGET"] == d["WAIT_TOTAL"] == totals[cid]):
                raise ProgramError(
                    f"{where} waits for {d['WAIT_TARGET']}/{d['WAIT_TOTAL']} increments of "
                    f"{names[cid]!r}, which gets {totals[cid]} per step")
            if d["SIGNAL_CID"] != isa.NO_COUNTER:
                signals[d["SIGNAL_CID"]] += 1
            layer = d["LAYER"]
            if op == Op.EMBED:
                mark(("embed",), d["N0"], d["N1"])
            elif op == Op.QKV:
                if d["ROW0"] % d_ or d["NROWS"] % d_:
                    raise ProgramError(f"{where}: QKV slab is not whole heads")
                h0, h1 = d["ROW0"] // d_, (d["ROW0"] + d["NROWS"]) // d_
                if h0 // slots != (h1 - 1) // slots:
                    raise ProgramError(f"{where}: QKV slab crosses kv groups")
                mark(("qkv", layer), h0, h1)
            elif op == Op.ATTN_PARTIAL:
                u = (d["B_IDX"] * hkv + d["KV_HEAD"]) * S + d["SPLIT"]
                mark(("attn", layer), u, u + 1)
                if d["SPLIT"] == 0:
                    merges[d["DONE_CID"]] += 1
            elif op in (Op.OPROJ, Op.DOWN, Op.GATEUP, Op.LMHEAD):
                if d["NROWS"] % isa.ROW_ALIGN or d["ROW0"] % isa.ROW_ALIGN:
                    raise ProgramError(f"{where}: slab not aligned to {isa.ROW_ALIGN} rows")
                mark((op.name, layer), d["ROW0"], d["ROW0"] + d["NROWS"])
            elif op == Op.ARGMAX:
                mark(("argmax",), 0, 1)

    want_cover = {("embed",): N, ("argmax",): 1, ("LMHEAD", -1): V}
    for layer in range(L):
        want_cover.update({("qkv", layer): hkv * slots, ("attn", layer): B * hkv * S,
                           ("OPROJ", layer): H, ("GATEUP", layer): 2 * inter, ("DOWN", layer): H})
    extra = set(cover) - set(want_cover)
    if extra:
        raise ProgramError(f"instructions for units that should not exist: {sorted(extra)[:5]}")
    for key, n in want_cover.items():
        pos = 0
        for lo, hi in sorted(cover.get(key, [])):
            if lo != pos or hi <= lo:
                what = "missing" if lo > pos else "repeated"
                raise ProgramError(f"{key}: units not covered exactly once per step ({what} "
                                   f"units from {min(lo, pos)})")
            pos = hi
        if pos != n:
            raise ProgramError(f"{key}: units not covered exactly once per step (missing units "
                               f"{pos}..{n - 1})" if pos < n else f"{key}: units past {n}")
    for c, name in enumerate(names):
        got = signals[c] + merges[c]
        if got != totals[c]:
            raise ProgramError(f"counter {name!r} gets {got} increments per step, its waiters "
                               f"expect {totals[c]}")
    _check_deadlock(prog, recs, names, totals)


def _check_deadlock(prog: Program, recs, names, totals) -> None:  # noqa: ANN001
    """Symbolic run: an SM advances while its next wait is met; the last split merges."""
    seen = [0] * len(names)
    pcs = [0] * len(recs)
    waiting: dict[int, list[int]] = {}
    runnable = list(range(len(recs)))
    while runnable:
        s = runnable.pop()
        q = recs[s]
        while pcs[s] < len(q):
            d = q[pcs[s]][1]
            cid = d["WAIT_CID"]
            if cid != isa.NO_COUNTER and seen[cid] < d["WAIT_TARGET"]:
                waiting.setdefault(cid, []).append(s)
                break
            pcs[s] += 1
            for c in _increments(d, seen, totals):
                seen[c] += 1
                if seen[c] >= totals[c]:
                    runnable.extend(waiting.pop(c, []))
    stuck = [s for s in range(len(recs)) if pcs[s] < len(recs[s])]
    if stuck:
        lines = [f"SM {s} at position {pcs[s]} ({recs[s][pcs[s]][1]['OPCODE'].name}) waits on "
                 f"{names[recs[s][pcs[s]][1]['WAIT_CID']]!r} "
                 f"({seen[recs[s][pcs[s]][1]['WAIT_CID']]}/{recs[s][pcs[s]][1]['WAIT_TARGET']})"
                 for s in stuck[:8]]
        raise ProgramError("deadlock: " + "; ".join(lines))


def _increments(d: dict, seen: list[int], totals: list[int]) -> list[int]:
    out = []
    sig = d["SIGNAL_CID"]
    if sig != isa.NO_COUNTER:
        out.append(sig)
        if d["OPCODE"] == Op.ATTN_PARTIAL and seen[sig] + 1 == totals[sig]:
            out.append(d["DONE_CID"])  # this split is the last: it merges and signals
    return out
