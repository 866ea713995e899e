"""Program compiler: (model, batch, tokens per step, max length, GPU) -> a megakernel program.

A program is what the kernel interprets (isa.py): per-SM instruction queues, the counter table
and the buffer plan. Building one has three parts:
- `plan_buffers`: the offsets of every activation buffer in the typed arenas;
- `stages`: the step as a list of stages (EMBED, then per layer QKV, ATTN_PARTIAL (the last
  split of each (sequence, kv head) also merges), OPROJ, GATEUP, DOWN, then LMHEAD, ARGMAX).
  Each stage has work units (a head, a (sequence, kv head, split), 16 rows of a matrix...) and
  makes the instruction for a unit or a range of units; every instruction waits for the whole
  stage that produces its input (one counter) and signals its own stage's counter;
- the scheduler (schedule.py) cuts divisible stages into one slab per SM and assigns every
  instruction to an SM with the cost model (cost.py) in the loop.

Queues hold their instructions in stage order, and every wait names a counter of an earlier stage,
so a program built here cannot deadlock (`verify.check_program` checks it independently).
Compilation is deterministic: the same inputs give the same records.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megakernel.config import ModelConfig
from megakernel.kernel.spec import MMA_M, MMA_MIN_ROWS, default_build
from megakernel.program import isa
from megakernel.program.gpus import GPU
from megakernel.program.isa import Op
from megakernel.program.pack import WeightLayout, weight_layout


class PlanError(ValueError):
    """A model/batch/GPU combination the program (or the kernel) cannot serve."""


@dataclass
class Instr:
    """One instruction before encoding, with the quantities the cost model needs."""

    op: Op
    layer: int
    operands: dict[str, int]
    wait: int = isa.NO_COUNTER
    signal: int = isa.NO_COUNTER
    stage: int = -1
    # cost attributes (bytes, flops); see cost.py
    w_bytes: int = 0  # streamed before the wait may be met (weights, cached KV)
    l2_bytes: int = 0  # activations read after the wait (L2 hits)
    hbm_bytes: int = 0  # other HBM reads after the wait (embedding rows)
    store_bytes: int = 0
    tensor_flops: float = 0.0
    fp32_flops: float = 0.0
    # ATTN_PARTIAL: the merge the last split of a (sequence, kv head) runs
    merge_l2_bytes: int = 0
    merge_store_bytes: int = 0
    merge_flops: float = 0.0
    # placement
    sm: int = -1
    pos: int = -1


@dataclass
class Counter:
    name: str
    total: int = 0  # increments per step (= number of signalling instructions)


@dataclass(frozen=True)
class Region:
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class BufferPlan:
    """Typed arenas and the regions in them (element offsets; see isa.py)."""

    f32: dict[str, Region]
    bf16: dict[str, Region]
    i32: dict[str, Region]
    f32_numel: int
    bf16_numel: int
    i32_numel: int
    kv_shape: tuple[int, int, int, int, int]  # [L, B, Hkv, S_max, D]

    @property
    def kv_bytes(self) -> int:
        return 2 * 2 * math.prod(self.kv_shape)

    @property
    def scratch_bytes(self) -> int:
        return 4 * self.f32_numel + 2 * self.bf16_numel + 4 * self.i32_numel


@dataclass
class Stage:
    name: str
    op: Op
    layer: int
    units: int
    divisible: bool  # a contiguous unit range may become one instruction (matvec rows)
    make: Callable[[int, int], Instr]  # [u0, u1) -> instruction
    unit_rows: int = 0  # rows per unit (divisible stages)


class QueueProgram:
    """What every compiled program (dense or hybrid) derives from its instructions and queues.

    A subclass is a dataclass with `batch`, `tokens`, `instrs`, `queues` and `counters`; `encode`
    is its instruction set's record encoder.
    """

    encode = staticmethod(isa.encode)

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    @property
    def num_sms(self) -> int:
        return len(self.queues)

    def record(self, i: int) -> list[int]:
        ins = self.instrs[i]
        wait = None
        if ins.wait != isa.NO_COUNTER:
            total = self.counters[ins.wait].total
            wait = (ins.wait, total, total)
        return self.encode(ins.op, wait=wait, signal=ins.signal, layer=ins.layer, **ins.operands)

    def records(self) -> torch.Tensor:
        """int32 [num_sms, max_queue + 1, RECORD_WORDS], END-padded (the kernel's input)."""
        return isa.as_tensor([[self.record(i) for i in q] for q in self.queues])

    def counter_words(self) -> int:
        return isa.COUNTER_BASE + len(self.counters)

    def ops_histogram(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ins in self.instrs:
            out[ins.op.name] = out.get(ins.op.name, 0) + 1
        return out


@dataclass
class Program(QueueProgram):
    cfg: ModelConfig
    batch: int
    tokens: int
    max_seq_len: int
    gpu: GPU
    n_splits: int
    context: int  # tokens per sequence assumed in the cache by the cost model
    layout: WeightLayout
    buffers: BufferPlan
    counters: list[Counter]
    instrs: list[Instr]
    queues: list[list[int]]  # per SM: indices into instrs
    policy: str
    ring_bytes: int = 0  # the kernel build's shared-memory weight ring (spec.build_ring_bytes)
    header: dict[str, int] = field(default_factory=dict)
    cost: object | None = None  # cost.CostReport of the fluid replay (replay.py)
    placement_cost: object | None = None  # the scheduler's own estimate (cost.SimState)



# ---- validation ---------------------------------------------------------------------------------
def validate(cfg: ModelConfig, batch: int, tokens: int, max_seq_len: int, gpu: GPU) -> None:
    """Refuse, by name, what the program or the kernel does not support."""
    if batch < 1:
        raise PlanError(f"batch must be >= 1, got {batch}")
    if tokens < 1:
        raise PlanError(f"tokens per sequence per step must be >= 1, got {tokens}")
    if batch * tokens > isa.MAX_ROWS:
        raise PlanError(
            f"batch * tokens = {batch * tokens} activation rows; the kernel supports at most "
            f"{isa.MAX_ROWS} per step"
        )
    if cfg.head_dim not in isa.SUPPORTED_HEAD_DIMS:
        raise PlanError(
            f"unsupported head_dim {cfg.head_dim}; the kernel supports "
            f"{', '.join(map(str, isa.SUPPORTED_HEAD_DIMS))}"
        )
    for what, v, m in (
        ("hidden_size", cfg.hidden_size, 64),
        ("intermediate_size", cfg.intermediate_size, 64),
        ("vocab_size", cfg.vocab_size, isa.ROW_ALIGN),
    ):
        if v % m:
            raise PlanError(f"{what} = {v} must be a multiple of {m} for the kernel's tiling")
    if not 1 <= max_seq_len <= cfg.max_position_embeddings:
        raise PlanError(
            f"max sequence length {max_seq_len} must be in [1, {cfg.max_position_embeddings}] "
            f"(the model's max_position_embeddings)"
        )
    if tokens > max_seq_len:
        raise PlanError(f"{tokens} tokens per step do not fit a cache of {max_seq_len} positions")
    lay = weight_layout(cfg)
    kv = 2 * 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_seq_len * cfg.head_dim
    need = lay.nbytes + kv
    if need > gpu.memory_bytes:
        raise PlanError(
            f"too many sequences for the cache: {batch} sequences x {max_seq_len} positions need "
            f"{kv / 1e9:.1f} GB of KV cache, plus {lay.nbytes / 1e9:.1f} GB of weights = "
            f"{need / 1e9:.1f} GB > {gpu.memory_bytes / 1e9:.0f} GB on {gpu.name}; lower the "
            f"batch or the max sequence length"
        )


def default_splits(cfg: ModelConfig, batch: int, gpu: GPU, context: int) -> int:
    """Attention splits per (sequence, kv head): about one partial per SM, >= 64 keys each."""
    per = max(1, round(gpu.num_sms / (batch * cfg.num_kv_heads)))
    return max(1, min(per, 16, max(1, context // 64)))


# ---- buffers ------------------------------------------------------------------------------------
def plan_buffers(cfg: ModelConfig, batch: int, tokens: int, max_seq_len: int, n_splits: int,
                 max_lm_tiles: int) -> BufferPlan:
    n, h, hq, d = batch * tokens, cfg.hidden_size, cfg.num_heads, cfg.head_dim

    def arena(items: list[tuple[str, tuple[int, ...]]]) -> tuple[dict[str, Region], int]:
        """Regions start on 64-element boundaries, except that rope_sin directly follows
        rope_cos (the QKV record names one ROPE_OFF: cos at it, sin S_max * D/2 after it)."""
        out, off = {}, 0
        for name, shape in items:
            if name != "rope_sin":
                off = (off + 63) // 64 * 64
            out[name] = Region(off, shape)
            off += math.prod(shape)
        return out, (off + 63) // 64 * 64

    f32, f32_n = arena([
        ("h", (n, h)),
        ("part_o", (n_splits, n, hq, d)),
        ("part_ml", (n_splits, n, hq, 2)),
        ("logits", (n, cfg.vocab_size)),
        ("part_argmax", (max_lm_tiles, n, 2)),
        ("rope_cos", (max_seq_len, d // 2)),
        ("rope_sin", (max_seq_len, d // 2)),
    ])
    bf16, bf16_n = arena([
        ("q", (n, hq, d)),
        ("attn", (n, hq * d)),
        ("act", (n, cfg.intermediate_size)),
    ])
    i32, i32_n = arena([("tokens_in", (n,)), ("tokens_out", (n,)), ("lengths", (batch,))])
    kv = (cfg.num_layers, batch, cfg.num_kv_heads, max_seq_len, d)
    return BufferPlan(f32, bf16, i32, f32_n, bf16_n, i32_n, kv)


F32_CONSTANTS = ("rope_cos", "rope_sin")  # written by the host once; everything else is scratch


def rope_tables(cfg: ModelConfig, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S_max, D/2] fp32 from float64 angles (the reference's recipe, bit for bit)."""
    inv = torch.tensor(cfg.rope.inv_freq(cfg.head_dim), dtype=torch.float64)
    ang = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv
    return ang.cos().to(torch.float32), ang.sin().to(torch.float32)


# ---- stages -------------------------------------------------------------------------------------
class _Counters:
    def __init__(self) -> None:
        self.list: list[Counter] = []
        self.ids: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = len(self.list)
            self.list.append(Counter(name))
        return self.ids[name]


def embed_stage(n: int, hid: int, lay, buf, ctr: _Counters) -> Stage:  # noqa: ANN001
    """EMBED (dense and hybrid programs): h[n] = embedding[tokens_in[n]] for the N activation
    rows, in chunks of <= 32 KiB of gathered bf16; signals counter "embed"."""
    e_rows = max(1, min(n, (32 * 1024) // (2 * hid)))
    c_embed = ctr("embed")
    f32, i32 = buf.f32, buf.i32

    def mk_embed(u0: int, u1: int) -> Instr:
        n0, n1 = u0 * e_rows, min(n, u1 * e_rows)
        return Instr(Op.EMBED, -1, dict(W=lay["embed"].offset, N0=n0, N1=n1, K=hid,
                                        TOK_OFF=i32["tokens_in"].offset, OUT_OFF=f32["h"].offset),
                     signal=c_embed, hbm_bytes=(n1 - n0) * hid * 2, l2_bytes=(n1 - n0) * 4,
                     store_bytes=(n1 - n0) * hid * 4)

    return Stage("embed", Op.EMBED, -1, -(-n // e_rows), False, mk_embed)


def stages(cfg: ModelConfig, batch: int, tokens: int, n_splits: int, context: int,
           lay: WeightLayout, buf: BufferPlan, ctr: _Counters, mma: bool = True,
           passes: int = 1) -> list[Stage]:
    """The step as stages in execution order (see the module docstring). `mma`: the kernel's
    GEMV runs on tensor cores (spec.KernelSpec.mma), else on FMA (the cost model's compute).
    `passes`: the build's passes over the activation rows (spec.KernelSpec.passes); a matvec
    streams its slab once per pass, the passes after the first read it again through L2."""
    reread = passes - 1
    n, hid, inter, d = batch * tokens, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv, g, v = cfg.num_heads, cfg.num_kv_heads, cfg.group_size, cfg.vocab_size
    f32, bf, i32 = buf.f32, buf.bf16, buf.i32
    ra = isa.ROW_ALIGN
    npad = -(-n // MMA_M) * MMA_M  # mma.sync: activation rows in blocks of 16 (A operand)
    out: list[Stage] = []

    def matvec_flops(rows: int, k: int) -> dict[str, float]:
        if mma:
            return {"tensor_flops": 2.0 * npad * rows * k}
        return {"fp32_flops": 2.0 * n * rows * k}

    out.append(embed_stage(n, hid, lay, buf, ctr))
    prev = ctr("embed")
    ctx_keys = context + tokens  # keys per sequence seen by the cost model
    keys_split = -(-ctx_keys // n_splits)

    for layer in range(cfg.num_layers):
        qkv_e = lay.layer(layer, "qkv")
        slots = g + 2  # head slots per group

        def mk_qkv(u0: int, u1: int, layer=layer, qkv_e=qkv_e, wait=prev, slots=slots) -> Instr:
            grp = u0 // slots
            assert (u1 - 1) // slots == grp, "a QKV slab must stay within one kv group"
            rows = (u1 - u0) * d
            qkn = lay.layer(layer, "qk_norm").offset if cfg.qk_norm else -1
            return Instr(Op.QKV, layer, dict(
                W=qkv_e.offset + u0 * d * hid, ROW0=u0 * d, NROWS=rows, K=hid,
                NORM_OFF=lay.layer(layer, "attn_norm").offset, IN_OFF=f32["h"].offset,
                OUT_OFF=bf["q"].offset, QK_NORM_OFF=qkn, ROPE_OFF=f32["rope_cos"].offset),
                wait=wait, signal=ctr(f"L{layer}.qkv.g{grp}"),
                w_bytes=rows * hid * 2, l2_bytes=n * hid * 4 + hid * 2 + reread * rows * hid * 2,
                store_bytes=n * rows * 2, **matvec_flops(rows, hid))

        out.append(Stage(f"L{layer}.qkv", Op.QKV, layer, hkv * slots, False, mk_qkv))

        c_attn = ctr(f"L{layer}.attn")

        def mk_part(u0: int, u1: int, layer=layer, c_attn=c_attn) -> Instr:
            b, rest = divmod(u0, hkv * n_splits)
            kvh, s = divmod(rest, n_splits)
            cached = max(0, min(keys_split, context - s * keys_split))
            return Instr(Op.ATTN_PARTIAL, layer, dict(
                B_IDX=b, KV_HEAD=kvh, SPLIT=s, N_SPLITS=n_splits, Q_OFF=bf["q"].offset,
                PO_OFF=f32["part_o"].offset, PML_OFF=f32["part_ml"].offset,
                LEN_OFF=i32["lengths"].offset, OUT_OFF=bf["attn"].offset, DONE_CID=c_attn),
                wait=ctr(f"L{layer}.qkv.g{kvh}"), signal=ctr(f"L{layer}.part.b{b}.g{kvh}"),
                w_bytes=cached * d * 4, l2_bytes=tokens * g * d * 2 + tokens * d * 4,
                store_bytes=tokens * g * (d + 2) * 4,
                fp32_flops=4.0 * tokens * g * keys_split * d,
                merge_l2_bytes=n_splits * tokens * g * (d + 2) * 4,
                merge_store_bytes=tokens * g * d * 2,
                merge_flops=4.0 * n_splits * tokens * g * d)

        out.append(Stage(f"L{layer}.attn_partial", Op.ATTN_PARTIAL, layer,
                         batch * hkv * n_splits, False, mk_part))
        c_o = ctr(f"L{layer}.oproj")

        def mk_o(u0: int, u1: int, layer=layer, c_attn=c_attn, c_o=c_o) -> Instr:
            r0, rows, k = u0 * ra, (u1 - u0) * ra, hq * d
            return Instr(Op.OPROJ, layer, dict(
                W=lay.layer(layer, "o").offset + r0 * k, ROW0=r0, NROWS=rows, K=k, NORM_OFF=-1,
                IN_OFF=bf["attn"].offset, OUT_OFF=f32["h"].offset),
                wait=c_attn, signal=c_o, w_bytes=rows * k * 2,
                l2_bytes=n * k * 2 + n * rows * 4 + reread * rows * k * 2,
                store_bytes=n * rows * 4, **matvec_flops(rows, k))

        out.append(Stage(f"L{layer}.oproj", Op.OPROJ, layer, hid // ra, True, mk_o, ra))
        c_gu = ctr(f"L{layer}.gateup")
        gu_rows = 2 * isa.GATEUP_BLOCK

        def mk_gu(u0: int, u1: int, layer=layer, c_o=c_o, c_gu=c_gu, gu_rows=gu_rows) -> Instr:
            r0, rows = u0 * gu_rows, (u1 - u0) * gu_rows
            return Instr(Op.GATEUP, layer, dict(
                W=lay.layer(layer, "gateup").offset + r0 * hid, ROW0=r0, NROWS=rows, K=hid,
                NORM_OFF=lay.layer(layer, "mlp_norm").offset, IN_OFF=f32["h"].offset,
                OUT_OFF=bf["act"].offset),
                wait=c_o, signal=c_gu, w_bytes=rows * hid * 2,
                l2_bytes=n * hid * 4 + hid * 2 + reread * rows * hid * 2,
                store_bytes=n * rows, **matvec_flops(rows, hid))

        out.append(Stage(f"L{layer}.gateup", Op.GATEUP, layer, 2 * inter // gu_rows, True, mk_gu,
                         gu_rows))
        c_dn = ctr(f"L{layer}.down")

        def mk_down(u0: int, u1: int, layer=layer, c_gu=c_gu, c_dn=c_dn) -> Instr:
            r0, rows = u0 * ra, (u1 - u0) * ra
            return Instr(Op.DOWN, layer, dict(
                W=lay.layer(layer, "down").offset + r0 * inter, ROW0=r0, NROWS=rows, K=inter,
                NORM_OFF=-1, IN_OFF=bf["act"].offset, OUT_OFF=f32["h"].offset),
                wait=c_gu, signal=c_dn, w_bytes=rows * inter * 2,
                l2_bytes=n * inter * 2 + n * rows * 4 + reread * rows * inter * 2,
                store_bytes=n * rows * 4,
                **matvec_flops(rows, inter))

        out.append(Stage(f"L{layer}.down", Op.DOWN, layer, hid // ra, True, mk_down, ra))
        prev = c_dn

    c_lm = ctr("lmhead")
    lm = lay.lm_head

    def mk_lm(u0: int, u1: int, wait=prev) -> Instr:
        r0, rows = u0 * ra, (u1 - u0) * ra
        t = -1  # numbered after scheduling (`number_lm_tiles`)
        return Instr(Op.LMHEAD, -1, dict(
            W=lm.offset + r0 * hid, ROW0=r0, NROWS=rows, K=hid, NORM_OFF=lay["final_norm"].offset,
            IN_OFF=f32["h"].offset, OUT_OFF=f32["logits"].offset, TILE=t,
            PARG_OFF=f32["part_argmax"].offset),
            wait=wait, signal=c_lm, w_bytes=rows * hid * 2,
            l2_bytes=n * hid * 4 + hid * 2 + reread * rows * hid * 2,
            store_bytes=n * rows * 4 + n * 8, **matvec_flops(rows, hid))

    out.append(Stage("lmhead", Op.LMHEAD, -1, v // ra, True, mk_lm, ra))
    flags = isa.FLAG_ADVANCE | (isa.FLAG_FEEDBACK if tokens == 1 else 0)

    def mk_argmax(u0: int, u1: int) -> Instr:
        nt = -(-v // ra)  # upper bound for the cost model; set by `number_lm_tiles`
        return Instr(Op.ARGMAX, -1, dict(
            N_TILES=nt, PARG_OFF=f32["part_argmax"].offset, OUT_OFF=i32["tokens_out"].offset,
            TOK_OFF=i32["tokens_in"].offset, LEN_OFF=i32["lengths"].offset, FLAGS=flags),
            wait=c_lm, l2_bytes=nt * n * 8, store_bytes=n * 8 + batch * 4)

    out.append(Stage("argmax", Op.ARGMAX, -1, 1, False, mk_argmax))
    return out


# ---- the compiler -------------------------------------------------------------------------------
def compile_program(
    cfg: ModelConfig,
    batch: int,
    gpu: GPU,
    tokens: int = 1,
    max_seq_len: int | None = None,
    context: int | None = None,
    n_splits: int | None = None,
    policy: str = "cost",
    params=None,  # noqa: ANN001 (cost.CostParams)
) -> Program:
    """Compile one decode step. `context` (cached tokens per sequence) only feeds the cost model
    and the split heuristic; the program itself serves any lengths with lengths[b] + T <= S_max.
    """
    from megakernel.program import cost, schedule  # local: schedule imports this module
    from megakernel.program.replay import replay

    if max_seq_len is None:
        max_seq_len = min(cfg.max_position_embeddings, 4096)
    validate(cfg, batch, tokens, max_seq_len, gpu)
    if context is None:
        context = min(1024, max_seq_len - tokens)
    if not 0 <= context <= max_seq_len - tokens:
        raise PlanError(
            f"context {context} + {tokens} new tokens does not fit max sequence length "
            f"{max_seq_len}"
        )
    if n_splits is None:
        n_splits = default_splits(cfg, batch, gpu, context)
    if n_splits < 1:
        raise PlanError(f"n_splits must be >= 1, got {n_splits}")
    lay = weight_layout(cfg)
    buf = plan_buffers(cfg, batch, tokens, max_seq_len, n_splits, gpu.num_sms)
    ctr = _Counters()
    spec = default_build(cfg, batch, tokens, gpu.arch)  # the kernel build the program runs on
    mma = spec.mma if spec else batch * tokens >= MMA_MIN_ROWS
    passes = spec.passes if spec else 1
    stage_list = stages(cfg, batch, tokens, n_splits, context, lay, buf, ctr, mma, passes)
    ring = spec.ring_bytes if spec else 0  # the build's weight ring
    best = None
    for instrs, queues, state in schedule.candidates(stage_list, gpu, policy, params, ring):
        number_lm_tiles(instrs, gpu.num_sms)
        counters = [Counter(c.name) for c in ctr.list]
        for ins in instrs:
            if ins.signal != isa.NO_COUNTER:
                counters[ins.signal].total += 1
            if ins.op == Op.ATTN_PARTIAL and ins.operands["SPLIT"] == 0:
                counters[ins.operands["DONE_CID"]].total += 1  # one merge per (seq, kv head)
        prog = Program(cfg, batch, tokens, max_seq_len, gpu, n_splits, context, lay, buf,
                       counters, instrs, queues, policy, ring)
        prog.header = make_header(prog)
        if state is not None:
            prog.cost = replay(prog, params)
            prog.placement_cost = cost.report(state, instrs, gpu, cost.kv_written_bytes(prog))
        if best is None or (prog.cost is not None
                            and prog.cost.predicted_s < best.cost.predicted_s):
            best = prog
    return best


def number_lm_tiles(instrs: list[Instr], num_slots: int) -> None:
    """Partial-argmax slots: LMHEAD instructions in program order; ARGMAX merges them all."""
    lm = [i for i in instrs if i.op == Op.LMHEAD]
    if len(lm) > num_slots:
        raise PlanError(f"{len(lm)} LM-head slabs > {num_slots} partial-argmax slots")
    for t, ins in enumerate(lm):
        ins.operands["TILE"] = t
    for ins in instrs:
        if ins.op == Op.ARGMAX:
            ins.operands["N_TILES"] = len(lm)


def make_header(p: Program) -> dict[str, int]:
    """Sizes and base offsets (int32 each) the kernel may take as constants or parameters."""
    c, b = p.cfg, p.buffers
    eps_bits = struct.unpack("<i", struct.pack("<f", c.rms_norm_eps))[0]
    hdr = dict(
        FORMAT_VERSION=isa.FORMAT_VERSION, NUM_SMS=p.num_sms,
        MAX_QUEUE=max((len(q) for q in p.queues), default=0) + 1,
        NUM_COUNTER_WORDS=p.counter_words(), B=p.batch, T=p.tokens, N=p.rows,
        L=c.num_layers, H=c.hidden_size, I=c.intermediate_size, V=c.vocab_size, HQ=c.num_heads,
        HKV=c.num_kv_heads, D=c.head_dim, S_MAX=p.max_seq_len, N_SPLITS=p.n_splits,
        QK_NORM=int(c.qk_norm), EPS_F32_BITS=eps_bits,
        N_LM_TILES=sum(1 for i in p.instrs if i.op == Op.LMHEAD),
        F32_NUMEL=b.f32_numel, BF16_NUMEL=b.bf16_numel, I32_NUMEL=b.i32_numel,
    )
    for arena, regions in (("F32", b.f32), ("BF16", b.bf16), ("I32", b.i32)):
        for name, r in regions.items():
            hdr[f"{arena}_{name.upper()}_OFF"] = r.offset
    for k, v in hdr.items():
        if not -(1 << 31) <= v < (1 << 31):
            raise PlanError(f"header field {k}={v} does not fit in int32")
    return hdr
