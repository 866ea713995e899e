"""Index arithmetic and order rules of the MoE router's device handlers
(kernel/device/moe_router.py), no DSL: the kernel calls these on Int32, the host emulation
(tests/kernel/ test_kernel_router_emulation.py) on ints and numpy floats.

A warp issues in order, so a loop that loads and then uses the value waits one L2 round trip per
iteration; the handlers issue their loads in batches into registers and then consume them.

ROUTER_SCORE (experts [E0, E0 + NE), all N rows), one CTA:
  s1. one warp per row n: rstd[n] = rsqrt(mean(h[n]^2) + eps) to shared memory; lanes walk the
      columns c = lane + 32 j in batches of BATCH (`batch_col`: the batch's BATCH loads in
      flight, a slot past K loading column `load_col` K - 1 and adding nothing), each lane
      summing its squares in increasing c (the unbatched walk's sum), then a warp sum;
  s2. one warp per task t < NE N, (e, n) = `score_task(t, N)`: the same batched walk of the
      columns, x = bf16(h[n, c] rstd[n] w[c]), each lane summing W_r[E0 + e, c] x in increasing
      c, a warp sum, lane 0 stores logits[n, E0 + e].
ROUTER (all rows), one CTA; choice(n, e) = sigmoid(logits[n, e]) + bias[e]:
  r0. one warp per row: lane l holds the row's choices and sigmoids of experts
      `expert_at(l, j)` = l + 32 j, j < `lane_experts(E)` (registers; every load in flight; past E
      padding, never a candidate); r1-r3 work on these registers only;
  r1. per group g, a warp argmax over its experts (`better`: the larger, ties to the lower id;
      a lane looks at its registers that `holds_group` g), then over the others; the group
      score (their sum) goes to lane g (n_group <= 32);
  r2. topk_group rounds of a warp argmax over the lanes' group scores, the kept groups masked
      out: a bit mask of kept groups;
  r3. top_k rounds: round s takes the best choice among the kept groups' experts that come
      `after` round s - 1's pick in the order (choice descending, then id ascending), so that no
      per-expert mask is needed; its weight sigmoid(logit) (shuffled from the lane holding it)
      is summed in pick order; then w = s_e / (sum + 1e-20) * scale (or s_e * scale), ids and
      weights stored in pick order;
  r4. after a barrier, one warp builds the work list; lane l counts in register c the pairs m
      of expert x = `expert_at(l, c)` (the experts in chunks of 32 lanes): the N top_k ids are
      read 32 at a time (lane l: pair p0 + l) and broadcast one by one (a shuffle); per c in
      increasing order, a ballot of m > 0 gives each routed expert its slot (`slot_of`: routed
      experts of earlier chunks plus those on lower lanes), the lane writes its row's x, m and
      -1 past its m pairs; a second walk of the ids (p ascending) writes each routed expert's
      pairs p; the rows past the routed experts get [-1, 0, -1 ...].
"""

from __future__ import annotations

LANES = 32
NO_EXPERT = 0x7FFFFFFF  # an index above every expert id (argmax identity)
BATCH = 16  # ROUTER_SCORE: a lane's column loads in flight at once


def score_task(t, rows: int):  # noqa: ANN001, ANN201 (int or Int32)
    """ROUTER_SCORE task t -> (expert within the record's block, row)."""
    e = t // rows
    return e, t - e * rows


def batch_col(c0, u: int):  # noqa: ANN001, ANN201
    """Column of slot u < BATCH of the batch that starts at a lane's column c0 (the batches
    start at lane, lane + 32 BATCH, ...)."""
    return c0 + LANES * u


def load_col(c, k, min_):  # noqa: ANN001, ANN201
    """The column a batch slot of column c loads: c, or K - 1 past K (loaded, never added: a
    0.0 in its place would let the compiler split the sum's fused multiply-adds)."""
    return min_(c, k - 1)


def lane_experts(num_experts: int) -> int:
    """Registers a lane holds a row's choices in: ceil(E / 32)."""
    return -(-num_experts // LANES)


def expert_at(lane, j: int):  # noqa: ANN001, ANN201
    """The expert in register j of `lane` (ROUTER r0, and r4's counts); >= E: padding."""
    return lane + LANES * j


def holds_group(g: int, j: int, per_group: int) -> bool:
    """Register j holds an expert of group g on some lane (ints: which registers r1 looks at)."""
    return LANES * j < (g + 1) * per_group and g * per_group < LANES * (j + 1)


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
