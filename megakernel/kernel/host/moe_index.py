"""Index arithmetic of the MoE expert handlers (EXPERT_GATEUP, EXPERT_DOWN, MOE_COMBINE; device code
in kernel/device/moe.py and kernel/device/matvec.py), no DSL: the device code calls it on Int32, the
emulation (tests/kernel/test_kernel_moe_emulation.py) on int.

Binding (layers/moe.py): an expert record names a work-list SLOT; row SLOT of the work list int32
[W, 2 + N] is [x, m, p_0 .. p_{m-1}, -1 ...]. The record's slab moves to expert x's matrix
(W + x * MOE_X_STRIDE) and its activation rows are the m pairs p = n top_k + s; x = -1 (a slot
past the routed experts) has m = 0: no rows, no passes, no tiles. SLOT = -1 is the shared expert:
its own W and every row n, with s = top_k.

Binding counter: a slot's row is the layer's ROUTER's, so the loader (and its L2 lookahead) reads
it once the router's counter is met, not the record's own dependency (`bind_counter`): a gate/up
record waits on the router's counter itself, a down record on the layer's gate/up counter, which
the compiler numbers right after the router's (layers/moe.py, checked by the verifier). The
router's counter gets ROUTER_SIGNALS increments per step. The shared expert's binding is static:
no wait.

Tiles: a bound slab is streamed once per pass of NO pair rows, ceil(live / NO) passes (`passes`),
in the matvec tile order (spec.matvec_tiles), by the loader and the consumers alike.

Rows: pair row i of a pass is activation row n (the gate/up input RMSNorm(h[n])) and expert slot
row q = n slots + s of act_moe [N, slots, I_e] and moe_y [N, slots, H] (the down input and both
outputs).

Combine: the top_k slots of a row are added in increasing expert id (a selection walk: the next
slot is the one with the least id above the previous, `takes`), then the shared expert.
"""

from __future__ import annotations

from megakernel.kernel.host.arena import matrix_span

SHARED = -1  # the SLOT of the shared expert's records (layers/moe.SHARED)
ROUTER_SIGNALS = 1  # increments of a layer's router counter per step (its one ROUTER record)
NO_EXPERT = 1 << 30  # above every expert id
WALK_START = (-1, NO_EXPERT)  # the selection walk's (previous id, best) before each step


def x_stride(inter: int, hidden: int, quant=None) -> int:  # noqa: ANN001 (Fp8Format | None)
    """MOE_X_STRIDE: elements from expert x's packed gate/up [2 I, H] + down [H, I] to expert
    x + 1's, each from an aligned start, an FP8 model's with its scale block before it: the
    packed layout's own span (arena.matrix_span; layers/moe.expert_stride)."""
    return matrix_span((2 * inter, hidden), quant) + matrix_span((hidden, inter), quant)


def bind_counter(down, wait_cid):  # noqa: ANN001, ANN201 (int or Int32)
    """The layer's router counter, after which a routed slot's binding is readable, from an
    expert record's WAIT_CID: itself for gate/up (down = 0), WAIT_CID - 1 for down (down = 1).
    The shared expert (SLOT = -1) needs no wait."""
    return wait_cid - down


def work_row(slot, rows: int):
    """Element offset of work-list row `slot` ([W, 2 + N] int32)."""
    return slot * (2 + rows)


def bound_w(w, x, stride: int, maximum=max):
    """The slab of expert x (x = -1, unbound: W itself, nothing is read from it)."""
    return w + maximum(x, 0) * stride


def passes(live, no: int):
    """Passes of NO pair rows over `live` rows (0 rows: 0 passes, nothing streamed)."""
    return (live + no - 1) // no


def pair_rows(p, top_k: int, slots: int):
    """Pair p = n top_k + s -> (activation row n, expert slot row q = n slots + s)."""
    n = p // top_k
    return n, n * slots + (p - n * top_k)


def shared_rows(i, top_k: int, slots: int):
    """The shared expert's pair row i -> (n = i, q = i slots + top_k)."""
    return i, i * slots + top_k


def takes(cand, prev, best):
    """Selection walk of the combine: expert id `cand` beats the best so far (`best`) as the next
    one above `prev` (ids of a row are distinct)."""
    return (cand > prev) & (cand < best)


def combine_order(ids) -> list[int]:  # noqa: ANN001 (a row's top_k expert ids)
    """Host mirror of the combine's walk: the top_k slots in increasing expert id."""
    out, prev = [], WALK_START[0]
    for _ in range(len(ids)):
        best, pick = WALK_START[1], 0
        for s, x in enumerate(ids):
            if takes(int(x), prev, best):
                best, pick = int(x), s
        out.append(pick)
        prev = best
    return out


def binding(slot: int, work, w: int, stride: int, rows: int) -> tuple[int, list[int]]:  # noqa: ANN001
    """Host mirror of the device binding (moe.Experts.bind): (bound W, the record's pair rows as
    (n, q) would be given by `row`); `work` the work list [W, 2 + N] (any int indexable)."""
    if slot == SHARED:
        return w, list(range(rows))
    x, m = int(work[slot][0]), int(work[slot][1])
    return bound_w(w, x, stride), [int(p) for p in work[slot][2 : 2 + (m if x >= 0 else 0)]]
