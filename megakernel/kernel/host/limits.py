"""The kernel's budgets and fixed layout constants (no DSL): registers, threads and shared memory
per CTA, the GEMV's tile and vector sizes, the weight pipeline's ring, the L2 lookahead window and
the timeline variant's record layout. Every build is checked against them (KernelSpec.validate,
build.check_resources) and the cost model reads the same numbers.
"""

from __future__ import annotations

from megakernel import isa
from megakernel.common.arch import ARCH_SMS, ARCHS, L2_BYTES
from megakernel.common.errors import SpecError

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
# A speculative step's 1 + k rows per sequence take the mma form from 2 rows: the FMA GEMV's
# cost grows with the rows (the cost model puts llama-3.2-1b's 1 + 3 step at 1.90x a plain step
# on FMA, 1.17x on mma); plain builds keep MMA_MIN_ROWS.
MMA_SPEC_MIN_ROWS = 2
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
# (about the same number of bytes again); L2 capacities and SM counts: megakernel/common/arch.py.
PREFETCH_CHUNK = 16 * 1024  # bytes per cp.async.bulk.prefetch.L2 request
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
# one stage: `tile_rows(kc)` rows of a K-chunk of kc weights (bf16, or e4m3 codes of an FP8 slab:
# the same bytes hold twice the weights, so a long-K FP8 tile has twice the rows of a bf16 one;
# a tile never has more rows than warps, so a short-K FP8 tile fills half a stage)
SMEM_STAGE_BYTES = 32 * 1024
PIPELINE_STAGES = 6  # the deepest ring a build takes (192 KiB)
MIN_PIPELINE_STAGES = 2

# ---- speculative steps (layers/speculative.py ACCEPT; the program and the build check it) -----
MAX_DRAFTS = 7  # drafts a speculative step verifies at most (T = 1 + k tokens per sequence)


def step_tokens(tokens: int, drafts: int) -> int:
    """Tokens per sequence of a step: a speculative step (`drafts` k >= 1) verifies the last
    token and its k drafts, so tokens 1 is taken as 1 + k (the program and the build agree)."""
    return 1 + drafts if drafts and tokens == 1 else tokens


# ---- timeline build (KernelSpec.timeline: device/timeline.py writes, measure/timeline.py reads)
# The variant stamps %globaltimer (ns) into one record of TIMELINE_WORDS int64 words per (SM, queue
# position), laid out [num_sms, queue_len, TIMELINE_WORDS] in the tail of the program buffer, right
# after the records [num_sms, queue_len, RECORD_WORDS] int32 (the kernel parameter `program` stays a
# view of the records: the ABI is that of the default build). Consumer thread 0 writes wait_start
# (before the dependency wait), wait_end (after it), finish (after the signal) and the opcode; the
# loader warp (pipelined builds) writes load_start (it reached the slab) and load_end (it has issued
# the slab's last tile). Unwritten words stay as the host zeroed them.
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


def tile_rows(kc: int, num_warps: int, stage_bytes: int = SMEM_STAGE_BYTES,
              wbytes: int = 2) -> int:
    """Weight rows per pipeline tile for K-chunks of `kc` inputs of `wbytes` bytes (2: bf16, 1:
    an FP8 slab): the largest power of two <= the warps per CTA whose rows fit one stage (0 when
    a single row does not fit). The kernel evaluates the same rule at run time
    (Pipeline.tile_rows)."""
    tr = 0
    cand = 1
    while cand <= num_warps and cand * kc * wbytes <= stage_bytes:
        tr = cand
        cand *= 2
    return tr


def prefetch_window(arch: str) -> int:
    """Lookahead L2 prefetch window per SM in bytes (a multiple of PREFETCH_CHUNK):
    192 KiB on sm_90a (132 x 192 KiB = 24.8 MiB of 50 MiB), 432 KiB on sm_100a (148 x 432 KiB =
    62.4 MiB of 126 MiB)."""
    if arch not in L2_BYTES:
        raise SpecError(f"unsupported arch {arch!r}; supported: {', '.join(ARCHS)}")
    w = int(L2_BYTES[arch] * L2_PREFETCH_SHARE) // ARCH_SMS[arch]
    return w // PREFETCH_CHUNK * PREFETCH_CHUNK

