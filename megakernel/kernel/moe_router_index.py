"""Index arithmetic and order rules of the MoE router's device handlers (kernel/moe_router.py),
no DSL: the kernel calls these on Int32, the host emulation (tests/kernel/
test_kernel_router_emulation.py) on ints and numpy floats.

ROUTER_SCORE (experts [E0, E0 + NE), all N rows), one CTA:
  s1. one warp per row n: rstd[n] = rsqrt(mean(h[n]^2) + eps) to shared memory;
  s2. one warp per task t < NE N, (e, n) = `score_task(t, N)`: lanes walk the columns
      c = lane + 32 j, x = bf16(h[n, c] rstd[n] w[c]), a warp sum of W_r[E0 + e, c] x, lane 0
      stores logits[n, E0 + e].
ROUTER (all rows), one CTA; choice(n, e) = sigmoid(logits[n, e]) + bias[e], recomputed where used:
  r1. one warp per row: per group g, a warp argmax over its experts (`better`: the larger, ties
      to the lower id), then over the others; the group score (their sum) goes to lane g
      (n_group <= 32);
  r2. topk_group rounds of a warp argmax over the lanes' group scores, the kept groups masked
      out: a bit mask of kept groups;
  r3. top_k rounds: round s takes the best choice among the kept groups' experts that come
      `after` round s - 1's pick in the order (choice descending, then id ascending), so that no
      per-expert mask is needed; its weight sigmoid(logit) is summed in pick order; then
      w = s_e / (sum + 1e-20) * scale (or s_e * scale), ids and weights stored in pick order;
  r4. after a barrier, one warp builds the work list: experts in chunks of 32 lanes; lane x
      counts its pairs m(x) over the N top_k ids; a ballot of m > 0 gives each routed expert its
      slot (`slot_of`: routed experts of earlier chunks plus those on lower lanes), the lane
      writes its row [x, m, its pairs p ascending, -1 ...]; the rows past the routed experts
      get [-1, 0, -1 ...].
"""

from __future__ import annotations

LANES = 32
NO_EXPERT = 0x7FFFFFFF  # an index above every expert id (argmax identity)


def score_task(t, rows: int):  # noqa: ANN001, ANN201 (int or Int32)
    """ROUTER_SCORE task t -> (expert within the record's block, row)."""
    e = t // rows
    return e, t - e * rows


def better(v, i, bv, bi):  # noqa: ANN001, ANN201
    """(v, i) beats the best so far (bv, bi): a larger value, equal values to the lower id."""
    return (v > bv) | ((v == bv) & (i < bi))


def after(v, i, pv, pi):  # noqa: ANN001, ANN201
    """(v, i) comes after the previous pick (pv, pi) in the pick order (value descending, then
    id ascending): candidates of the next top-k round."""
    return (v < pv) | ((v == pv) & (i > pi))


def group_of(e, per_group: int):  # noqa: ANN001, ANN201
    return e // per_group


def kept(mask, g):  # noqa: ANN001, ANN201
    """Group g is in the kept-groups bit mask."""
    return ((mask >> g) & 1) != 0


def work_at(w, c, rows: int):  # noqa: ANN001, ANN201
    """Word c of work-list row w ([W, 2 + N])."""
    return w * (2 + rows) + c


def slot_of(base, ballot, lane, popc):  # noqa: ANN001, ANN201
    """Work-list slot of the routed expert on `lane` of a chunk: `base` routed experts in the
    earlier chunks plus the routed ones on lower lanes (`ballot` bit l: lane l's expert is
    routed; `popc` counts bits)."""
    return base + popc(ballot & ((1 << lane) - 1))
