"""Static configuration of one megakernel build, its parameter ABI and its budgets (no DSL).

A build is specialised on (model shapes, batch B, tokens per step T, arch): everything the device
code treats as a compile-time constant is in `KernelSpec`. What varies per launch (the program,
the buffers, S_max, the queue length) is a kernel parameter. The parameter list is plain (global
pointers and 32-bit integers) so that the manifest can be checked against the PTX `.entry`
signature and the runtime can launch the cubin with the driver API alone.

This module imports neither the DSL nor CUDA: the runtime and the CPU tests use it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from megakernel import isa

ARCHS = ("sm_90a", "sm_100a")
# compute capability -> the arch a cubin must be built for
CAPABILITY_ARCH = {(9, 0): "sm_90a", (10, 0): "sm_100a"}

# ---- budgets (checked on every build and in the tests) ------------------------------------------
NUM_THREADS = 256  # 8 warps per CTA, one CTA per SM
REGISTER_BUDGET = 192  # per thread (one 256-thread CTA per SM may use 255; 512 threads need <= 128)
# shared memory per CTA: the sm_90/sm_100 opt-in maximum (227 KiB) holds the dynamic carve-up
# plus the 1 KiB the cubins report as static shared memory (build.check_resources)
SMEM_OPTIN = 227 * 1024
SMEM_BUDGET = SMEM_OPTIN - 1024  # dynamic shared memory per CTA
# per SM: 228 KiB of shared memory on sm_90 and sm_100, of which the driver reserves 1 KiB per
# resident block for system use (NVIDIA Hopper Tuning Guide, "Occupancy" / "Increased Memory
# Capacity"; NVIDIA Blackwell Tuning Guide, "Unified Shared Memory/L1/Texture Cache"): a block
# fits the SM only if dynamic + static + 1 KiB <= 228 KiB (build.check_resources)
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024
X_SMEM_BYTES = 64 * 1024  # staged matvec input (bf16 [NO, KC])
ACC_SMEM_BYTES = 32 * 1024  # fp32 matvec results of one row chunk ([ks][n][row])

# ---- tensor-core matvec (matvec.py `mma_tile`; KernelSpec.mma) -----------------------------------
# With the pipeline and at least MMA_MIN_ROWS activation rows per step the GEMV runs on warp-level
# mma.sync m16n8k16 (bf16 in, fp32 accumulate): activations are the 16-row A operand, a ring
# tile's 8 weight rows the B operand, the tile's K split over the warps; the FMA GEMV re-reads the
# staged activations once per weight row and would be bound by shared-memory bandwidth there.
MMA_MIN_ROWS = 8
MMA_K_ALIGN = 32  # K (every matvec) in steps of 32: one 16-byte vector per lane per B row
MMA_M = 16  # activation rows per mma (A operand); NO is a multiple of it
MMA_N = 8  # weight rows per mma (B operand) = rows of a ring tile
MMA_X_PAD = 32  # bf16 of padding per staged activation row (KernelSpec.x_stride)

ROW_CHUNK = 256  # slab rows per epilogue pass: a multiple of every head_dim and of 2 * 16 gate/up
VEC = 8  # bf16 per 16-byte vector load
ARGMAX_EXACT = 1 << 24  # vocab indices travel as fp32 in the partial argmax
LANES = 32

# ---- L2 lookahead prefetch (the cost model reads the same window)
# The CTA asks L2 (cp.async.bulk.prefetch.L2) for the weight slabs of its own queue ahead of where
# it reads them. With the shared-memory pipeline the loader warp does it: before each tile, a
# second cursor over the loader's own tile sequence prefetches the following tiles up to
# PREFETCH_WINDOW bytes past the tiles issued (pipeline.py `prefetch_tiles`), so the window slides
# with the stream, within slabs and across dependency waits, in the loader's order (K-chunked
# slabs included). Without the pipeline the consumers do it when they reach a record, before its
# dependency wait: up to PREFETCH_WINDOW bytes past the start of the current slab, each byte once
# (lookahead.py). The window per SM is sized from the L2 capacity:
# the prefetched-but-unread bytes of all SMs (SMs x window) take at most L2_PREFETCH_SHARE of L2,
# so a prefetched line survives the demand stream that passes through L2 during its lead time
# (about the same number of bytes again). L2 capacities: H100 SXM5 and H200 (same GH100 die)
# 50 MB (NVIDIA H100 Tensor Core GPU Architecture whitepaper; `l2CacheSize` = 50 MiB); B200
# 126 MB over its two dies (Chips and Cheese, "Nvidia's B200: Keeping the CUDA Juggernaut
# Rolling", 2025). SM counts: the largest part of each arch (H100/H200 SXM 132, B200 148).
PREFETCH_CHUNK = 16 * 1024  # bytes per cp.async.bulk.prefetch.L2 request
L2_BYTES = {"sm_90a": 50 * 2**20, "sm_100a": 126 * 2**20}
ARCH_SMS = {"sm_90a": 132, "sm_100a": 148}
L2_PREFETCH_SHARE = 0.5


# ---- shared-memory weight pipeline (pipeline.py; KernelSpec.smem_stages) ------------------------
# smem_stages = 0: the consumer warps read weights straight from global memory (16-byte loads).
# smem_stages = S >= 2: one extra loader warp streams every matvec slab, in queue order and tiles of
# whole rows, into a ring of S shared-memory stages (cp.async.bulk + mbarrier complete_tx), running
# ahead of the consumers across instruction boundaries and their dependency waits.
# The pipeline is the default, with as many stages as the shared-memory budget leaves room for, up
# to PIPELINE_STAGES (a deeper ring keeps more of the weight stream on chip across a dependency
# wait: at B = 1, 6 x 32 KiB; larger batches stage more activations and get fewer). make_spec falls
# back to 0 for a model/batch whose pipelined spec does not fit even with MIN_PIPELINE_STAGES
# (named in SpecError), so every build the global path served builds.
SMEM_STAGE_BYTES = 32 * 1024  # one stage: `tile_rows(kc)` rows of a K-chunk of kc bf16
PIPELINE_STAGES = 6  # the deepest ring a build takes (192 KiB)
MIN_PIPELINE_STAGES = 2


# ---- timeline build (KernelSpec.timeline; kernel/timeline.py writes, megakernel/timeline.py reads)
# The variant stamps %globaltimer (ns) into one record of TIMELINE_WORDS int64 words per (SM,
# queue position), laid out [num_sms, queue_len, TIMELINE_WORDS] in the tail of the program
# buffer, right after the records [num_sms, queue_len, RECORD_WORDS] int32 (the kernel parameter
# `program` stays a view of the records: the ABI is that of the default build). Consumer thread 0
# writes wait_start (before the dependency wait), wait_end (after it), finish (after the signal)
# and the opcode; the loader warp (pipelined builds) writes load_start (it reached the slab) and
# load_end (it has issued the slab's last tile). Unwritten words stay as the host zeroed them.
TIMELINE_FIELDS = ("wait_start", "wait_end", "finish", "load_start", "load_end", "opcode")
TIMELINE_WORDS = 8  # int64 per record (64 bytes; the last two spare)


def timeline_word(name: str) -> int:
    """Index of a timeline field in its record."""
    return TIMELINE_FIELDS.index(name)


def timeline_offset(num_sms: int, queue_len: int) -> int:
    """int32 word offset of the timeline records from the start of the program buffer."""
    return num_sms * queue_len * isa.RECORD_WORDS


def timeline_int32_words(num_sms: int, queue_len: int) -> int:
    """int32 words of a program buffer with its timeline tail (records + timeline)."""
    return timeline_offset(num_sms, queue_len) + 2 * num_sms * queue_len * TIMELINE_WORDS


def tile_rows(kc: int, num_warps: int, stage_bytes: int = SMEM_STAGE_BYTES) -> int:
    """Weight rows per pipeline tile for K-chunks of `kc` inputs: the largest power of two <= the
    warps per CTA whose rows fit one stage (0 when a single row does not fit). The kernel
    evaluates the same rule at run time (Pipeline.tile_rows)."""
    tr = 0
    cand = 1
    while cand <= num_warps and cand * kc * 2 <= stage_bytes:
        tr = cand
        cand *= 2
    return tr


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


# ---- index helpers of the GEMV, the loader and attention -----------------------------------------
# Plain arithmetic shared by the device code (Int32/Int64 operands, `minimum`/`maximum` =
# cutlass.min/max) and the host emulations (int operands, the builtins):
# tests/kernel/test_kernel_index_emulation.py runs them against plain matrix products.
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


def matvec_tiles(nrows: int, k: int, passes: int, k_chunk: int, num_warps: int):
    """The tiles of one matvec slab in the order the loader streams and the consumers read them
    (Matvec.run_piped / Pipeline.load_queue use the same loop nest): (pass, row0, rows, col0,
    cols), rows of `tile_rows(min(k_chunk, k))`. Loop nest: pass > ROW_CHUNK chunk > K-chunk >
    rows of the chunk."""
    tr = tile_rows(min(k_chunk, k), num_warps)
    if tr == 0:
        raise SpecError(f"a weight row chunk of {min(k_chunk, k)} inputs does not fit one "
                        f"{SMEM_STAGE_BYTES} B pipeline stage")
    for p in range(passes):
        for rc0 in range(0, nrows, ROW_CHUNK):
            nr = min(ROW_CHUNK, nrows - rc0)
            for kc0 in range(0, k, k_chunk):
                kc = min(k_chunk, k - kc0)
                for t0 in range(0, nr, tr):
                    yield p, rc0 + t0, min(tr, nr - t0), kc0, kc


def stage_plan(slabs: list[tuple[int, int]], passes: int, k_chunk: int,
               num_warps: int) -> list[tuple[int, int, int, int, int, int]]:
    """Host mirror of the loader warp's schedule (Pipeline.load_queue), for tests and docs.

    `slabs[i]` = (NROWS, K) of queue instruction i ((0, 0) for opcodes without a slab); each
    matvec streams its slab once per pass over the activation rows. Returns the tiles in issue
    order: (instruction, pass, first row, rows, first column, columns); tile j goes to stage
    `ring_slot(j, S)[0]` once the consumers have released tile j - S.
    """
    return [(i, *t) for i, (nrows, k) in enumerate(slabs) if nrows
            for t in matvec_tiles(nrows, k, passes, k_chunk, num_warps)]


def prefetch_window(arch: str) -> int:
    """Lookahead L2 prefetch window per SM in bytes (a multiple of PREFETCH_CHUNK):
    192 KiB on sm_90a (132 x 192 KiB = 24.8 MiB of 50 MiB), 432 KiB on sm_100a (148 x 432 KiB =
    62.4 MiB of 126 MiB)."""
    if arch not in L2_BYTES:
        raise SpecError(f"unsupported arch {arch!r}; supported: {', '.join(ARCHS)}")
    w = int(L2_BYTES[arch] * L2_PREFETCH_SHARE) // ARCH_SMS[arch]
    return w // PREFETCH_CHUNK * PREFETCH_CHUNK


def lookahead_plan(slabs: list[int], window: int) -> list[list[tuple[int, int, int]]]:
    """Host mirror of the global-memory build's lookahead (lookahead.Lookahead.extend, same state
    machine, for tests and documentation).

    `slabs[i]`: prefetchable weight bytes of queue instruction i (0 for opcodes without a slab).
    Returns, per instruction i, the (instruction, byte offset, bytes) ranges requested when the
    CTA reaches i: everything of slabs i, i+1, ... below (start of slab i) + window that was not
    requested before (bytes of earlier slabs are left to the demand loads).
    """
    out: list[list[tuple[int, int, int]]] = []
    pf_pc, pf_off, pf_cum, cum = 0, 0, 0, 0
    for pc, nb in enumerate(slabs):
        if pf_pc < pc:  # the demand loads of earlier slabs overtook the lookahead
            pf_pc, pf_off, pf_cum = pc, 0, cum
        limit = cum + window
        got: list[tuple[int, int, int]] = []
        while pf_cum < limit and pf_pc < len(slabs):
            take = min(slabs[pf_pc] - pf_off, limit - pf_cum)
            if take > 0:
                got.append((pf_pc, pf_off, take))
                pf_off += take
                pf_cum += take
            if pf_off >= slabs[pf_pc]:
                pf_pc, pf_off = pf_pc + 1, 0
        out.append(got)
        cum += nb
    return out


def tile_requests(slabs: list[tuple[int, int]], tile: tuple) -> list[tuple[int, int, int]]:
    """The L2 prefetch requests of one stage_plan tile (instruction, byte offset in its slab,
    bytes): one for a tile of whole rows, one per row of a K-chunk (Pipeline.prefetch_tiles)."""
    i, _p, row0, rows, col0, cols = tile
    k = slabs[i][1]
    if cols == k:
        return [(i, row0 * k * 2, rows * cols * 2)]
    return [(i, ((row0 + r) * k + col0) * 2, cols * 2) for r in range(rows)]


def loader_lookahead_plan(slabs: list[tuple[int, int]], passes: int, k_chunk: int,
                          num_warps: int, window: int) -> list[tuple[tuple, list]]:
    """The pipelined build's lookahead (Pipeline.prefetch_tiles): a cursor walks the loader's
    own tile sequence (stage_plan) and, before the loader issues tile j, prefetches tiles until
    the bytes it has covered reach (bytes of tiles 0..j-1) + window. `slabs` as in stage_plan.
    Returns (tile, requests issued just before it) per tile, requests as in tile_requests."""
    tiles = stage_plan(slabs, passes, k_chunk, num_warps)
    out, vol, covered, u = [], 0, 0, 0
    for tile in tiles:
        reqs = []
        while covered < vol + window and u < len(tiles):
            reqs += tile_requests(slabs, tiles[u])
            covered += tiles[u][3] * tiles[u][5] * 2
            u += 1
        out.append((tile, reqs))
        vol += tile[3] * tile[5] * 2
    return out


def default_build(cfg, batch: int, tokens: int, arch: str) -> KernelSpec | None:
    """The default build's spec for this model/batch, or None when no kernel build serves it."""
    try:
        return make_spec(cfg, batch, tokens, arch)
    except SpecError:
        return None


def build_ring_bytes(cfg, batch: int, tokens: int, arch: str) -> int:
    """Bytes of the default build's shared-memory weight ring for this model/batch (0: the
    global-memory path, or no kernel build serves it). The cost model reads it."""
    spec = default_build(cfg, batch, tokens, arch)
    return spec.ring_bytes if spec else 0


# ---- kernel parameters (the ABI) ----------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "ptr" (64-bit global address) | "i32"
    dtype: str  # element type behind a pointer, or "int32"
    doc: str

    @property
    def size(self) -> int:
        return 8 if self.kind == "ptr" else 4


PARAMS: tuple[Param, ...] = (
    Param("program", "ptr", "int32", "records [num_sms, queue_len, RECORD_WORDS]"),
    Param("counters", "ptr", "int32", "counter words (EPOCH, EXIT, program counters)"),
    Param("weights", "ptr", "bfloat16", "packed weight arena"),
    Param("f32", "ptr", "float32", "fp32 arena (h, partials, logits, rope tables)"),
    Param("bf16", "ptr", "bfloat16", "bf16 arena (q, attention output, MLP activation)"),
    Param("i32", "ptr", "int32", "int32 arena (tokens in/out, lengths)"),
    Param("k_cache", "ptr", "bfloat16", "K cache [L, B, Hkv, S_max, D]"),
    Param("v_cache", "ptr", "bfloat16", "V cache [L, B, Hkv, S_max, D]"),
    Param("state", "ptr", "float32", "recurrent state arena (per recurrent layer: conv window, "
          "state, ReplaySSM ring), 64-bit element offsets in the records"),
    Param("queue_len", "i32", "int32", "records per CTA queue (second dim of program)"),
    Param("s_max", "i32", "int32", "cache positions per sequence"),
    Param("lengths_off", "i32", "int32", "i32 offset of lengths [B] (header I32_LENGTHS_OFF)"),
)


class SpecError(ValueError):
    """A model/batch combination this kernel build cannot serve (named, with the limit)."""


@dataclass(frozen=True)
class KernelSpec:
    """Compile-time constants of the device code."""

    arch: str
    family: str
    hidden: int  # H
    inter: int  # I
    vocab: int  # V
    layers: int  # L
    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # D
    qk_norm: bool
    eps: float
    batch: int  # B
    tokens: int  # T
    qkv_bias: bool = False  # the QKV epilogue adds the bias that follows the matrix
    rope: bool = True  # the QKV epilogue applies RoPE to every head dim (False: none, Nemotron-H)
    # RoPE on the first `rotary` dims of each q/k head (partial RoPE, Qwen3.5); 0: all of them
    rotary: int = 0
    norm_one_plus: bool = False  # every RMSNorm weight is applied as (1 + w) (header NORM_KIND 1)
    # q_proj holds [q | gate] per head: the QKV epilogue stores the gate heads in fp32 at
    # gate_off (header F32_GATE_OFF) and the attention merge multiplies by sigmoid(gate)
    output_gate: bool = False
    gate_off: int = -1
    # the opcodes the model's program uses (program_ops; () = those of a dense stack, as before
    # the field existed): the build compiles in only their handlers and epilogues (handled_ops)
    ops: tuple[int, ...] = ()
    # the decoder layers with attention, in order: their KV cache slots (kv_slot); () = every
    # layer (the dense stacks)
    attn_layers: tuple[int, ...] = ()
    # the gated delta rule's (num_k_heads, num_v_heads, k_head_dim, v_head_dim, conv_kernel)
    # when the model has GDN layers (kernel/gdn_index.py); () = none
    gdn: tuple[int, ...] = ()
    # Mamba2's (num_heads, head_dim, state_size, n_groups, conv_kernel) when the model has Mamba2
    # layers (kernel/mamba_index.py); () = none
    mamba: tuple[int, ...] = ()
    # KDA's (num_heads, head_dim, conv_kernel) (layers/kda.py); () = none
    kda: tuple[int, ...] = ()
    # MLA's (num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    # (layers/mla.py); () = none
    mla: tuple[int, ...] = ()
    # MoE's (num_experts, top_k, intermediate_size, n_group, topk_group, shared expert 0/1)
    # (layers/moe.py); () = none
    moe: tuple[int, ...] = ()
    # ReplaySSM fold window L (program header REPLAY_WINDOW, checked by runtime.check_header):
    # the recurrent layers run their kinds' REPLAY ops with rings of L - 1 + T entries; 0 = the
    # recurrent update
    replay_window: int = 0
    # paged KV (kernel/paged_index.py): (num_blocks, block_size, max_blocks, block table and
    # slot mapping i32 offsets); () = the contiguous cache [slots, B, Hkv, S_max, D]
    paged: tuple[int, ...] = ()
    num_threads: int = NUM_THREADS  # consumer threads (the loader warp of a pipeline is extra)
    smem_stages: int = PIPELINE_STAGES  # 0: weights from global; >= 2: smem ring (above)
    timeline: bool = False  # the variant that stamps per-instruction times (TIMELINE_FIELDS)
    l2_window: int = -1  # L2 lookahead bytes per SM; -1: the arch's (prefetch_window), 0: none

    # ---- derived ----------------------------------------------------------------------------
    @property
    def prefetch_window(self) -> int:
        return prefetch_window(self.arch) if self.l2_window < 0 else self.l2_window

    @property
    def pipelined(self) -> bool:
        return self.smem_stages > 0

    @property
    def ring_bytes(self) -> int:
        """Bytes of the shared-memory weight ring (0: the global-memory path)."""
        return self.smem_stages * SMEM_STAGE_BYTES

    @property
    def block_threads(self) -> int:
        """Threads per CTA: the consumer warps, plus one loader warp when pipelined."""
        return self.num_threads + (LANES if self.pipelined else 0)

    @property
    def passes(self) -> int:
        """Outer passes over the activation rows per matvec (each streams the slab once)."""
        return -(-self.rows // self.no)

    @property
    def handled_ops(self) -> tuple[int, ...]:
        """The opcodes this build has handlers for (fields.OpTable.for_spec)."""
        return self.ops or tuple(sorted(kinds_ops(DENSE_KINDS)))

    @property
    def kv_layers(self) -> int:
        """KV cache slots (first dim of the cache): the attention layers."""
        return len(self.attn_layers) or self.layers

    @property
    def rows(self) -> int:  # N = B * T
        return self.batch * self.tokens

    @property
    def group(self) -> int:  # G
        return self.heads // self.kv_heads

    @property
    def qkv_slots(self) -> int:
        """Head slots per kv group: G q heads, (output gate) their G gate heads, k, v."""
        return self.group * (2 if self.output_gate else 1) + 2

    @property
    def qkv_rows(self) -> int:
        """Rows of a layer's packed QKV matrix: per kv head its head slots, D rows each."""
        return self.kv_heads * self.qkv_slots * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """RoPE dims per q/k head (R; 0: no RoPE)."""
        return (self.rotary or self.head_dim) if self.rope else 0

    @property
    def num_warps(self) -> int:
        return self.num_threads // LANES

    @property
    def nb(self) -> int:
        """Activation rows per register block of the GEMV (accumulators R * NB per lane): a power
        of two so that R = 16 / NB divides the slab alignment; padded rows are zero inputs."""
        nb = 1
        while nb < min(self.rows, 8):
            nb *= 2
        return nb

    @property
    def rows_per_group(self) -> int:
        """R: weight rows a warp streams together (16-byte loads in flight per lane)."""
        return max(1, min(8, 16 // self.nb))

    @property
    def gemv_unroll(self) -> int:
        """K-loop unroll: 16-byte weight loads in flight per lane = R * unroll (<= 8)."""
        return 2 if self.rows_per_group <= 4 else 1

    @property
    def mma(self) -> bool:
        """The GEMV runs on tensor cores (mma.sync; see MMA_MIN_ROWS): pipelined, enough
        activation rows, 8 consumer warps (a ring tile is then 8 weight rows = one mma N) and
        every K a multiple of MMA_K_ALIGN; otherwise the FMA GEMV."""
        ks = self.matvec_ks
        return (self.pipelined and self.rows >= MMA_MIN_ROWS and self.num_warps == MMA_N
                and all(k % MMA_K_ALIGN == 0 for k in ks))

    @property
    def no(self) -> int:
        """Activation rows per outer pass of a matvec (x staged for NO rows at a time; the mma
        path stages a multiple of 16, zero rows past N)."""
        if self.mma:
            return min(-(-self.rows // MMA_M) * MMA_M, 2 * MMA_M)
        npad = -(-self.rows // self.nb) * self.nb
        return min(npad, 32 // self.nb * self.nb)

    @property
    def matvec_ks(self) -> tuple[int, ...]:
        """Every K a matvec of the build has: H (QKV, GATEUP, PROJ, LMHEAD), Hq D (o_proj), I
        (down), then those of the other kinds' matrices as each declares them
        (LayerKind.matvec_shapes: the recurrent and MLA out_proj inputs, an expert's I)."""
        from megakernel.layers import all_kinds

        ks = [self.hidden, self.heads * self.head_dim, self.inter]
        for kd in all_kinds().values():
            if kd.spec_field and getattr(self, kd.spec_field, ()):
                for mats in kd.matvec_shapes(getattr(self, kd.spec_field), self.hidden).values():
                    ks += [k for k, _ in mats if k not in ks]
        return tuple(ks)

    @property
    def k_max(self) -> int:
        return max(self.matvec_ks)

    @property
    def k_chunk(self) -> int:
        """KC: input features staged per pass (a multiple of 256 = one warp-wide sweep)."""
        cap = X_SMEM_BYTES // (2 * self.no) // 256 * 256
        if self.pipelined:  # a pipeline tile holds at least one row of a K-chunk
            cap = min(cap, SMEM_STAGE_BYTES // 2 // 256 * 256)
        need = -(-self.k_max // 256) * 256
        return max(256, min(cap, need))

    @property
    def x_stride(self) -> int:
        """Elements between staged activation rows in sX: KC, padded by 32 bf16 (64 bytes = 16
        banks) for the mma path so that the two rows one 8-lane phase of a 16-byte A-operand
        load touches fall in different banks."""
        return self.k_chunk + (MMA_X_PAD if self.mma else 0)

    @property
    def row_chunk(self) -> int:
        return ROW_CHUNK

    @property
    def acc_words(self) -> int:
        if self.pipelined:  # [ks][n][row], NW / tile_rows K-slices at most
            tr = max(1, tile_rows(min(self.k_chunk, self.k_max), self.num_warps))
            return self.num_warps // tr * self.no * ROW_CHUNK
        return self.no * max(ROW_CHUNK, self.num_warps * self.rows_per_group)

    @property
    def attn_queries(self) -> int:  # T * G queries per (sequence, kv head)
        return self.tokens * self.group

    def kind_shape(self, field: str):  # noqa: ANN201 (a *_index shape | None)
        """The index arithmetic of a kind's handler for this build (KIND_SHAPES; None: the model
        has no such layers)."""
        if not getattr(self, field):
            return None
        module, cls, _ = KIND_SHAPES[field]
        return getattr(importlib.import_module(f"megakernel.kernel.{module}"), cls).for_spec(self)

    gdn_shape = property(lambda self: self.kind_shape("gdn"))  # gdn_index.GDNShape | None
    kda_shape = property(lambda self: self.kind_shape("kda"))  # kda_index.KDAShape | None
    mamba_shape = property(lambda self: self.kind_shape("mamba"))  # mamba_index.MambaShape
    mla_shape = property(lambda self: self.kind_shape("mla"))  # mla_index.MLAShape | None

    @property
    def ring_cap(self) -> int:
        """ReplaySSM ring entries per (layer, sequence) (header RING_CAP): L - 1 + T; 0 without
        a window (compiler.compile_program's ring_cap)."""
        return self.replay_window - 1 + self.tokens if self.replay_window else 0

    @property
    def paged_shape(self):  # noqa: ANN201 (paged_index.PagedShape | None)
        """The paged cache's index arithmetic for this build (None: the contiguous cache)."""
        from megakernel.kernel.paged_index import PagedShape

        return PagedShape.of(self.paged, self.kv_heads, self.head_dim) if self.paged else None

    @property
    def recurrent_smem_bytes(self) -> int:
        """Shared memory the recurrent core handlers and the latent-attention handlers (MLA)
        use (the largest of the model's kinds): a span from the start of the carve-up over the
        consumers' regions (x, acc, ..., none of them live across records)."""
        shapes = (self.kind_shape(f) for f in KIND_SHAPES)
        return max((4 * s.smem()["words"] for s in shapes if s is not None), default=0)

    # shared memory carve-up (bytes, every region 128-byte aligned)
    def smem_regions(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, bytes)."""
        d, nw = self.head_dim, self.num_warps
        sizes = [
            ("x", 2 * self.no * self.x_stride),  # bf16 [NO, KC] (rows x_stride apart)
            ("acc", 4 * self.acc_words),  # fp32 [ks][n][row]
            ("rstd", 4 * max(self.no, 32)),  # fp32 per activation row
            ("best", 8 * max(self.no, 32)),  # (max, index) per activation row
            ("q", 4 * nw * d),  # fp32 per warp: the query of attention
            ("o", 4 * nw * d),  # fp32 per warp: attention partial output
            ("ml", 4 * 2 * nw),  # fp32 per warp: (m, l)
            ("flag", 16),  # int32 broadcast word
        ]
        if self.mma:  # fp32 [2][NW][NO][MMA_N]: per-warp K-slice partials of a tile, 2 buffers
            sizes.append(("red", 4 * 2 * nw * self.no * MMA_N))
        span = sum(-(-n // 128) * 128 for _, n in sizes)
        if self.recurrent_smem_bytes > span:  # extends the consumers' span the handlers use
            sizes.append(("ssm", self.recurrent_smem_bytes - span))
        if self.pipelined:
            sizes += [
                ("ring", self.smem_stages * SMEM_STAGE_BYTES),  # bf16 weight tiles
                # full[S], empty[S], done mbarriers, then the loader's tile count (int64 slot)
                ("mbar", 8 * (2 * self.smem_stages + 2)),
            ]
        out, off = {}, 0
        for name, n in sizes:
            out[name] = (off, n)
            off += -(-n // 128) * 128
        return out

    @property
    def smem_bytes(self) -> int:
        return sum(-(-n // 128) * 128 for _, n in self.smem_regions().values())

    # ---- checks ------------------------------------------------------------------------------
    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise SpecError(f"unsupported arch {self.arch!r}; supported: {', '.join(ARCHS)}")
        if self.l2_window != -1 and (self.l2_window < 0 or self.l2_window % PREFETCH_CHUNK):
            raise SpecError(f"l2_window {self.l2_window}: -1 (the arch's) or a non-negative "
                            f"multiple of {PREFETCH_CHUNK} bytes")
        if self.head_dim not in isa.SUPPORTED_HEAD_DIMS:
            raise SpecError(f"unsupported head_dim {self.head_dim}; the kernel supports "
                            f"{', '.join(map(str, isa.SUPPORTED_HEAD_DIMS))}")
        if self.vocab > ARGMAX_EXACT:
            raise SpecError(f"vocab_size {self.vocab} > {ARGMAX_EXACT}: the partial argmax "
                            f"carries vocab indices as fp32, exact only up to 2^24")
        if self.rows > isa.MAX_ROWS:
            raise SpecError(f"batch * tokens = {self.rows} > {isa.MAX_ROWS} rows per step")
        for what, k in (("hidden_size", self.hidden), ("q_size", self.heads * self.head_dim),
                        ("intermediate_size", self.inter),
                        *(("recurrent out_proj K", k) for k in self.matvec_ks[3:])):
            if k % VEC:
                raise SpecError(f"{what} = {k} must be a multiple of {VEC} (16-byte loads)")
        if self.num_threads % LANES or not 64 <= self.num_threads <= 1024:
            raise SpecError(f"num_threads must be a multiple of 32 in [64, 1024], "
                            f"got {self.num_threads}")
        if self.head_dim % (2 * LANES):  # E = D / 32 per lane, split in RoPE halves
            raise SpecError(f"head_dim {self.head_dim} must be a multiple of {2 * LANES}")
        if rope_layout_error(self.rotary_dim, self.head_dim):
            raise SpecError(rope_layout_error(self.rotary_dim, self.head_dim))
        if self.output_gate and self.gate_off < 0:
            raise SpecError("a gated build needs the gate buffer's offset (gate_off)")
        if ROW_CHUNK % self.head_dim or ROW_CHUNK % (2 * isa.GATEUP_BLOCK):
            raise SpecError("ROW_CHUNK must hold whole heads and whole gate/up block pairs")
        if isa.ROW_ALIGN % self.rows_per_group:
            raise SpecError("rows per warp group must divide the slab row alignment")
        if 4 * self.acc_words > ACC_SMEM_BYTES:
            raise SpecError(f"matvec accumulators need {4 * self.acc_words} B of shared memory "
                            f"> {ACC_SMEM_BYTES}")
        if self.smem_stages < 0 or self.smem_stages == 1:
            raise SpecError(f"smem_stages must be 0 (no pipeline) or >= 2, got {self.smem_stages}")
        if self.pipelined and self.num_warps & (self.num_warps - 1):
            raise SpecError(f"the pipeline needs a power-of-two number of consumer warps, "
                            f"got {self.num_warps}")
        if self.mma and any(tile_rows(min(self.k_chunk, k), self.num_warps) != MMA_N
                            for k in self.matvec_ks):
            raise SpecError(f"the mma GEMV needs ring tiles of {MMA_N} weight rows")
        if self.smem_bytes > SMEM_BUDGET:
            raise SpecError(f"the kernel needs {self.smem_bytes} B of shared memory > budget "
                            f"{SMEM_BUDGET}")
        for field, (module, _, check) in KIND_SHAPES.items():
            if getattr(self, field):
                why = getattr(importlib.import_module(f"megakernel.kernel.{module}"), check)(
                    self.kind_shape(field))
                if why:
                    raise SpecError(why)
        from megakernel.layers import all_kinds

        replay_codes = {k.replay_op for k in all_kinds().values() if k.recurrent}
        replay_ops = [isa.spec(op).name for op in self.ops if op in replay_codes]
        if replay_ops and self.replay_window < 1:
            raise SpecError(f"{', '.join(replay_ops)} fold their rings every replay_window "
                            "tokens: a ReplaySSM build needs replay_window >= 1")
        if self.paged:
            from megakernel.kernel.paged_index import PAGED_FIELDS, check_paged

            if len(self.paged) != len(PAGED_FIELDS):
                raise SpecError(f"paged must be ({', '.join(PAGED_FIELDS)}), got {self.paged}")
            if check_paged(self.paged_shape):
                raise SpecError(check_paged(self.paged_shape))

    # ---- identity ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-native (the tuples as lists): what a manifest holds."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> KernelSpec:
        """From to_dict (or its JSON: the tuples come back as lists)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    @property
    def tag(self) -> str:
        """Short name of the static config, used in file names: the main shapes, then a digest of
        every other constant of the model (layer pattern, handled opcodes, norms, recurrent
        shapes) that a build bakes in; the variants (arch, threads, ring, l2 window) are not in
        it (a build set keeps them apart)."""
        rest = {k: v for k, v in self.to_dict().items()
                if k not in ("arch", "num_threads", "smem_stages", "timeline", "l2_window")
                and (k not in _TAG_IF_SET or v)}  # the tags of builds without them as before
        digest = hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:8]
        return (f"{self.family}-h{self.hidden}-i{self.inter}-v{self.vocab}-l{self.layers}"
                f"-q{self.heads}-kv{self.kv_heads}-d{self.head_dim}-b{self.batch}-t{self.tokens}"
                f"-{digest}" + ("-timeline" if self.timeline else ""))


def rope_layout_error(rotary: int, head_dim: int) -> str:
    """Why the QKV epilogue cannot rotate `rotary` of `head_dim` dims ('' when it can). Lane
    holds dims lane + 32 e: the partners d, d +- R/2 share a lane when R/2 is a multiple of 32,
    or are lanes of e = 0 (one shuffle) when R <= 32."""
    if rotary in (0, head_dim) or (rotary // 2) % LANES == 0 or rotary <= LANES:
        return ""
    return (f"RoPE on {rotary} of {head_dim} head dims (the kernel rotates R <= {LANES} dims "
            f"or R/2 a multiple of {LANES})")


# the layer kinds of a dense stack: what a spec without `ops` handles
DENSE_KINDS = ("attention", "swiglu")
# the kinds' index arithmetic (a pure-python *_index module each, shared by the device code and
# its host emulation): spec field -> (module, shape class with for_spec, its check)
KIND_SHAPES = {
    "gdn": ("gdn_index", "GDNShape", "check_gdn"),
    "kda": ("kda_index", "KDAShape", "check_kda"),
    "mamba": ("mamba_index", "MambaShape", "check_mamba"),
    "mla": ("mla_index", "MLAShape", "check_mla"),
}
# spec fields that enter a build's tag only when set (the tags of the builds before them hold)
_TAG_IF_SET = ("paged", "kda", "mla", "moe")
# the kinds' KernelSpec fields (LayerKind.spec_field), filled by make_spec
KIND_FIELDS = ("gdn", "mamba", "kda", "mla", "moe")
FRAME_OPS = ("END", "EMBED", "LMHEAD", "ARGMAX")


def mlp_kinds() -> tuple[str, ...]:
    """The feed-forward layer kinds (layers.mlp.MLPKind: SwiGLU, relu^2, ...), from the kind
    registry; a model the kernel runs has exactly one, and the build's `inter` is its."""
    from megakernel.layers import all_kinds
    from megakernel.layers.mlp import MLPKind

    return tuple(sorted(n for n, k in all_kinds().items() if issubclass(k, MLPKind)))


def kinds_ops(kinds, replay: bool = False) -> set[int]:  # noqa: ANN001 (kind names)
    """The opcodes of a program whose blocks are of `kinds`: their `flow` plus the frame's; a
    recurrent kind's core op is its ReplaySSM one when `replay` (a program has one of the two)."""
    from megakernel.layers import kind

    names = set(FRAME_OPS)
    for k in kinds:
        kd = kind(k)
        names |= set(kd.flow)
        if kd.recurrent:
            names.discard(isa.spec(kd.core_op if replay else kd.replay_op).name)
    return {int(getattr(isa.Op, n)) for n in names}


def program_ops(cfg, replay: bool = False) -> set[int]:  # noqa: ANN001 (ModelConfig)
    """The opcodes a program of `cfg` uses (its kinds' `flow` plus the frame's; `replay`: with a
    ReplaySSM window)."""
    return kinds_ops({blk.kind for blk in cfg.blocks}, replay)


def check_kernel_support(cfg, replay: bool = False,  # noqa: ANN001 (ModelConfig)
                         unhandled: str = "refuse") -> None:
    """SpecError naming what of `cfg` the kernel does not run yet (validate() has accepted it);
    `unhandled="trap"` lets opcodes without a device handler through (make_spec)."""
    missing = sorted(isa.spec(op).name for op in program_ops(cfg, replay)
                     if not isa.spec(op).device)
    if missing and unhandled != "trap":
        kinds = sorted({isa.spec(getattr(isa.Op, n)).kind for n in missing})
        raise SpecError(f"the kernel has no device handlers for {', '.join(missing)} yet (layer "
                        f"kinds {', '.join(kinds)} of {cfg.name or cfg.family}); the CPU "
                        "executor runs its program")
    from megakernel.models import ConfigError

    ffn = mlp_kinds()
    mlps = [k for k in ffn if cfg.has_kind(k)]
    try:  # the build's constants: one attention and one feed-forward config for every layer
        if len(mlps) != 1:
            raise ConfigError(f"{cfg.name or cfg.family} has feed-forward kinds {mlps}; "
                              f"expected exactly one of {', '.join(ffn)}")
        cfg.kind_config(mlps[0])
        for k in ("attention", *kind_fields(cfg, names=True)):
            if cfg.has_kind(k):
                cfg.kind_config(k)
    except ConfigError as e:
        raise SpecError(f"the kernel serves stacks whose layers of each kind have one shape "
                        f"(and one feed-forward kind of {'/'.join(ffn)}): {e}") from None
    if not cfg.has_kind("attention"):
        return
    att = cfg.kind_config("attention")
    why = rope_layout_error(att.rotary_dim, att.head_dim)
    if why:
        raise SpecError(f"the kernel does not support {why} yet ({cfg.name or cfg.family})")


def gate_offset(cfg, batch: int, tokens: int) -> int:  # noqa: ANN001 (ModelConfig)
    """F32 element offset of the gate buffer [N, Hq, D] in the programs of `cfg` at this batch
    (-1: no output gate). The gate is a step-shape region declared before the attention
    partials (layers/attention.py), so its offset does not depend on the split count or the
    cache length: a compile-time constant of the build, checked against the program header's
    F32_GATE_OFF when a program meets the build (runtime.check_header)."""
    if not cfg.has_kind("attention") or not cfg.kind_config("attention").output_gate:
        return -1
    from megakernel.layers.base import StepShape
    from megakernel.program.buffers import plan_buffers

    offs = {plan_buffers(cfg, StepShape(batch, tokens, s_max, splits, 1, 0)).f32["gate"].offset
            for splits, s_max in ((1, 64), (4, 256))}
    if len(offs) != 1:
        raise SpecError(f"the gate buffer's offset depends on the program ({sorted(offs)}); "
                        "the kernel takes it as a compile-time constant")
    return offs.pop()


def make_spec(cfg, batch: int, tokens: int, arch: str,  # noqa: ANN001 (ModelConfig)
              num_threads: int = NUM_THREADS, smem_stages: int | None = None,
              timeline: bool = False, l2_window: int = -1, replay: bool = False,
              replay_window: int = 0, paged=None,  # noqa: ANN001 (program.paged.PagedKV | None)
              unhandled: str = "refuse") -> KernelSpec:
    """The build's static config for a model, batch and tokens per step (`replay_window` L >= 1:
    programs with that ReplaySSM window, whose recurrent layers run the kinds' ReplaySSM core
    ops; `replay` without a window: the op set only, for support checks). `smem_stages`
    None: the deepest ring (PIPELINE_STAGES down to MIN_PIPELINE_STAGES) whose spec is valid, else 0
    (the global-memory weight path); an int is taken as given (SpecError when it cannot serve
    the model/batch). `timeline`: the variant that records per-instruction times; `l2_window`:
    the L2 lookahead in bytes per SM (-1: the arch's, 0: none, for an A/B of the lookahead);
    `paged`: a program/paged.PagedKV page pool (the paged build, kernel/paged_index.py);
    `unhandled`: "refuse" (SpecError) a model with opcodes that have no device handler yet, or
    "trap": build without them (a record of one fails the launch), for developing a handler."""
    if batch < 1 or tokens < 1:
        raise SpecError(f"batch and tokens must be >= 1, got batch={batch}, tokens={tokens}")
    if replay_window < 0:
        raise SpecError(f"replay_window must be >= 0 (0: the recurrent update), got "
                        f"{replay_window}")
    replay = replay or replay_window > 0
    if smem_stages is None:
        for stages in range(PIPELINE_STAGES, MIN_PIPELINE_STAGES - 1, -1):
            try:
                return make_spec(cfg, batch, tokens, arch, num_threads, stages, timeline,
                                 l2_window, replay, replay_window, paged, unhandled)
            except SpecError:
                pass
        return make_spec(cfg, batch, tokens, arch, num_threads, 0, timeline, l2_window, replay,
                         replay_window, paged, unhandled)
    from megakernel.models import validate

    validate(cfg)
    if replay_window and not cfg.recurrent_layers():
        raise SpecError(f"replay_window applies to models with recurrent layers; "
                        f"{cfg.name or cfg.family} has none")
    if unhandled not in ("refuse", "trap"):
        raise SpecError(f"unhandled must be 'refuse' or 'trap', got {unhandled!r}")
    check_kernel_support(cfg, replay, unhandled)
    mlp = cfg.kind_config(next(k for k in mlp_kinds() if cfg.has_kind(k)))
    # the layers with a KV (or latent) cache slot, in order (kv_slot)
    attn = tuple(b.layer for b in cfg.blocks if kind_of(b.kind).kv_cache)
    ops = tuple(sorted(op for op in program_ops(cfg, replay)
                       if unhandled == "refuse" or isa.spec(op).device))
    spec = KernelSpec(
        arch=arch, family=cfg.family, hidden=cfg.hidden_size, inter=mlp.intermediate_size,
        vocab=cfg.vocab_size, layers=cfg.num_layers, **attention_constants(cfg),
        norm_one_plus=cfg.norm_kind == "rms_1p",
        gate_off=gate_offset(cfg, batch, tokens), ops=ops, **kind_fields(cfg),
        replay_window=replay_window,
        attn_layers=() if attn == tuple(range(cfg.num_layers)) else attn,
        paged=paged_constants(cfg, batch, tokens, paged),
        eps=float(cfg.rms_norm_eps), batch=batch, tokens=tokens,
        num_threads=num_threads, smem_stages=smem_stages, timeline=timeline,
        l2_window=l2_window)
    spec.validate()
    return spec


def paged_constants(cfg, batch: int, tokens: int, paged) -> tuple[int, ...]:  # noqa: ANN001
    """KernelSpec.paged of a page pool (program/paged.PagedKV; None: () = the contiguous cache):
    the pool's shape and where the program's block table and slot mapping live in i32 (their
    offsets depend on the step shape only, like gate_offset)."""
    if paged is None:
        return ()
    if cfg.recurrent_layers():  # (the program refuses them too: compile_program)
        raise SpecError("the paged build serves stacks of attention layers without recurrent "
                        f"layers ({cfg.name or cfg.family})")
    from megakernel.layers.base import StepShape
    from megakernel.program.buffers import plan_buffers

    i32 = plan_buffers(cfg, StepShape(batch, tokens, paged.max_seq_len, 1, 1, 0, paged)).i32
    return (paged.num_blocks, paged.block_size, paged.max_blocks, i32["block_table"].offset,
            i32["slot_mapping"].offset)


def kind_of(name: str):  # noqa: ANN201 (layers.base.LayerKind)
    from megakernel.layers import kind

    return kind(name)


def kind_fields(cfg, names: bool = False) -> dict:  # noqa: ANN001 (ModelConfig)
    """The KernelSpec fields of the model's layer kinds (LayerKind.spec_field, filled from
    `kernel_constants` of the kind's one config): {"gdn": (...), "mla": (...), ...}; `names`:
    {kind name: spec field} only (no config is read)."""
    from megakernel.layers import all_kinds

    out = {}
    for name, kd in all_kinds().items():
        if kd.spec_field and cfg.has_kind(name):
            if kd.spec_field not in KIND_FIELDS:
                raise SpecError(f"layer kind {name}: spec field {kd.spec_field!r} is not one of "
                                f"{KIND_FIELDS}")
            out[name if names else kd.spec_field] = (
                kd.spec_field if names else kd.kernel_constants(cfg.kind_config(name)))
    return out


# attention fields of a build whose model has no attention layers: no handler reads them (the
# QKV and ATTN_PARTIAL handlers are not compiled in), they only keep the derived sizes defined
NO_ATTENTION = dict(heads=0, kv_heads=1, head_dim=64, qk_norm=False, qkv_bias=False, rope=False,
                    rotary=0, output_gate=False)


def attention_constants(cfg) -> dict:  # noqa: ANN001 (ModelConfig)
    """The KernelSpec attention fields of `cfg` (NO_ATTENTION without attention layers)."""
    if not cfg.has_kind("attention"):
        return dict(NO_ATTENTION)
    att = cfg.kind_config("attention")
    return dict(heads=att.num_heads, kv_heads=att.num_kv_heads, head_dim=att.head_dim,
                qk_norm=att.qk_norm, qkv_bias=att.qkv_bias, rope=att.rotary_dim > 0,
                rotary=att.rotary_dim if att.rotary_dim < att.head_dim else 0,
                output_gate=att.output_gate)


# ---- fingerprint --------------------------------------------------------------------------------
# the device code (a build's cubin is compiled from these); the host-only modules of the folder
# (build, JIT cache, tools) do not change a cubin
KERNEL_SOURCES = tuple(sorted(p.name for p in Path(__file__).parent.glob("*.py")
                              if p.name not in ("__init__.py", "build.py", "jit.py", "tools.py",
                                                "stream.py")))


def source_digest() -> str:
    """sha256 over the device-code sources and the ISA (what the cubin is compiled from)."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        p = here / name
        h.update(name.encode())
        h.update(p.read_bytes() if p.exists() else b"<missing>")
    for pkg in ("isa", "layers"):  # the registry the device code reads its fields from
        for p in sorted((here.parent / pkg).glob("*.py")):
            h.update(f"{pkg}/{p.name}".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def fingerprint(spec: KernelSpec, dsl_version: str) -> str:
    """Key of a compiled kernel: sources + DSL version + arch + static config + ISA version."""
    blob = json.dumps({"sources": source_digest(), "dsl": dsl_version, "spec": spec.to_dict(),
                       "format_version": isa.FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
