"""Symbolic checks of an encoded program (no arithmetic, cheap enough for 8B models at B = 64),
for every family: it reads the records, the weight layout and the layer kinds' declarations, not
the compiler's stages.

`check_program(prog, records)` decodes the int32 records (by default `prog.records()`) and checks:
- records: every opcode known, nothing after END, each record's own invariants (layer kinds
  `check_record`: e.g. a QKV slab is whole heads of one kv group);
- coverage: every packed matrix's rows are streamed exactly once per step by the slab records
  that point into it (the LM head's padded rows included), or as often as the kind's
  `slab_passes` says (records bound at run time: a routed expert's work slots), every embedding row
  gathered once, and every work unit of the other opcodes (layer kinds `coverage` / `cover`: an
  attention (sequence, kv head, split), a recurrent (sequence, unit)...) run once;
- counters: each counter's per-step total equals the number of instructions that signal it (and
  one per ticket counter for a ticket opcode's DONE_CID); every wait's target equals its total;
- dataflow: every instruction waits on a counter signalled only by its input's producers: a
  block's first opcodes on the previous block's last opcode (EMBED before the first block), the
  others on the opcode the kind's `flow` names in the same block, the LM head on the last block,
  ARGMAX on the LM head; so a dropped or misdirected wait is reported by name;
- deadlock freedom: a symbolic run of the queues with counter counts reaches the end;
- run-time bindings (layer kinds `binding`: the MoE's work list, one region for every layer):
  every record that rewrites a binding region waits, through the counters and queue order, for
  every record that reads the previous contents, and on each reader's SM for a record at or after
  it that the loader warp must have passed, so that the loader's late read of a binding cannot
  follow the rewrite. With the kernel's rule (LOADER_HOLDS_READERS, kernel/device/pipeline.py: the
  consumers leave a reader only once the loader has read its binding) the reader itself; without
  it, a later record that always streams tiles (a reader that may find nothing bound has none).
"""

from __future__ import annotations

import bisect
import functools
import heapq

from megakernel import isa
from megakernel.isa.stages import ProgramError
from megakernel.layers import kind

# the consumers leave a record that reads a run-time binding only once the loader warp has read it
# (kernel/device/pipeline.py Pipeline.wait_bound); the binding rule relies on it
LOADER_HOLDS_READERS = True


def _decode_all(records) -> list[list[tuple[int, dict]]]:  # noqa: ANN001
    out = []
    for s, q in enumerate(records.tolist()):
        rows = []
        for pos, rec in enumerate(q):
            if rec[0] == isa.Op.END:
                if any(any(r) for r in q[pos:]):
                    raise ProgramError(f"SM {s}: records after END at position {pos}")
                break
            try:
                rows.append((pos, isa.decode(rec)))
            except (ValueError, KeyError) as e:
                raise ProgramError(f"SM {s} position {pos}: bad record {rec}: {e}") from None
        out.append(rows)
    return out


class _Blocks:
    """Which block a record belongs to: (layer, opcode name) -> block index."""

    def __init__(self, cfg) -> None:  # noqa: ANN001
        self.blocks = list(cfg.blocks)
        self.of: dict[tuple[int, str], int] = {}
        for i, blk in enumerate(self.blocks):
            for name in (*kind(blk.kind).flow, *kind(blk.kind).after):
                key = (blk.layer, name)
                if key in self.of:
                    raise ProgramError(f"layer {blk.layer}: two blocks run {name}; the verifier "
                                       "cannot tell their records apart")
                self.of[key] = i

    def index(self, d: dict) -> int:
        key = (d["LAYER"], d["OPCODE"].name)
        if key not in self.of:
            raise ProgramError(f"{d['OPCODE'].name} record of layer {d['LAYER']}: no block of "
                               "that layer runs this opcode")
        return self.of[key]


def check_program(prog, records=None) -> None:  # noqa: ANN001 (compiler.Program)
    recs = _decode_all(prog.records() if records is None else records)
    cfg, names = prog.cfg, [c.name for c in prog.counters]
    totals = [c.total for c in prog.counters]
    blocks = _Blocks(cfg)
    # ---- who signals what: (opcode name, block index or -1) per counter
    signallers: list[set[tuple[str, int]]] = [set() for _ in names]
    signals, merges = [0] * len(names), [0] * len(names)
    tickets: dict[int, int] = {}
    owner: dict[int, int] = {}  # record id -> block index
    for q in recs:
        for _, d in q:
            spec = isa.spec(d["OPCODE"])
            b = -1 if d["LAYER"] < 0 else blocks.index(d)
            owner[id(d)] = b
            sig = d["SIGNAL_CID"]
            if sig == isa.NO_COUNTER:
                continue
            if not 0 <= sig < len(names):
                raise ProgramError(f"{spec.name} signals unknown counter {sig}")
            signals[sig] += 1
            if spec.ticket:
                tickets[sig] = d["DONE_CID"]
                signallers[d["DONE_CID"]].add((spec.name, b))
            else:
                signallers[sig].add((spec.name, b))
    for done in tickets.values():
        merges[done] += 1
    for c, name in enumerate(names):
        if signals[c] + merges[c] != totals[c]:
            raise ProgramError(f"counter {name!r} gets {signals[c] + merges[c]} increments per "
                               f"step, its waiters expect {totals[c]}")

    @functools.cache
    def producers_of(op: str, b: int) -> frozenset[tuple[str, int]]:
        """(opcode name, block index) pairs whose signals an `op` record of block b may wait on."""
        return frozenset(_producers(op, b))

    def producers(d: dict) -> frozenset[tuple[str, int]]:
        return producers_of(d["OPCODE"].name, owner[id(d)])

    def _producers(op: str, b: int) -> set[tuple[str, int]]:
        if op == "LMHEAD":
            last = len(blocks.blocks) - 1
            return {(kind(blocks.blocks[last].kind).out_op, last)}
        s = isa.spec(getattr(isa.Op, op))
        if s.step:  # a frame opcode: what it declares it waits on (the embedding: nothing)
            return {(s.waits_on, -1)} if s.waits_on else set()
        kd = kind(blocks.blocks[b].kind)
        if op in kd.after:  # waits on the end of a step of this sort
            return {(isa.step_end(kd.after[op]).name, -1)}
        flow = kd.flow[op]
        if flow is None:
            if b == 0:
                return {(isa.step_start().name, -1)}
            return {(kind(blocks.blocks[b - 1].kind).out_op, b - 1)}
        return {(p, b) for p in ((flow,) if isinstance(flow, str) else flow)}

    def counter_name(prod: frozenset[tuple[str, int]]) -> str | None:
        hits = [names[c] for c in range(len(names)) if signallers[c] and signallers[c] <= prod]
        return hits[0] if len(hits) == 1 else (" or ".join(hits) or None)

    # ---- per record: dataflow, invariants, coverage
    cover: dict[tuple, list[tuple[int, int]]] = {}
    extent = {"rows": prog.rows, "batch": prog.batch, "one": 1}
    want_cover: dict[tuple, int] = {
        (isa.spec(op).name,): extent[isa.spec(op).covers[0]]
        for op in isa.step_ops(prog.drafts, prog.ngram) if isa.spec(op).covers}
    times: dict[tuple, int] = {}  # covers per step, when not one
    for i, blk in enumerate(blocks.blocks):
        for op, units in kind(blk.kind).coverage(blk, prog).items():
            want_cover[(op, i)] = units
    entries = _slab_entries(prog)
    starts = [e[1] for e in entries]
    for s, q in enumerate(recs):
        for pos, d in q:
            spec, b = isa.spec(d["OPCODE"]), owner[id(d)]
            where = f"SM {s} position {pos} {spec.name} (layer {d['LAYER']})"
            cid = d["WAIT_CID"]
            prod = producers(d)
            if cid == isa.NO_COUNTER:
                if prod:
                    raise ProgramError(f"{where} waits on None, its input is produced by "
                                       f"{counter_name(prod)!r}")
            elif not 0 <= cid < len(names) or not signallers[cid] or \
                    not signallers[cid] <= prod:
                have = names[cid] if 0 <= cid < len(names) else "?"
                raise ProgramError(f"{where} waits on {have!r}, its input is produced by "
                                   f"{counter_name(prod)!r}")
            elif not d["WAIT_TARGET"] == d["WAIT_TOTAL"] == totals[cid]:
                raise ProgramError(f"{where} waits for {d['WAIT_TARGET']}/{d['WAIT_TOTAL']} "
                                   f"increments of {names[cid]!r}, which gets {totals[cid]} per "
                                   "step")
            if b >= 0:
                kind(blocks.blocks[b].kind).check_record(d, blocks.blocks[b], prog, where)
            if spec.slab:
                if d["NROWS"] % isa.ROW_ALIGN or d["ROW0"] % isa.ROW_ALIGN:
                    raise ProgramError(f"{where}: slab not aligned to {isa.ROW_ALIGN} rows")
                j = bisect.bisect_right(starts, d["W"]) - 1
                key, _, _, k, _ = entries[j] if j >= 0 else (None, 0, 0, 0, 1)
                if key is None or d["K"] != k or prog.layout[key].w(d["ROW0"]) != d["W"]:
                    raise ProgramError(f"{where}: slab at element {d['W']} is not row {d['ROW0']} "
                                       "of a packed matrix")
                cover.setdefault((key,), []).append((d["ROW0"], d["ROW0"] + d["NROWS"]))
            elif spec.covers:  # a frame opcode (layers/frame.py, layers/speculative.py)
                ext, lo, hi = spec.covers
                cover.setdefault((spec.name,), []).append(
                    (0, 1) if ext == "one" else (d[lo], d[hi]))
            else:
                lo, hi = kind(blocks.blocks[b].kind).cover(d, blocks.blocks[b], prog)
                cover.setdefault((spec.name, b), []).append((lo, hi))
    for key, _, rows, _, t in entries:
        if t:
            want_cover[(key,)] = rows
            times[(key,)] = t
    extra = set(cover) - set(want_cover)
    if extra:
        raise ProgramError(f"instructions for units that should not exist: {sorted(extra)[:5]}")
    for key, n in want_cover.items():
        _check_cover(key, sorted(cover.get(key, [])), n, times.get(key, 1))
    _check_deadlock(recs, names, totals)
    _check_bindings(recs, owner, blocks, prog)


def _check_bindings(recs, owner: dict, blocks: _Blocks, prog,  # noqa: ANN001
                    holds: bool | None = None) -> None:
    """The run-time binding rule (module docstring); `holds`: LOADER_HOLDS_READERS unless
    given."""
    holds = LOADER_HOLDS_READERS if holds is None else holds
    uses: dict[int, list[tuple[int, int, int, bool, bool]]] = {}  # region -> (layer, s, i, ...)
    for s, q in enumerate(recs):
        for i, (_, d) in enumerate(q):
            b = owner[id(d)]
            if b < 0:
                continue
            blk = blocks.blocks[b]
            got = kind(blk.kind).binding(d, blk, prog)
            if got is not None:
                region, writes, may_skip = got
                uses.setdefault(region, []).append((d["LAYER"], s, i, writes, may_skip))
    if not uses:
        return
    sig_at: dict[int, list[tuple[int, int]]] = {}  # counter -> (SM, index) of its signallers
    for s, q in enumerate(recs):
        for i, (_, d) in enumerate(q):
            c = d["SIGNAL_CID"]
            if c != isa.NO_COUNTER:
                sig_at.setdefault(c, []).append((s, i))
                if isa.spec(d["OPCODE"]).ticket:  # its last signaller merges, signals DONE_CID
                    sig_at.setdefault(d["DONE_CID"], []).append((s, i))
    for region, recs_of in uses.items():
        writers = sorted((u for u in recs_of if u[3]), key=lambda u: u[0])
        for prev, w in zip(writers, writers[1:], strict=False):
            done = _before(recs, sig_at, w[1], w[2])
            for layer, s, i, writes, may_skip in recs_of:
                if writes or not prev[0] <= layer < w[0]:
                    continue
                q = recs[s]
                last = done[s]  # the reader's SM has finished records [0, last] when w runs
                ok = last >= i if holds else any(
                    isa.spec(q[k][1]["OPCODE"]).slab and not _skips(q[k][1], owner, blocks, prog)
                    for k in range(i + (0 if not may_skip else 1), last + 1))
                if not ok:
                    d, wd = q[i][1], recs[w[1]][w[2]][1]
                    raise ProgramError(
                        f"SM {s} position {q[i][0]} {d['OPCODE'].name} (layer {layer}) reads a "
                        f"binding at {region} that SM {w[1]} position {recs[w[1]][w[2]][0]} "
                        f"{wd['OPCODE'].name} (layer {w[0]}) may rewrite before the loader warp "
                        "has read it")


def _skips(d: dict, owner: dict, blocks: _Blocks, prog) -> bool:  # noqa: ANN001
    """A record that may stream no tiles: a binding reader that may find nothing bound."""
    b = owner[id(d)]
    if b < 0:
        return False
    blk = blocks.blocks[b]
    got = kind(blk.kind).binding(d, blk, prog)
    return got is not None and got[2]


def _before(recs, sig_at: dict, s0: int, i0: int) -> list[int]:  # noqa: ANN001
    """Per SM, the last queue index every run must have finished before record i0 of SM s0
    starts (-1: none): its queue predecessors and, through the counters they and it wait on,
    their signallers and those signallers' predecessors, to a fixed point."""
    done = [-1] * len(recs)
    todo = [(s0, i0 - 1)]
    waits = [(s0, i0)]
    while todo or waits:
        while waits:
            s, i = waits.pop()
            c = recs[s][i][1]["WAIT_CID"]
            if c != isa.NO_COUNTER:
                todo += sig_at.get(c, [])
        s, i = todo.pop() if todo else (0, -1)
        if i > done[s]:
            waits += [(s, k) for k in range(done[s] + 1, i + 1)]
            done[s] = i
    return done


def _check_cover(key: tuple, spans: list[tuple[int, int]], n: int, times: int) -> None:
    """Sorted spans [lo, hi) cover [0, n) exactly `times` times (a span starts where one of the
    `times` layers ends)."""
    ends = [0] * times  # a heap of where the layers of the cover have reached
    what = "once" if times == 1 else f"{times} times"
    for lo, hi in spans:
        if lo != ends[0] or hi <= lo:  # the layer that reached least must go on here
            why = "missing" if lo > ends[0] else "repeated"
            raise ProgramError(f"{key}: units not covered exactly {what} per step ({why} "
                               f"units from {min(lo, ends[0])})")
        heapq.heapreplace(ends, hi)
    for pos in ends:
        if pos != n:
            raise ProgramError(f"{key}: units not covered exactly {what} per step (missing units "
                               f"{pos}..{n - 1})" if pos < n else f"{key}: units past {n}")


def _slab_entries(prog) -> list[tuple[str, int, int, int, int]]:  # noqa: ANN001
    """(key, offset, rows, K, covers per step) of every packed matrix the slab records point
    into, by offset."""
    cfg, lay = prog.cfg, prog.layout
    keys = [("lm_head" if "lm_head" in lay else "embed", 1)]
    for blk in cfg.blocks:
        passes = kind(blk.kind).slab_passes(blk, prog)
        for item in kind(blk.kind).matrices(blk, cfg):
            if not (len(item) > 2 and item[2]):  # an entry that follows its matrix (a bias)
                keys.append((f"{blk.key}.{item[0]}", passes.get(item[0], 1)))
    out = [(k, lay[k].offset, lay[k].shape[0], lay[k].shape[1], t) for k, t in keys]
    return sorted(out, key=lambda e: e[1])


def _check_deadlock(recs, names, totals) -> None:  # noqa: ANN001
    """Symbolic run: an SM advances while its next wait is met; a ticket's last signaller merges."""
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
        lines = []
        for s in stuck[:8]:
            d = recs[s][pcs[s]][1]
            lines.append(f"SM {s} at position {pcs[s]} ({d['OPCODE'].name}) waits on "
                         f"{names[d['WAIT_CID']]!r} ({seen[d['WAIT_CID']]}/{d['WAIT_TARGET']})")
        raise ProgramError("deadlock: " + "; ".join(lines))


def _increments(d: dict, seen: list[int], totals: list[int]) -> list[int]:
    out = []
    sig = d["SIGNAL_CID"]
    if sig != isa.NO_COUNTER:
        out.append(sig)
        if isa.spec(d["OPCODE"]).ticket and seen[sig] + 1 == totals[sig]:
            out.append(d["DONE_CID"])  # this signaller is the last: it merges and signals
    return out
