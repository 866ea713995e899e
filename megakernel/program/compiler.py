"""Program compiler: (model, batch, tokens per step, max length, GPU) -> a megakernel program.

A program is what the kernel interprets (megakernel/isa): per-SM instruction queues, the counter
table and the buffer plan. One compiler serves every family:
- `plan_buffers` (buffers.py): every region the model's blocks need, the caches, the state;
- the stages: EMBED, then each block's stages (its layer kind's `stages`, the first waiting on the
  previous block's last counter), then the LM head and ARGMAX (layers/frame.py);
- the scheduler (schedule.py) cuts divisible stages into one slab per SM and assigns every
  instruction to an SM with the cost model (cost.py) in the loop; each candidate schedule is
  replayed (replay.py) and the fastest kept.

Queues hold their instructions in stage order, and every wait names a counter of an earlier stage,
so a program built here cannot deadlock (`verify.check_program` checks it independently).
Compilation is deterministic: the same inputs give the same records.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field

import torch

from megakernel import isa
from megakernel.isa.stages import Counter, Counters, Instr, PlanError, Stage
from megakernel.kernel.host.limits import MAX_DRAFTS, step_tokens
from megakernel.layers import kind
from megakernel.layers.base import StepShape, partial_argmax_bytes
from megakernel.layers.frame import embed_stage, head_stages
from megakernel.models import ConfigError
from megakernel.models import validate as validate_model
from megakernel.program.buffers import BufferPlan, plan_buffers
from megakernel.program.gpus import GPU
from megakernel.program.pack import WeightLayout, weight_layout
from megakernel.program.paged import PagedKV

__all__ = ["BuildContext", "PlanError", "Program", "compile_program", "default_splits",
           "validate"]

MMA_M = 16  # rows per tensor-core mma (kernel/config/spec.py MMA_M): the cost model's padding


@dataclass
class Program:
    cfg: object  # ModelConfig
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
    replay_window: int | None = None
    ring_bytes: int = 0  # the kernel build's shared-memory weight ring (spec.build_ring_bytes)
    drafts: int = 0  # a speculative step's drafts k (tokens = 1 + k); 0: a plain step
    ngram: int = 0  # the device n-gram drafter's longest suffix; 0: the host writes the drafts
    header: dict[str, int] = field(default_factory=dict)
    cost: object | None = None  # cost.CostReport of the fluid replay (replay.py)
    placement_cost: object | None = None  # the scheduler's own estimate (cost.SimState)

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
        return isa.encode(ins.op, wait=wait, signal=ins.signal, layer=ins.layer, **ins.operands)

    def records(self) -> torch.Tensor:
        """int32 [num_sms, max_queue + 1, RECORD_WORDS], END-padded (the kernel's input); a copy
        of the records encoded once, so callers may edit theirs."""
        return self._encoded.clone()

    @functools.cached_property
    def _encoded(self) -> torch.Tensor:
        return isa.as_tensor([[self.record(i) for i in q] for q in self.queues])

    def counter_words(self) -> int:
        return isa.COUNTER_BASE + len(self.counters)

    def ops_histogram(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ins in self.instrs:
            name = isa.spec(ins.op).name
            out[name] = out.get(name, 0) + 1
        return out

    def step_shape(self) -> StepShape:
        return StepShape(self.batch, self.tokens, self.max_seq_len, self.n_splits, self.num_sms,
                         self.buffers.ring_cap, self.buffers.paged, self.drafts)


@dataclass
class BuildContext:
    """What a layer kind's stage builder reads: the step's shape, the layout, the buffers, the
    counters, and the kernel build the program runs on (mma: tensor-core GEMV; passes over the
    activation rows)."""

    model: object
    batch: int
    tokens: int
    context: int
    n_splits: int
    replay_window: int | None
    lay: WeightLayout
    buf: BufferPlan
    ctr: Counters
    mma: bool = True
    passes: int = 1
    drafts: int = 0  # Program.drafts
    ngram: int = 0  # Program.ngram

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    def matvec_flops(self, rows: int, k: int) -> dict[str, float]:
        if self.mma:
            npad = -(-self.rows // MMA_M) * MMA_M  # activation rows in blocks of 16
            return {"tensor_flops": 2.0 * npad * rows * k}
        return {"fp32_flops": 2.0 * self.rows * rows * k}

    def matvec(self, op: int, layer: int, w_off: int, r0: int, rows: int, k: int, norm_off: int,
               in_off: int, out_off: int, wait: int, signal: int, store: int,
               residual: bool = False, **extra: int) -> Instr:
        """A matvec record over rows [r0, r0 + rows) of the matrix at `w_off` ([*, k]) with the
        cost model's bytes: the slab once per pass (later passes re-read it through L2), the
        input (fp32 h plus the norm weight, or a bf16 activation), the residual read."""
        n, reread = self.rows, self.passes - 1
        mat = self.lay.entry_at(w_off)  # bf16 or fp8 (with its scales): pack.Entry
        slab = rows * mat.row_bytes(k)
        l2 = n * k * 4 + k * 2 if norm_off >= 0 else n * k * 2
        l2 += (n * rows * 4 if residual else 0) + reread * slab
        return Instr(op, layer, dict(W=mat.w(r0), ROW0=r0, NROWS=rows, K=k, NORM_OFF=norm_off,
                                     IN_OFF=in_off, OUT_OFF=out_off, **extra),
                     wait=wait, signal=signal, w_bytes=slab, l2_bytes=l2,
                     # an FP8 slab is converted once per pass over the activation rows
                     converted=rows * k * self.passes if mat.dtype == "fp8" else 0,
                     store_bytes=store, **self.matvec_flops(rows, k))


# ---- validation ---------------------------------------------------------------------------------
def validate(cfg, batch: int, tokens: int, max_seq_len: int, gpu: GPU,  # noqa: ANN001
             replay_window: int | None = None, drafts: int = 0, ngram: int = 0) -> None:
    """Refuse, by name, what the program or the kernel does not support."""
    if isinstance(drafts, bool) or not isinstance(drafts, int) or not 0 <= drafts <= MAX_DRAFTS:
        raise PlanError(f"a speculative step verifies 1 to {MAX_DRAFTS} drafts, got {drafts!r}")
    if drafts and tokens != 1 + drafts:
        raise PlanError(f"a speculative step with {drafts} drafts runs {1 + drafts} tokens per "
                        f"sequence, not {tokens}")
    if drafts and cfg.recurrent_layers() and replay_window is None:
        raise PlanError(f"speculative decoding of {cfg.name or cfg.family}'s recurrent layers "
                        "needs ReplaySSM: the recurrent update keeps no committed state to return "
                        "to after a rejected draft; pass --replay-window L (e.g. 16)")
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 0 or (ngram and
                                                                             not drafts):
        raise PlanError(f"the n-gram drafter needs a speculative step and a suffix length >= 1, "
                        f"got ngram={ngram!r} with {drafts} drafts")
    try:
        validate_model(cfg)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    if batch < 1:
        raise PlanError(f"batch must be >= 1, got {batch}")
    if tokens < 1:
        raise PlanError(f"tokens per sequence per step must be >= 1, got {tokens}")
    if batch * tokens > isa.MAX_ROWS:
        raise PlanError(f"batch * tokens = {batch * tokens} activation rows; the kernel supports "
                        f"at most {isa.MAX_ROWS} per step")
    if not 1 <= max_seq_len <= cfg.max_position_embeddings:
        raise PlanError(f"max sequence length {max_seq_len} must be in [1, "
                        f"{cfg.max_position_embeddings}] (the model's max_position_embeddings)")
    if tokens > max_seq_len:
        raise PlanError(f"{tokens} tokens per step do not fit a cache of {max_seq_len} positions")
    if replay_window is not None and (isinstance(replay_window, bool)
                                      or not isinstance(replay_window, int) or replay_window < 1):
        raise PlanError(f"replay_window must be a positive integer, got {replay_window!r}")
    if replay_window is not None and not cfg.recurrent_layers():
        raise PlanError(f"replay_window applies to models with recurrent layers; "
                        f"{cfg.name or cfg.family} has none")


def check_memory(cfg, buf: BufferPlan, lay: WeightLayout, gpu: GPU) -> None:  # noqa: ANN001
    need = lay.nbytes + buf.kv_bytes + buf.state_bytes + buf.scratch_bytes
    if need > gpu.memory_bytes:
        raise PlanError(
            f"too many sequences for the cache: weights {lay.nbytes / 1e9:.1f} GB + KV cache "
            f"{buf.kv_bytes / 1e9:.1f} GB + recurrent state {buf.state_bytes / 1e9:.1f} GB = "
            f"{need / 1e9:.1f} GB > {gpu.memory_bytes / 1e9:.0f} GB on {gpu.name}; lower the "
            f"batch or the max sequence length")


def default_splits(cfg, batch: int, gpu: GPU, context: int) -> int:  # noqa: ANN001
    """Attention splits per (sequence, kv head) of the model's cache kind: about one partial per
    SM, within the kind's `splits` (most splits, fewest keys a split); 1 without a cache."""
    blk = next((b for b in cfg.blocks if kind(b.kind).kv_cache), None)
    if blk is None:
        return 1
    k = kind(blk.kind)
    most, keys = k.splits
    per = max(1, round(gpu.num_sms / (batch * k.split_heads(blk.cfg))))
    return max(1, min(per, most, max(1, context // keys)))


# ---- the compiler -------------------------------------------------------------------------------
def build_stages(ctx: BuildContext) -> list[Stage]:
    """The step as stages in execution order (module docstring)."""
    embed, prev = embed_stage(ctx)
    out = [embed]
    for blk in ctx.model.blocks:
        stages, prev = kind(blk.kind).stages(blk, ctx, prev)
        out += stages
    head, end = head_stages(ctx, prev)
    if ctx.drafts:  # the recurrent layers commit what ACCEPT accepted
        head += [kind(b.kind).commit_stage(b, ctx, end) for b in ctx.model.blocks
                 if kind(b.kind).recurrent]
    return out + head


def default_max_seq_len(cfg) -> int:  # noqa: ANN001 (ModelConfig)
    """The cache length a program gets when none is asked for."""
    return min(cfg.max_position_embeddings, 4096)


def compile_program(
    cfg,  # noqa: ANN001 (ModelConfig)
    batch: int,
    gpu: GPU,
    tokens: int = 1,
    max_seq_len: int | None = None,
    context: int | None = None,
    n_splits: int | None = None,
    policy: str = "cost",
    params=None,  # noqa: ANN001 (cost.CostParams)
    replay_window: int | None = None,
    paged: PagedKV | None = None,
    drafts: int = 0,
    ngram: int = 0,
) -> Program:
    """Compile one decode step. `context` (cached tokens per sequence) only feeds the cost model
    and the split heuristic; the program serves any lengths with lengths[b] + T <= S_max.
    `replay_window`: None runs recurrent layers by the recurrent update, L by ReplaySSM folding
    every L tokens (every step's T tokens are committed; the ring holds L - 1 + T entries).
    `paged`: K/V in vLLM's pages and the step metadata from the caller (program/paged.py); the
    max sequence length is then the block table's reach. `drafts` k: a speculative step of
    1 + k tokens that accepts on the device (layers/speculative.py); `ngram`: its drafts from
    the device n-gram drafter matching up to that many tokens (0: from the host)."""
    from megakernel.kernel.config.model_spec import default_build
    from megakernel.kernel.host.limits import MMA_MIN_ROWS
    from megakernel.program import cost, schedule  # local: schedule imports this module
    from megakernel.program.replay import replay

    if paged is not None:
        if max_seq_len not in (None, paged.max_seq_len):
            raise PlanError(f"a paged program's max sequence length is max_blocks * block_size "
                            f"= {paged.max_seq_len}, not {max_seq_len}")
        max_seq_len = paged.max_seq_len
        if replay_window is not None and cfg.recurrent_layers():
            raise PlanError("a paged program runs its recurrent layers by the recurrent update "
                            "(the caller's state slots hold a state, not a ReplaySSM ring)")
    if max_seq_len is None:
        max_seq_len = default_max_seq_len(cfg)
    tokens = step_tokens(tokens, drafts)
    validate(cfg, batch, tokens, max_seq_len, gpu, replay_window, drafts, ngram)
    if paged is not None and drafts:
        raise PlanError("a paged program serves the caller's verify batches as plain T-token "
                        "steps (the caller accepts); it takes no drafts")
    if context is None:
        context = min(1024, max_seq_len - tokens)
    if not 0 <= context <= max_seq_len - tokens:
        raise PlanError(f"context {context} + {tokens} new tokens does not fit max sequence "
                        f"length {max_seq_len}")
    if n_splits is None:
        n_splits = default_splits(cfg, batch, gpu, context)
    if n_splits < 1:
        raise PlanError(f"n_splits must be >= 1, got {n_splits}")
    lay = weight_layout(cfg)
    ring_cap = replay_window - 1 + tokens if replay_window else 0
    buf = plan_buffers(cfg, StepShape(batch, tokens, max_seq_len, n_splits, gpu.num_sms,
                                      ring_cap, paged, drafts))
    check_memory(cfg, buf, lay, gpu)
    # the kernel build the program runs on (a speculative build's GEMV form: KernelSpec.mma)
    spec = default_build(cfg, batch, tokens, gpu.arch, drafts=drafts, ngram=ngram,
                         replay_window=(replay_window or 0) if drafts else 0)
    mma = spec.mma if spec else batch * tokens >= MMA_MIN_ROWS
    ctr = Counters()
    ctx = BuildContext(cfg, batch, tokens, context, n_splits, replay_window, lay, buf, ctr, mma,
                       spec.passes if spec else 1, drafts, ngram)
    stage_list = build_stages(ctx)
    ring = spec.ring_bytes if spec else 0  # the build's weight ring
    best = None
    for instrs, queues, state in schedule.candidates(stage_list, gpu, policy, params, ring):
        number_lm_tiles(instrs, gpu.num_sms, batch * tokens)
        prog = Program(cfg, batch, tokens, max_seq_len, gpu, n_splits, context, lay, buf,
                       count_signals(ctr.list, instrs), instrs, queues, policy, replay_window,
                       ring, drafts, ngram)
        prog.header = make_header(prog)
        if state is not None:
            prog.cost = replay(prog, params)
            prog.placement_cost = cost.report(state, instrs, gpu, cost.written_bytes(prog))
        if best is None or (prog.cost is not None
                            and prog.cost.predicted_s < best.cost.predicted_s):
            best = prog
    return best


def count_signals(names: list[Counter], instrs: list[Instr]) -> list[Counter]:
    """Counters with their per-step totals: one per signalling instruction, and for a ticket
    opcode one increment of DONE_CID per ticket counter (its last signaller merges)."""
    counters = [Counter(c.name) for c in names]
    tickets: dict[int, int] = {}
    for ins in instrs:
        if ins.signal != isa.NO_COUNTER:
            counters[ins.signal].total += 1
            if isa.spec(ins.op).ticket:
                tickets[ins.signal] = ins.operands["DONE_CID"]
    for done in tickets.values():
        counters[done].total += 1
    return counters


def number_lm_tiles(instrs: list[Instr], num_slots: int, rows: int) -> None:
    """Partial-argmax slots: LMHEAD instructions in program order; the step's end (ARGMAX or
    ACCEPT) merges them all, and its cost reads that many slots (its stage priced the upper
    bound, one slot per ROW_ALIGN rows of the head, before the scheduler cut the slabs)."""
    lm = [i for i in instrs if i.op == isa.Op.LMHEAD]
    if len(lm) > num_slots:
        raise PlanError(f"{len(lm)} LM-head slabs > {num_slots} partial-argmax slots")
    for t, ins in enumerate(lm):
        ins.operands["TILE"] = t
    for ins in instrs:
        if isa.spec(ins.op).ends_step:
            ins.l2_bytes -= partial_argmax_bytes(ins.operands["N_TILES"] - len(lm), rows)
            ins.operands["N_TILES"] = len(lm)


def f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def make_header(p: Program) -> dict[str, int]:
    """Sizes, constants and base offsets (int32 each) of the program: what the executor and the
    kernel read besides the records. Each kind adds its own fields (`header`), which must agree
    across its blocks."""
    c, b = p.cfg, p.buffers
    lo, hi = isa.split64(b.state_numel)
    hdr = dict(
        FORMAT_VERSION=isa.FORMAT_VERSION, NUM_SMS=p.num_sms,
        MAX_QUEUE=max((len(q) for q in p.queues), default=0) + 1,
        NUM_COUNTER_WORDS=p.counter_words(), B=p.batch, T=p.tokens, N=p.rows,
        L=c.num_layers, H=c.hidden_size, V=c.vocab_size, S_MAX=p.max_seq_len,
        N_SPLITS=p.n_splits, NORM_KIND=int(c.norm_kind == "rms_1p"),
        EPS_F32_BITS=f32_bits(c.rms_norm_eps),
        N_LM_TILES=sum(1 for i in p.instrs if i.op == isa.Op.LMHEAD),
        REPLAY_WINDOW=p.replay_window or 0, RING_CAP=b.ring_cap, DRAFTS=p.drafts,
        NGRAM=p.ngram,
        F32_NUMEL=b.f32_numel, BF16_NUMEL=b.bf16_numel, I32_NUMEL=b.i32_numel,
        STATE_NUMEL_LO=lo, STATE_NUMEL_HI=hi,
    )
    if b.paged is not None:
        hdr.update(b.paged.header())
    for blk in c.blocks:
        for k, v in kind(blk.kind).header(blk, c).items():
            if hdr.setdefault(k, v) != v:
                raise PlanError(f"header field {k}: blocks disagree ({hdr[k]} and {v})")
    for arena, regions in (("F32", b.f32), ("BF16", b.bf16), ("I32", b.i32)):
        for name, r in regions.items():
            hdr[f"{arena}_{name.upper()}_OFF"] = r.offset
    for k, v in hdr.items():
        if not -(1 << 31) <= v < (1 << 31):
            raise PlanError(f"header field {k}={v} does not fit in int32")
    return hdr
