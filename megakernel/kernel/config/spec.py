"""Static configuration of one megakernel build and its parameter ABI (no DSL).

A build is specialised on (model shapes, batch B, tokens per step T, arch): everything the device
code treats as a compile-time constant is in `KernelSpec`. What varies per launch (the program,
the buffers, S_max, the queue length) is a kernel parameter. The parameter list is plain (global
pointers and 32-bit integers) so that the manifest can be checked against the PTX `.entry`
signature and the runtime can launch the cubin with the driver API alone.

The model's layer kinds declare what a build bakes in for them (layers/base.py, "kernel" hooks):
their constants (`KernelSpec.kinds`), their handlers' index shapes, their checks and matrices. This
module reads those declarations generically; model_spec.py makes a spec from a model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.common.errors import SpecError
from megakernel.kernel.host.dense_index import attn_tensor_cores
from megakernel.kernel.host.fp8_index import FP8_K_ALIGN, GRANULARITIES, chunk_inputs, weight_bytes
from megakernel.kernel.host.limits import (
    ACC_SMEM_BYTES,
    ARGMAX_EXACT,
    LANES,
    MMA_K_ALIGN,
    MMA_M,
    MMA_MIN_ROWS,
    MMA_N,
    MMA_SPEC_MIN_ROWS,
    MMA_X_PAD,
    NUM_THREADS,
    PIPELINE_STAGES,
    PREFETCH_CHUNK,
    ROW_CHUNK,
    SMEM_BUDGET,
    SMEM_STAGE_BYTES,
    VEC,
    X_SMEM_BYTES,
    prefetch_window,
    tile_rows,
)


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


@dataclass(frozen=True)
class KernelSpec:
    """Compile-time constants of the device code."""

    arch: str
    family: str
    hidden: int  # H
    vocab: int  # V
    layers: int  # L
    eps: float
    batch: int  # B
    tokens: int  # T
    # (kind name, its LayerKind.kernel_constants) for every layer kind of the model, by name:
    # what the build bakes in for each (spec.constants(name); the attention and feed-forward
    # shapes below are read from theirs)
    kinds: tuple[tuple[str, tuple[int, ...]], ...] = ()
    norm_one_plus: bool = False  # every RMSNorm weight is applied as (1 + w) (header NORM_KIND 1)
    # f32 offset of the output gate buffer [N, Hq, D] (header F32_GATE_OFF; -1: no output gate):
    # a step-shape region, so a compile-time constant of the build (model_spec.gate_offset)
    gate_off: int = -1
    # the opcodes the model's program uses (model_spec.program_ops): the build compiles in only
    # their handlers and epilogues
    ops: tuple[int, ...] = ()
    # the decoder layers with a KV (or latent) cache slot, in order (kv_slot); () = every layer
    attn_layers: tuple[int, ...] = ()
    # ReplaySSM fold window L (program header REPLAY_WINDOW, checked by launch.checks.check_header):
    # the recurrent layers run their kinds' REPLAY ops with rings of L - 1 + T entries; 0 = the
    # recurrent update
    replay_window: int = 0
    # a speculative step (layers/speculative.py; program header DRAFTS, NGRAM): k drafts a step
    # (tokens = 1 + k), ACCEPT in place of ARGMAX and the recurrent kinds' COMMIT records; 0 = a
    # plain step. `ngram`: the device drafter's longest suffix (NGRAM records; 0: host drafts)
    drafts: int = 0
    ngram: int = 0
    # paged KV (kernel/host/paged_index.py): (num_blocks, block_size, max_blocks, block table and
    # slot mapping i32 offsets); () = the contiguous cache [slots, B, Hkv, S_max, D]
    paged: tuple[int, ...] = ()
    # FP8 weight slabs (docs/FP8.md, "Kernel"): "" = bf16 weights; "channel" or "block" = e4m3
    # slabs with that scale granularity (models/fp8.Fp8Format): every matvec opcode of the build
    # reads FP8 slabs except LMHEAD, which does only with `fp8_lm_head` (an untied head quantized)
    fp8: str = ""
    fp8_lm_head: bool = False
    num_threads: int = NUM_THREADS  # consumer threads (the loader warp of a pipeline is extra)
    smem_stages: int = PIPELINE_STAGES  # 0: weights from global; >= 2: smem ring (limits.py)
    timeline: bool = False  # the variant that stamps per-instruction times (TIMELINE_FIELDS)
    l2_window: int = -1  # L2 lookahead bytes per SM; -1: the arch's (prefetch_window), 0: none

    # ---- the layer kinds' declarations --------------------------------------------------------
    def has(self, kind: str) -> bool:
        """The model has layers of `kind`."""
        return any(name == kind for name, _ in self.kinds)

    def constants(self, kind: str) -> tuple[int, ...]:
        """What the build bakes in for `kind` (its kernel_constants; () when the model has
        none of its layers)."""
        return next((tuple(c) for name, c in self.kinds if name == kind), ())

    def layer_kinds(self) -> list[Any]:
        """The model's LayerKind classes, by name."""
        from megakernel.layers import kind

        return [kind(name) for name, _ in self.kinds]

    def shape(self, kind: str) -> Any:  # noqa: ANN401 (a kernel/*_index shape)
        """The index arithmetic of `kind`'s handlers for this build (LayerKind.kernel_shape;
        None: no such layers, or a kind whose handlers have none)."""
        from megakernel.layers import kind as kind_of

        return kind_of(kind).kernel_shape(self) if self.has(kind) else None

    def matvec_shapes(self) -> dict[int, list[tuple[int, int]]]:
        """Matvec opcode -> the (K, rows) of every matrix its records stream in this build: the
        LM head's, then each kind's (LayerKind.matvec_shapes)."""
        from megakernel.layers.frame import padded_vocab

        out: dict[int, list[tuple[int, int]]] = {
            int(isa.Op.LMHEAD): [(self.hidden, padded_vocab(self.vocab))]}
        for kd in self.layer_kinds():
            for name, mats in kd.matvec_shapes(self).items():
                have = out.setdefault(int(getattr(isa.Op, name)), [])
                have += [m for m in mats if m not in have]
        return out

    # ---- the weight format (fp8_index.py) -----------------------------------------------------
    @property
    def quant(self):  # noqa: ANN201 (models.fp8.Fp8Format | None)
        """The model's FP8 format as the build bakes it in (None: bf16 weights): what places
        expert x + 1 after expert x (moe_index.x_stride) and how many scales a row has."""
        if not self.fp8:
            return None
        from megakernel.models.fp8 import Fp8Format

        return Fp8Format(self.fp8, lm_head=self.fp8_lm_head)

    @property
    def fp8_ops(self) -> tuple[int, ...]:
        """The handled matvec opcodes whose slabs are FP8: all of them in an FP8 build but
        LMHEAD (unless fp8_lm_head); () in a bf16 build."""
        if not self.fp8:
            return ()
        return tuple(op for op in self.ops if isa.spec(op).matvec is not None
                     and (op != isa.Op.LMHEAD or self.fp8_lm_head))

    def weight_bytes(self, op: int) -> int:
        """Bytes per weight of `op`'s slabs: 1 (FP8 codes) or 2 (bf16)."""
        return weight_bytes(op in self.fp8_ops)

    @property
    def fp8_chunk(self) -> int:
        """Inputs per scale: 0 = one per row (channel), SCALE_CHUNK (block)."""
        return chunk_inputs(self.fp8)

    # attention's constants (layers/attention.py kernel_constants); without attention layers
    # placeholders that no compiled handler reads and that keep the derived sizes defined
    NO_ATTENTION = (0, 1, 64, 0, 0, 0, 0)

    @property
    def _attention(self) -> tuple[int, ...]:
        return self.constants("attention") or self.NO_ATTENTION

    heads = property(lambda self: self._attention[0])  # Hq
    kv_heads = property(lambda self: self._attention[1])  # Hkv
    head_dim = property(lambda self: self._attention[2])  # D
    qk_norm = property(lambda self: bool(self._attention[3]))
    qkv_bias = property(lambda self: bool(self._attention[4]))  # the bias follows the matrix
    rotary_dim = property(lambda self: self._attention[5])  # R: RoPE dims per q/k head (0: none)
    output_gate = property(lambda self: bool(self._attention[6]))  # q_proj holds [q | gate]
    rope = property(lambda self: self.rotary_dim > 0)
    # partial RoPE on the first `rotary` dims of each head; 0: all of them (or none)
    rotary = property(lambda self: self.rotary_dim if self.rotary_dim < self.head_dim else 0)

    @property
    def inter(self) -> int:
        """I: the intermediate size of the model's one feed-forward kind (layers/mlp.py)."""
        from megakernel.layers.mlp import MLPKind

        return next((self.constants(kd.name)[0] for kd in self.layer_kinds()
                     if issubclass(kd, MLPKind)), 0)

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
        return self.ops

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
        least = MMA_SPEC_MIN_ROWS if self.drafts else MMA_MIN_ROWS
        return (self.pipelined and self.rows >= least and self.num_warps == MMA_N
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
        """Every K a matvec of the build has (matvec_shapes), H first."""
        ks = [self.hidden]
        for mats in self.matvec_shapes().values():
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

    @property
    def attn_tensor_cores(self) -> bool:
        """ATTN_PARTIAL on tensor cores (dense_index.attn_tensor_cores; device/attention_mma.py)."""
        return (int(isa.Op.ATTN_PARTIAL) in self.ops
                and attn_tensor_cores(self.head_dim, self.group, self.tokens,
                                      tight=self.paged_shape is not None or not self.pipelined,
                                      recurrent=any(kd.recurrent for kd in self.layer_kinds()),
                                      num_warps=self.num_warps))

    @property
    def ring_cap(self) -> int:
        """ReplaySSM ring entries per (layer, sequence) (header RING_CAP): L - 1 + T; 0 without
        a window (compiler.compile_program's ring_cap)."""
        return self.replay_window - 1 + self.tokens if self.replay_window else 0

    @property
    def paged_shape(self):  # noqa: ANN201 (paged_index.PagedShape | None)
        """The paged cache's index arithmetic for this build (None: the contiguous cache)."""
        from megakernel.kernel.host.paged_index import PagedShape

        return PagedShape.of(self.paged, self.kv_heads, self.head_dim) if self.paged else None

    @property
    def recurrent_smem_bytes(self) -> int:
        """Shared memory the kinds' own handlers use (recurrent cores, latent attention; the
        largest of the model's kinds, from their index shapes' `smem()`): a span from the start
        of the carve-up over the consumers' regions (x, acc, ..., none live across records)."""
        shapes = (kd.kernel_shape(self) for kd in self.layer_kinds())
        return max((4 * s.smem()["words"] for s in shapes if s is not None), default=0)

    @property
    def rstd_rows(self) -> int:
        """Rows of the `rstd` region: a pass's NO (the matvec prologue), all N rows where the build
        handles ROUTER_SCORE (its RMSNorm keeps every row's), at least 32."""
        return max(self.no, self.rows if isa.Op.ROUTER_SCORE in self.ops else 0, 32)

    # shared memory carve-up (bytes, every region 128-byte aligned)
    def smem_regions(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, bytes)."""
        d, nw = self.head_dim, self.num_warps
        sizes = [
            ("x", 2 * self.no * self.x_stride),  # bf16 [NO, KC] (rows x_stride apart)
            ("acc", 4 * self.acc_words),  # fp32 [ks][n][row]
            ("rstd", 4 * self.rstd_rows),  # fp32 per activation row
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
                # full[S], empty[S], done mbarriers, the loader's tile count (int64 slot), the
                # last expert record it bound (int32, pipeline.Pipeline.bound_word)
                ("mbar", 8 * (2 * self.smem_stages + 3)),
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
        if self.vocab > ARGMAX_EXACT:
            raise SpecError(f"vocab_size {self.vocab} > {ARGMAX_EXACT}: the partial argmax "
                            f"carries vocab indices as fp32, exact only up to 2^24")
        if self.rows > isa.MAX_ROWS:
            raise SpecError(f"batch * tokens = {self.rows} > {isa.MAX_ROWS} rows per step")
        if self.fp8 and self.fp8 not in GRANULARITIES:
            raise SpecError(f"fp8 must be '' (bf16 weights) or one of {', '.join(GRANULARITIES)}, "
                            f"got {self.fp8!r}")
        if self.fp8_lm_head and not self.fp8:
            raise SpecError("fp8_lm_head needs an FP8 build (fp8 'channel' or 'block')")
        for op, mats in self.matvec_shapes().items():
            for k, _ in mats:
                if k % VEC:
                    raise SpecError(f"{isa.spec(op).name}'s K = {k} must be a multiple of {VEC} "
                                    "(16-byte loads)")
                if op in self.fp8_ops and k % FP8_K_ALIGN:
                    raise SpecError(f"{isa.spec(op).name}'s K = {k}: an FP8 slab's K must be a "
                                    f"multiple of {FP8_K_ALIGN} (16-byte bulk copies of rows)")
        if self.num_threads % LANES or not 64 <= self.num_threads <= 1024:
            raise SpecError(f"num_threads must be a multiple of 32 in [64, 1024], "
                            f"got {self.num_threads}")
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
        if self.mma and any(tile_rows(min(self.k_chunk, k), self.num_warps,
                                      wbytes=self.weight_bytes(op)) != MMA_N
                            for op, mats in self.matvec_shapes().items() for k, _ in mats):
            raise SpecError(f"the mma GEMV needs ring tiles of {MMA_N} weight rows")
        if self.smem_bytes > SMEM_BUDGET:
            raise SpecError(f"the kernel needs {self.smem_bytes} B of shared memory > budget "
                            f"{SMEM_BUDGET}")
        for kd in self.layer_kinds():  # the kinds' own limits (head dims, RoPE, state tiles, ..)
            why = kd.kernel_check(self)
            if why:
                raise SpecError(why)
        from megakernel.layers import all_kinds

        replay_codes = {k.replay_op for k in all_kinds().values() if k.recurrent}
        replay_ops = [isa.spec(op).name for op in self.ops if op in replay_codes]
        if replay_ops and self.replay_window < 1:
            raise SpecError(f"{', '.join(replay_ops)} fold their rings every replay_window "
                            "tokens: a ReplaySSM build needs replay_window >= 1")
        if self.drafts or self.ngram:
            from megakernel.kernel.host.speculative_index import check_speculative

            why = check_speculative(self)
            if why:
                raise SpecError(why)
        if self.paged:
            from megakernel.kernel.host.paged_index import PAGED_FIELDS, check_paged

            if len(self.paged) != len(PAGED_FIELDS):
                raise SpecError(f"paged must be ({', '.join(PAGED_FIELDS)}), got {self.paged}")
            if check_paged(self.paged_shape):
                raise SpecError(check_paged(self.paged_shape))

    # ---- identity ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-native (the tuples as lists): what a manifest holds."""
        return {k: _thaw(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> KernelSpec:
        """From to_dict (or its JSON: the tuples come back as lists)."""
        return cls(**{k: _freeze(v) for k, v in d.items()})

    @property
    def tag(self) -> str:
        """Short name of the static config, used in file names: the main shapes, then a digest of
        every other constant of the model (layer pattern, handled opcodes, norms, recurrent
        shapes) that a build bakes in; the variants (arch, threads, ring, l2 window) are not in
        it (a build set keeps them apart)."""
        rest = {k: v for k, v in self.to_dict().items()
                if k not in ("arch", "num_threads", "smem_stages", "timeline", "l2_window")}
        digest = hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:8]
        return (f"{self.family}-h{self.hidden}-i{self.inter}-v{self.vocab}-l{self.layers}"
                f"-q{self.heads}-kv{self.kv_heads}-d{self.head_dim}-b{self.batch}-t{self.tokens}"
                f"-{digest}" + (f"-fp8{self.fp8[0]}" if self.fp8 else "")
                + ("-timeline" if self.timeline else ""))


def _freeze(v: Any) -> Any:  # noqa: ANN401
    """JSON lists back to the spec's (nested) tuples."""
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


def _thaw(v: Any) -> Any:  # noqa: ANN401
    """The spec's (nested) tuples as JSON lists."""
    return [_thaw(x) for x in v] if isinstance(v, (list, tuple)) else v


def as_spec(spec: KernelSpec | dict) -> KernelSpec:
    """A KernelSpec from itself or from a manifest's spec dict (runtime checks take either)."""
    return spec if isinstance(spec, KernelSpec) else KernelSpec.from_dict(spec)
