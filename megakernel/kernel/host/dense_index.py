"""Index arithmetic of the dense handlers (the GEMV and its mma form, the QKV epilogue, split-KV
attention, the weight ring), no DSL: plain functions the device code calls on Int32/Int64 (with
`minimum`/`maximum` = cutlass.min/max) and the host emulations on ints
(tests/kernel/test_kernel_index_emulation.py runs them against plain matrix products).
"""

from __future__ import annotations

from megakernel.kernel.host.limits import LANES, MMA_K_ALIGN, MMA_M, MMA_N, NUM_THREADS


def mma_operand_word(row, step, t, row_words):
    """32-bit word (bf16 pair) offset of the 16 bytes lane (g, t) loads for K-step `step` (32
    inputs) of operand row `row` (A: an activation row g or g + 8 of a 16-row block; B: weight row
    g of the tile), rows `row_words` words apart: words [4t, 4t + 4) of the step (matvec.mma_tile).
    Plain arithmetic: the kernel calls it on Int32, the host emulation on int."""
    return row * row_words + step * (MMA_K_ALIGN // 2) + t * 4


def mma_c_coord(g, t, c: int):
    """(row, column) of a 16x8 mma block held in accumulator register c (0..3) of lane (g, t):
    the PTX ISA's fragment layout of C/D for m16n8k16 with fp32 accumulators."""
    return g + 8 * (c // 2), 2 * t + c % 2


def mma_red_index(buf, warp, m, n, num_warps: int, no: int):
    """Element of sRed [2][NW][NO][MMA_N] holding warp `warp`'s partial for activation row m,
    tile row n, partial buffer `buf`."""
    return ((buf * num_warps + warp) * no + m) * MMA_N + n


def qkv_bias_index(w, row0, k, qkv_rows: int, row):
    """Arena element of the bias of packed QKV row `row0 + row`, for a QKV record whose slab
    starts at element `w` with first row `row0` and rows of `k`: the bias [QKV_ROWS] directly
    follows the layer's packed QKV matrix [QKV_ROWS, K], in the same row order. Plain arithmetic:
    the kernel calls it on Int64, the host emulation on int."""
    return w - row0 * k + qkv_rows * k + row0 + row


def qkv_slot(slot, group: int, gated: bool):
    """(kv group, index j in it) of packed QKV head slot `slot`: per group G q heads (j < G),
    with an output gate their G gate heads (G <= j < 2G), then k, then v."""
    per = group * (2 if gated else 1) + 2
    grp = slot // per
    return grp, slot - grp * per


def gate_index(n, head, d, heads: int, head_dim: int):
    """Element of the fp32 gate [N, Hq, D] (header F32_GATE_OFF) of row n, q head `head`, dim
    d: where the QKV epilogue stores a gate head and the attention merge reads it."""
    return (n * heads + head) * head_dim + d


def rope_pair(d, half: int, minimum=min, maximum=max):
    """Rotate-half partner of head dim d < R = 2 * half: (partner dim, table column, upper),
    upper 1 for d >= half (x_d c + x_p s) and 0 below (x_d c - x_p s), the cos/sin column
    d mod half. Plain arithmetic: Int32 in the kernel, int (or numpy) in the tests."""
    upper = minimum(maximum(d - half + 1, 0), 1)
    col = d - half * upper
    return col + half * (1 - upper), col, upper


def lm_row_live(row, vocab: int):
    """Packed LM-head row `row` holds a vocabulary entry: rows >= V are the ROW_ALIGN padding
    (zero rows), which store no logit and never take part in the argmax (a 0 would win when
    every real logit is negative). Plain arithmetic: Int32 in the kernel, int in the tests."""
    return row < vocab


def row_major(row, col, stride):
    """Element (row, col) of a row-major matrix whose rows are `stride` elements apart: a slab
    [NROWS, K] in the weight arena, a ring stage [rows][kc], staged activations sX [NO][XS]."""
    return row * stride + col


def tile_copy(r, row0, col0, kc, k):
    """(stage element, slab element) of row r of the ring tile holding rows row0.. and columns
    [col0, col0 + kc) of a row-major [NROWS, K] slab: the stage holds the tile as [rows][kc];
    the loader copies row by row when kc < K (a K-chunk), else the whole tile at r = 0."""
    return row_major(r, 0, kc), row_major(row0 + r, col0, k)


def k_slice(nv, ksplit, ks, minimum=min):
    """16-byte vectors [vb, ve) of K-slice ks when a K-chunk of `nv` vectors is cut into
    `ksplit` contiguous slices, one warp each (the last slices may be short or empty)."""
    vper = (nv + ksplit - 1) // ksplit
    vb = ks * vper
    return vb, minimum(nv, vb + vper)


def tile_warp(warp, ksplit):
    """(tile row, K-slice) of a consumer warp in the pipelined FMA GEMV: ksplit = NW / tile
    rows warps share each row of a ring tile (matvec.gemv_tile)."""
    r = warp // ksplit
    return r, warp - r * ksplit


def chunk_ksplit(ng, num_warps: int, maximum=max):
    """K-slices of the global-memory FMA GEMV for a row chunk of `ng` row groups: the warps
    split K when there are fewer groups than warps (matvec.gemv)."""
    return maximum(1, num_warps // ng)


def acc_index(ks, n, row, no: int, nrp):
    """Element of sAcc [ksplit][NO][nrp] holding K-slice ks's partial of (activation row n,
    row `row` of the row chunk); the epilogues add the slices in order (matvec.acc_value)."""
    return (ks * no + n) * nrp + row


def attn_scale(head_dim: int) -> float:
    """The softmax scale of attention scores: 1 / sqrt(head_dim) of q and k."""
    return head_dim ** -0.5


def attn_query(qi, g, b, group: int, tokens: int):
    """(token t, q head, activation row n) of query qi = t * G + j of ATTN_PARTIAL (sequence b,
    kv head g): q head g * G + j reads kv head g (GQA, q heads grouped by kv head)."""
    t = qi // group
    return t, g * group + qi - t * group, b * tokens + t


def attn_warp(warp, wq: int):
    """(first query, share) of a warp when WQ warps share each query's keys; the warp then
    takes queries first, first + NW / WQ, ..."""
    q = warp // wq
    return q, warp - q * wq


def attn_keys(s, n_splits, length, t, part, wq: int, tokens: int, minimum=min, maximum=max):
    """Keys [kb, ke) of token t's query that share `part` of WQ reads in split s of n_splits:
    the split's range of the ctx = length + T positions, cut at the query's causal limit
    length + t + 1, then into WQ contiguous shares."""
    ctx = length + tokens
    lo = s * ctx // n_splits
    hi = (s + 1) * ctx // n_splits
    nk = maximum(minimum(hi, length + t + 1) - lo, 0)
    return lo + part * nk // wq, lo + (part + 1) * nk // wq


# bf16 values of V rows one lane holds in flight in Attention.attend (32 registers)
ATTN_VALUES_IN_FLIGHT = 64
# bytes of K (and as many of V) a warp has requested into L2 ahead of the chunk it reads
ATTN_KV_LEAD_BYTES = 8 * 1024


# value rows in flight in the paged build, whose every row address is a page lookup (64-bit)
ATTN_PAGED_VALUE_BATCH = 8


def attn_value_batch(head_dim: int, tight: bool = False) -> int:
    """Value rows whose loads a lane issues before using any (Attention.attend): the whole chunk
    of 32 keys at D = 64, 16 at D = 128, 8 at D = 256; at most 8 in the builds with fewer
    registers to spare (`tight`: the paged build, whose row addresses take registers of their
    own, and the global-memory weight build, whose GEMV holds its weights in registers). The
    first batch is issued with the chunk's key loads, before the scores (it does not depend on
    them)."""
    vb = min(LANES, ATTN_VALUES_IN_FLIGHT // (head_dim // LANES))
    return min(vb, ATTN_PAGED_VALUE_BATCH) if tight else vb


def attn_kv_lead(head_dim: int) -> int:
    """Keys a warp's L2 prefetch runs ahead of the chunk it reads (a multiple of 32): before
    the wait each warp's share has its first lead keys requested (Attention.prefetch_kv), then
    each chunk requests the chunk `lead` keys on, so that at most ATTN_KV_LEAD_BYTES of K and of
    V per warp share sit in L2 ahead of use, whatever the context."""
    return max(LANES, ATTN_KV_LEAD_BYTES // (head_dim * 2) // LANES * LANES)


# fp32 registers a lane gives the queries a warp attends together (Attention.attend): per
# query its E dims of o, its m, l, probability and score
ATTN_QUERY_REGS = 64
# the largest head dim whose builds take several queries a pass: at D = 128 and 256 ptxas
# spilled (nemotron-h-8b T = 8, QB = 2 or 4: 48-68 B of spill stores on sm_90a) or went past
# the register budget (qwen3.5-0.8b T = 4 global-memory build, QB = 2: 220 registers), so
# those builds keep QB = 1 (a query at a time) until their key loop is slimmed
ATTN_QUERY_BATCH_MAX_DIM = 64


def attn_warp_queries(group: int, tokens: int, num_warps: int = NUM_THREADS // LANES) -> int:
    """Queries the busiest warp of an ATTN_PARTIAL owns (attn_warp: WQ warps share a query's
    keys when there are fewer queries than warps; then a warp owns one)."""
    queries = group * tokens
    wq = max(1, num_warps // queries)
    return -(-queries // (num_warps // wq))


def attn_q_rows(span_bytes: int, head_dim: int, num_warps: int = NUM_THREADS // LANES) -> int:
    """fp32 q rows [D] per warp that fit `span_bytes` of shared memory: the consumers' span
    below the flag word (KernelSpec.smem_regions), which Attention.partial borrows for its
    passes' q rows when QB > 1 (none of its regions is live across records)."""
    return span_bytes // (4 * num_warps * head_dim)


def attn_query_batch(head_dim: int, group: int, tokens: int,
                     num_warps: int = NUM_THREADS // LANES, smem_queries: int = 0) -> int:
    """QB: the queries a warp attends together over one pass of the split's keys (Attention.
    partial / attend): all it owns (attn_warp_queries) when their state fits ATTN_QUERY_REGS
    registers a lane (E + 4 per query: 10 at D = 64), else that many at a time, the passes
    balanced (8 queries, 5 at most: two passes of 4); 1 past ATTN_QUERY_BATCH_MAX_DIM.
    `smem_queries` > 0 caps QB at the q rows per warp the shared memory holds
    (Attention.query_rows)."""
    per_warp = attn_warp_queries(group, tokens, num_warps)
    cap = max(1, ATTN_QUERY_REGS // (head_dim // LANES + 4))
    if head_dim > ATTN_QUERY_BATCH_MAX_DIM:
        cap = 1
    if smem_queries > 0:
        cap = max(1, min(cap, smem_queries))
    passes = -(-per_warp // cap)
    return -(-per_warp // passes)


def attn_group_queries(g0, j: int, step: int, queries: int, minimum=min, maximum=max):
    """(query, live) of entry j of the warp's pass starting at query g0 (the warp's queries are
    g0, g0 + step, ...: attn_warp): past the last query (live 0) the last query again (in range;
    it sees no keys and stores nothing). Plain arithmetic: Int32 in the kernel, int in tests."""
    qi = g0 + j * step
    return minimum(qi, queries - 1), minimum(maximum(queries - qi, 0), 1)


def attn_chunk_keys(k0, ke, minimum=min, maximum=max):
    """Keys of the chunk of 32 starting at k0 that a query whose keys end at ke sees: k0 ..
    k0 + n - 1 (lane < n of the scores, value j < n of the sums); 0: it sits the chunk out (its
    (m, l, o) untouched). The chunks of a pass run to the largest ke of its queries. Plain
    arithmetic: Int32 in the kernel, int in the tests."""
    return minimum(maximum(ke - k0, 0), LANES)


# head dims whose ATTN_PARTIAL runs on tensor cores (attn_tensor_cores): whole 32-dim steps of
# the m16n8k16 operands; D = 256's O fragments alone would take 128 registers a lane
ATTN_MMA_DIMS = (64, 128)


def attn_mma_rows(head_dim: int) -> int:
    """The most queries (T * G) the tensor-core partial takes: the 16 rows of its tile at D = 64;
    8 at D = 128, whose rows g + 8 (their q words and O fragments) were past the register
    budget (qwen3-tiny B = 4, T = 4: 28 B of spills on sm_90a)."""
    return MMA_M if head_dim <= 64 else MMA_M // 2


def attn_tensor_cores(head_dim: int, group: int, tokens: int, tight: bool = False,
                      recurrent: bool = False, num_warps: int = NUM_THREADS // LANES) -> bool:
    """Whether ATTN_PARTIAL runs on tensor cores (kernel/device/attention_mma.py): the G * T
    queries of a (sequence, kv head) are the rows of one m16n8k16 tile (at most attn_mma_rows),
    every warp takes a share of the split's keys for all of them, D in ATTN_MMA_DIMS, the
    contiguous cache of a weight-ring build (not `tight`: attn_value_batch), 8 warps (the MMA_N
    keys of a tile). Not in a build with recurrent layers (`recurrent`): their handlers share the
    register budget, and those builds keep the FMA loop they were checked with."""
    return (not tight and not recurrent and head_dim in ATTN_MMA_DIMS
            and group * tokens <= attn_mma_rows(head_dim) and num_warps == MMA_N)


def attn_mma_chunk(head_dim: int) -> int:
    """Keys a warp of the tensor-core partial loads together (one wait): 32 at D = 64, 16 at
    D = 128, so that the chunk's K and V words in flight stay 32 registers each a lane."""
    return 2048 // head_dim


# flop-equivalents per (query row, key) of the tensor-core partial's CUDA-core work: scale and
# mask, max, exp, sum, the hi / lo bf16 split of p, a share of the value words' transposition
# (about 10 instructions, 2 flops each as an FMA counts): an estimate from the kernel's code
ATTN_MMA_ROW_KEY_FLOPS = 20


def attn_mma_work(keys: int, head_dim: int) -> tuple[float, float]:
    """(tensor flops, fp32 flop-equivalents) of a tensor-core partial over `keys` keys: S = Q K^T
    and O += P V with P as hi + lo bf16 (two mmas: P keeps fp32's accuracy), all 16 rows of the
    tile whatever G * T fills, and ATTN_MMA_ROW_KEY_FLOPS per row and key."""
    return 2.0 * MMA_M * keys * head_dim * 3, float(ATTN_MMA_ROW_KEY_FLOPS * MMA_M * keys)


def attn_round_trips(keys: int, head_dim: int, group: int, tokens: int,
                     num_warps: int = NUM_THREADS // LANES, tight: bool = False,
                     recurrent: bool = False) -> int:
    """Dependent global round trips on the longest warp of one ATTN_PARTIAL of `keys` keys
    (Attention.partial / attend, counted from the loop nest): the warp takes its queries QB at a
    time (attn_query_batch), and per pass one round trip loads their q (into shared memory),
    then per chunk of 32 keys one for the keys with the first value batch, one per further value
    batch (each chunk loaded once for the pass's QB queries; the `tight` builds' batches are
    shorter), and one for the partials' stores. The tensor-core partial (attn_tensor_cores,
    `tight` and `recurrent` as there) waits for q, once per attn_mma_chunk keys of a warp's
    1 / NW share, once for the warps' merge and once for the stores. The cost model charges
    each one L2 round trip (cost.Rates.work)."""
    if attn_tensor_cores(head_dim, group, tokens, tight, recurrent, num_warps):
        # the merge: NW rounds of a barrier and a shared-memory round trip, assumed one global
        # round trip
        share = -(-keys // num_warps)
        return 2 + -(-share // attn_mma_chunk(head_dim)) + 1
    queries = group * tokens
    wq = max(1, num_warps // queries)
    passes = -(-attn_warp_queries(group, tokens, num_warps)
               // attn_query_batch(head_dim, group, tokens, num_warps))
    share = -(-keys // wq)
    chunks = -(-share // LANES)
    vb = attn_value_batch(head_dim, tight)  # the paged build's value batches are shorter
    return passes * (2 + chunks * (1 + (LANES - 1) // vb))


# splits whose m Attention.merge loads before using any, for the maximum: the most a kind
# splits into (layers.base.Kind.splits), so that a default program's maximum takes one trip
ATTN_MERGE_SPLITS = 16
# splits whose (m, l, o) Attention.merge loads before using any, for the sums: ptxas keeps
# about 8 splits' loads ahead of their use (sm_90a SASS of the 16-split batch), so a batch of 8
# is what one round trip covers
ATTN_MERGE_SUM_SPLITS = 8
# fp32 partial values (m, l and this lane's E dims of o, per split) a lane holds in flight in
# Attention.merge's sums (64 registers)
ATTN_MERGE_IN_FLIGHT = 64


def attn_merge_batch(head_dim: int) -> tuple[int, int]:
    """(splits a batch of the maximum's loads covers, splits a batch of the sums' loads covers)
    in Attention.merge: every split's m, then every split's m, l and this lane's E = D / 32
    dims of o, all of a batch issued before the first is used; (16, 8) at D = 64 and 128,
    (16, 6) at D = 256."""
    return ATTN_MERGE_SPLITS, min(ATTN_MERGE_SUM_SPLITS,
                                  ATTN_MERGE_IN_FLIGHT // (head_dim // LANES + 2))


def attn_merge_split(s0, j: int, n_splits, minimum=min):
    """Split whose partials entry j of the merge batch starting at split s0 loads: s0 + j, past
    the last split the last one (in range; a repeated m leaves the maximum as it is, and the
    sums skip the entry). Plain arithmetic: Int32 in the kernel, int in the tests."""
    return minimum(s0 + j, n_splits - 1)


def attn_merge_round_trips(n_splits: int, head_dim: int, group: int, tokens: int,
                           num_warps: int = NUM_THREADS // LANES) -> int:
    """Dependent global round trips of the split-KV merge (Attention.merge) on its longest warp:
    per query the warp takes, one per batch of the maximum's loads, one per batch of the sums'
    (attn_merge_batch), one for the gate and the store."""
    mb, sb = attn_merge_batch(head_dim)
    return -(-group * tokens // num_warps) * (-(-n_splits // mb) + -(-n_splits // sb) + 1)


def kv_row(layer, b, g, s_max, batch: int, kv_heads: int):
    """First row of (KV cache slot `layer`, sequence b, kv head g) in a KV cache
    [slots, B, Hkv, S_max, D] (kv_slot gives a decoder layer's slot)."""
    return ((layer * batch + b) * kv_heads + g) * s_max


def kv_slot(layer, attn_layers: tuple[int, ...], minimum=min, maximum=max):
    """KV cache slot of attention layer `layer` (the record's LAYER): the slots are the attention
    layers in order (program/buffers.py), so the slot counts the attention layers before it.
    `attn_layers` () means every layer has attention (slot = layer, no arithmetic: the dense
    builds); otherwise the unrolled count sum over a in attn_layers[1:] of [layer >= a], as
    min(max(layer - a + 1, 0), 1). Plain arithmetic: Int32 in the kernel, int in the tests."""
    if not attn_layers:
        return layer
    slot = 0
    for a in attn_layers[1:]:
        slot = slot + minimum(maximum(layer - a + 1, 0), 1)
    return slot


def ring_slot(j, stages: int):
    """Tile j's (stage, full-barrier parity, empty-barrier parity) in a ring of `stages`: the
    consumers wait full[stage] for `full`, the loader waits empty[stage] for `empty` (a fresh
    mbarrier counts as having completed the phase before phase 0, so round 0 does not block).
    Plain arithmetic: the kernel calls it on Int32, the host mirror on int."""
    rnd = j // stages
    return j % stages, rnd & 1, (rnd & 1) ^ 1

