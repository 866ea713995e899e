"""What the recurrent layer kinds (gated delta rule, KDA, Mamba2) share: a fused input projection
(PROJ, fp32), a core instruction per (sequence, unit) that runs the short causal conv over an fp32
window, the state update (recurrent) or ReplaySSM, and the gated output norm, then out_proj.

Per recurrent layer the persistent fp32 state arena holds, in order: the conv window [B, C, K-1]
(oldest input first), the state [B, ...], and with ReplaySSM (fold window L) the ring entries
[B, L - 1 + T, ...]. A core record's STATE is the 64-bit element offset of that block; the ring
count of (layer, sequence, unit) lives in i32 ring_count [layers, B, units] (persistent).

Buffers: f32 proj [N, P] (the layer's projection, zero-padded to a multiple of 16 columns),
f32 ssm_params [layers, n] (the layer's fp32 constants: A_log, dt_bias, D), bf16 ssm_out [N, out]
(the gated-norm output, out_proj's input).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

from megakernel.isa.records import ROW_ALIGN
from megakernel.isa.registry import OpCode, OpSpec, register
from megakernel.isa.stages import Instr, Stage
from megakernel.kernel.host.limits import LANES, NUM_THREADS
from megakernel.layers.base import CONST, LayerKind, Need, StepShape
from megakernel.layers.frame import OPROJ, proj_stage, residual_stage

CORE_OPERANDS = (
    ("B_IDX", "sequence b"),
    ("UNIT", "the unit of the layer this record runs"),  # renamed per kind (K_HEAD, GROUP, HEAD)
    ("PROJ_OFF", "f32: proj [N, P]"),
    ("CONV_W", "weights: the conv taps (and per-kind extras, see the kind)"),
    ("PARAM_OFF", "f32: this layer's row of ssm_params"),
    ("NORM_W", "weights: the output norm weight"),
    ("STATE_LO", "state: this layer's block (conv window, state, ring), low 32 bits"),
    ("STATE_HI", "high 32 bits"),
    ("OUT_OFF", "bf16: ssm_out [N, out]"),
)
REPLAY_OPERANDS = (("COUNT_OFF", "i32: ring entries [B, units] of this layer (persistent)"),)
COMMIT_OPERANDS = (
    ("B_IDX", "sequence b"),
    ("UNIT", "the unit of the layer this record commits"),
    ("PARAM_OFF", "f32: this layer's row of ssm_params"),
    ("STATE_LO", "state: this layer's block (conv window, state, ring, pending), low 32 bits"),
    ("STATE_HI", "high 32 bits"),
    ("COUNT_OFF", "i32: ring entries [B, units] of this layer (persistent)"),
    ("EMIT_OFF", "i32: emitted [B] (layers/speculative.py ACCEPT)"),
)
COMMIT_NOTES = ("A speculative step's core records append their T ring entries after the n "
                "committed ones and keep their T pre-conv inputs in `pending` [B, C, T], leaving "
                "count, window and state alone. Then, with e = emitted[b]: the window becomes the "
                "last K-1 of [window | pending[:, :e]], the count n + e, and when n + e >= L "
                "(header REPLAY_WINDOW) the n + e entries are folded into the state (as the core "
                "record's fold) and the count is 0 (reference commit_layer).")


def core_operands(unit: tuple[str, str], replay: bool) -> tuple[tuple[str, str], ...]:
    ops = tuple(unit if n == "UNIT" else (n, d) for n, d in CORE_OPERANDS)
    return ops + (REPLAY_OPERANDS if replay else ())


def register_core_ops(code: int, prefix: str, kind: str, unit: tuple[str, str],
                      docs: tuple[str, str], notes: str,
                      how: tuple[str, str] = ("", ""),
                      handler: tuple[str | None, str | None] = (None, None)
                      ) -> tuple[OpCode, OpCode]:
    """Register a recurrent kind's two core ops: `<prefix>_CORE` (code, recurrent) and
    `<prefix>_REPLAY` (code + 1, ReplaySSM); they share the unit and the notes, `how` adds what
    only one of them does, `handler` names each one's device handler class (OpSpec.handler; None:
    the kernel does not implement it)."""
    return tuple(register(OpSpec(code + r, f"{prefix}_{('CORE', 'REPLAY')[r]}", kind, docs[r],
                                 core_operands(unit, bool(r)),
                                 notes=f"{notes} {how[r]}".rstrip(), reach=True,
                                 device=handler[r] is not None, handler=handler[r]))
                 for r in (0, 1))


def register_commit_op(code: int, prefix: str, kind: str, unit: tuple[str, str],
                       handler: str | None = None) -> OpCode:
    """Register a recurrent kind's `<prefix>_COMMIT`: the ReplaySSM commit of one (sequence,
    unit) after a speculative step's ACCEPT."""
    ops = tuple(unit if n == "UNIT" else (n, d) for n, d in COMMIT_OPERANDS)
    return register(OpSpec(code, f"{prefix}_COMMIT", kind, "commit the accepted entries of a "
                           "speculative step's ring, window and count; fold when due", ops,
                           notes=COMMIT_NOTES, reach=True, device=handler is not None,
                           handler=handler))


class Sizes(NamedTuple):
    """A recurrent kind's sizes for one config (per sequence unless said otherwise)."""

    units: int  # core instructions per sequence (key heads, groups, heads)
    state: tuple[int, ...]  # the recurrent state
    ring: list[tuple[str, tuple[int, ...]]]  # ReplaySSM ring entries of one token: (name, shape)
    out_dim: int  # the gated-norm output (out_proj's input)
    n_params: int  # fp32 constants of the layer (its row of ssm_params)
    proj_rows: int  # rows of the fused input projection before padding
    unit_channels: int  # conv channels one core instruction reads (and its window columns)
    unit_weight_bytes: int  # weight bytes one core instruction streams (conv taps and extras)
    unit_gates: int  # per-token gate inputs one core instruction reads


def replay_cycle(window: int, tokens: int) -> tuple[float, float]:
    """(committed ring entries a core record reads on average, fraction of steps that fold and
    write the state) of ReplaySSM with fold window L and T tokens a step: the count runs 0, T,
    .., (m - 1) T and folds at the m = ceil(L / T)-th step (T = 1: (L - 1) / 2 and 1 / L)."""
    m = -(-window // tokens)
    return tokens * (m - 1) / 2, 1 / m


def _size(field: str) -> classmethod:
    return classmethod(lambda cls, cfg: getattr(cls.sizes(cfg), field))


class RecurrentKind(LayerKind):
    """Base of the recurrent kinds; a kind sets its opcodes and its `sizes`."""

    recurrent = True
    fp32_params = ("A_log", "dt_bias", "D")
    core_op: ClassVar[int]  # set by the kind: its recurrent and its ReplaySSM opcode
    replay_op: ClassVar[int]
    commit_op: ClassVar[int]  # its ReplaySSM commit after a speculative step's ACCEPT
    unit_name: ClassVar[str] = "UNIT"  # derived: the core records' unit operand
    # the unit in messages: (what it is, the symbol of its count), e.g. ("key head", "Hk")
    unit_label: ClassVar[tuple[str, str]] = ("unit", "U")
    # its handlers' index arithmetic (a kernel/*_index shape class with for_spec) and the check
    # naming what of a build's shape they cannot serve (a staticmethod of the shape -> str)
    index_shape: ClassVar[Any] = None
    index_check: ClassVar[Any] = None

    def __init_subclass__(cls, **kw: Any) -> None:
        from megakernel.isa.registry import spec

        core, replay = spec(cls.core_op), spec(cls.replay_op)
        cls.unit_name = core.names[1]
        cls.flow = {"PROJ": None, core.name: "PROJ", replay.name: "PROJ",
                    "OPROJ": (core.name, replay.name)}
        cls.after = {spec(cls.commit_op).name: "speculative"}
        super().__init_subclass__(**kw)

    @classmethod
    def sizes(cls, cfg) -> Sizes:  # noqa: ANN001 (the kind's config)
        raise NotImplementedError

    @classmethod
    def unit_segments(cls, cfg, unit: int) -> list[slice]:  # noqa: ANN001
        """The conv channels (of the window [C, K-1]) unit `unit` owns, as the core reads them."""
        raise NotImplementedError

    units = _size("units")
    state_shape = _size("state")
    ring_shapes = _size("ring")
    out_dim = _size("out_dim")
    n_params = _size("n_params")
    proj_rows = _size("proj_rows")
    unit_channels = _size("unit_channels")
    unit_weight_bytes = _size("unit_weight_bytes")
    unit_gates = _size("unit_gates")

    @classmethod
    def conv_dim(cls, cfg) -> int:  # noqa: ANN001
        return cfg.conv_dim

    # ---- shared --------------------------------------------------------------------------------
    @classmethod
    def matvec_shapes(cls, spec) -> dict[str, list[tuple[int, int]]]:  # noqa: ANN001 (KernelSpec)
        """The fused input projection [P, H] and out_proj [H, out_dim] (the config's leading
        fields are the kind's kernel_constants, in order)."""
        c, h = cls.config(*spec.constants(cls.name)), spec.hidden
        return {"PROJ": [(h, cls.proj_width(c))], "OPROJ": [(cls.out_dim(c), h)]}

    @classmethod
    def kernel_shape(cls, spec):  # noqa: ANN001, ANN206 (KernelSpec -> index_shape)
        return cls.index_shape.for_spec(spec) if cls.index_shape else None

    @classmethod
    def kernel_check(cls, spec) -> str:  # noqa: ANN001
        return cls.index_check(cls.kernel_shape(spec)) if cls.index_check else ""

    @classmethod
    def check_kernel_record(cls, d: dict, spec) -> str:  # noqa: ANN001 (KernelSpec)
        if d["OPCODE"] not in (cls.core_op, cls.replay_op, cls.commit_op):
            return ""
        units = cls.units(cls.config(*spec.constants(cls.name)))
        unit, (what, sym) = d[cls.unit_name], cls.unit_label
        if not (0 <= d["B_IDX"] < spec.batch and 0 <= unit < units and d["STATE"] >= 0):
            return (f"sequence {d['B_IDX']}, {what} {unit}, state offset {d['STATE']} outside "
                    f"the build's B={spec.batch}, {sym}={units}")
        return ""

    @classmethod
    def round_trips(cls, cfg, batch: int, tokens: int, window: int) -> int:  # noqa: ANN001
        """Dependent global round trips of one core record (the cost model's latency term),
        counted by the handler's index shape (kernel/*_index.py `round_trips`); 0 without one."""
        if cls.index_shape is None:
            return 0
        cap = window - 1 + tokens if window else 0
        shape = cls.index_shape.of(cls.kernel_constants(cfg), batch, tokens,
                                   NUM_THREADS // LANES, cap)
        return shape.round_trips()

    @classmethod
    def proj_width(cls, cfg) -> int:  # noqa: ANN001
        return -(-cls.proj_rows(cfg) // ROW_ALIGN) * ROW_ALIGN

    @classmethod
    def entry_bytes(cls, cfg) -> int:  # noqa: ANN001
        """Ring bytes one token adds for one unit."""
        return sum(math.prod(s) for _, s in cls.ring_shapes(cfg)) * 4 // cls.units(cfg)

    @classmethod
    def needs(cls, blk, model, shape: StepShape) -> list[Need]:  # noqa: ANN001
        c, n = blk.cfg, shape.rows
        return [Need("f32", "proj", (n, cls.proj_width(c))),
                Need("bf16", "ssm_out", (n, cls.out_dim(c))),
                Need("f32", "ssm_params", (cls.n_params(c),), CONST, const=True, table="rec"),
                Need("i32", "ring_count", (shape.batch, cls.units(c)), persistent=True,
                     table="rec")]

    @classmethod
    def state(cls, blk, model, batch: int, ring_cap: int, pending: int = 0):  # noqa: ANN001, ANN206
        c = blk.cfg
        out = [("conv", (batch, cls.conv_dim(c), c.conv_kernel - 1)),
               ("state", (batch, *cls.state_shape(c)))]
        if ring_cap:
            out += [(name, (batch, ring_cap, *s)) for name, s in cls.ring_shapes(c)]
        if pending:  # a speculative step's T pre-conv inputs, until COMMIT
            out.append(("pending", (batch, cls.conv_dim(c), pending)))
        return out

    @classmethod
    def stages(cls, blk, ctx, wait: int) -> tuple[list[Stage], int]:  # noqa: ANN001
        c, layer, key = blk.cfg, blk.layer, blk.key
        proj, c_p = proj_stage(ctx, blk, cls.proj_width(c), wait)
        f32, bf, i32, buf = ctx.buf.f32, ctx.buf.bf16, ctx.buf.i32, ctx.buf
        units, tokens, window = cls.units(c), ctx.tokens, ctx.replay_window
        op = cls.replay_op if window else cls.core_op
        row = buf.row("rec", layer)
        params = f32["ssm_params"]
        counts = i32["ring_count"]
        st_bytes = math.prod(cls.state_shape(c)) // units * 4  # one unit's state
        entry = cls.entry_bytes(c)
        ch = cls.unit_channels(c)
        win_bytes = ch * (c.conv_kernel - 1) * 4
        unit_w = cls.unit_weight_bytes(c)
        out_cols = cls.out_dim(c) // units
        c_core = ctx.ctr(f"L{layer}.core")
        common = {"PROJ_OFF": f32["proj"].offset, "CONV_W": ctx.lay[f"{key}.conv"].offset,
                  "PARAM_OFF": params.offset + row * params.shape[1],
                  "NORM_W": ctx.lay[f"{key}.out_norm"].offset,
                  "STATE": buf.state[layer]["conv"].offset, "OUT_OFF": bf["ssm_out"].offset}
        if window:
            common["COUNT_OFF"] = counts.offset + row * counts.shape[1] * counts.shape[2]
            # committed state + the committed ring entries (replay_cycle) are read before the
            # wait; T entries are appended; the state is written at a fold only
            held, folds = replay_cycle(window, tokens)
            pre = st_bytes + int(held * entry)
            # (a speculative step's fold is its COMMIT's)
            st_store = tokens * entry + (0 if ctx.drafts else st_bytes * folds)
        else:
            pre, st_store = st_bytes, st_bytes

        trips = cls.round_trips(c, ctx.batch, tokens, window)

        def mk_core(u0: int, u1: int) -> Instr:
            b, unit = divmod(u0, units)
            return Instr(op, layer, {"B_IDX": b, cls.unit_name: unit, **common},
                         wait=c_p, signal=c_core,
                         # state, ring and window do not depend on this step: prefetchable
                         w_bytes=pre + win_bytes + unit_w,
                         l2_bytes=tokens * (ch + out_cols + 2 * cls.unit_gates(c)) * 4,
                         store_bytes=int(st_store) + win_bytes + tokens * out_cols * 2,
                         fp32_flops=tokens * (6.0 * st_bytes / 4 + 2.0 * ch * c.conv_kernel),
                         round_trips=trips)

        core = Stage(f"L{layer}.core", op, layer, ctx.batch * units, False, mk_core)
        o, c_o = residual_stage(ctx, OPROJ, blk, "o", cls.out_dim(c), bf["ssm_out"].offset,
                                c_core, f"L{layer}.oproj")
        return [proj, core, o], c_o

    @classmethod
    def commit_stage(cls, blk, ctx, wait: int) -> Stage:  # noqa: ANN001
        """A speculative step's COMMIT records, one per (sequence, unit), waiting on ACCEPT
        (counter `wait`); the cost model assumes every draft accepted (the most folds)."""
        c, layer, buf = blk.cfg, blk.layer, ctx.buf
        units, row, counts = cls.units(c), buf.row("rec", layer), buf.i32["ring_count"]
        params = buf.f32["ssm_params"]
        common = {"PARAM_OFF": params.offset + row * params.shape[1],
                  "STATE": buf.state[layer]["conv"].offset,
                  "COUNT_OFF": counts.offset + row * counts.shape[1] * counts.shape[2],
                  "EMIT_OFF": buf.i32["emitted"].offset}
        st_bytes = math.prod(cls.state_shape(c)) // units * 4
        held, folds = replay_cycle(ctx.replay_window, ctx.tokens)
        win = cls.unit_channels(c) * (c.conv_kernel - 1 + ctx.tokens) * 4
        c_commit = ctx.ctr(f"L{layer}.commit")

        def mk(u0: int, u1: int) -> Instr:
            b, unit = divmod(u0, units)
            return Instr(cls.commit_op, layer, {"B_IDX": b, cls.unit_name: unit, **common},
                         wait=wait, signal=c_commit,
                         w_bytes=int(folds * (st_bytes + (held + ctx.tokens) * cls.entry_bytes(c))),
                         l2_bytes=win + 8, store_bytes=win + int(folds * st_bytes) + 4,
                         fp32_flops=folds * 4.0 * st_bytes / 4 * (held + ctx.tokens))

        return Stage(f"L{layer}.commit", cls.commit_op, layer, ctx.batch * units, False, mk)

    @classmethod
    def coverage(cls, blk, prog) -> dict[str, int]:  # noqa: ANN001
        from megakernel import isa

        op = cls.replay_op if prog.replay_window else cls.core_op
        out = {isa.spec(op).name: prog.batch * cls.units(blk.cfg)}
        if prog.drafts:
            out[isa.spec(cls.commit_op).name] = prog.batch * cls.units(blk.cfg)
        return out

    @classmethod
    def cover(cls, d: dict, blk, prog) -> tuple[int, int]:  # noqa: ANN001
        u = d["B_IDX"] * cls.units(blk.cfg) + d[cls.unit_name]
        return u, u + 1

    @classmethod
    def step_bytes(cls, blk, prog) -> dict[str, float]:  # noqa: ANN001
        c, b, units = blk.cfg, prog.batch, cls.units(blk.cfg)
        state = b * math.prod(cls.state_shape(c)) * 4
        conv = b * cls.conv_dim(c) * (c.conv_kernel - 1) * 4
        window, entry = prog.replay_window, cls.entry_bytes(c)
        out = {"weights": b * units * cls.unit_weight_bytes(c), "state_read": state,
               "conv_read": conv, "conv_written": conv}
        if window:
            held, folds = replay_cycle(window, prog.tokens)
            out.update(ring_read=b * units * int(held * entry),
                       ring_written=prog.rows * units * entry,
                       state_written=int(state * folds))
        else:
            out["state_written"] = state
        return out
