"""Model -> kernel build: the `KernelSpec` of a model at a batch, tokens per step and arch, and the
support checks that name what of a model no build serves (no DSL).

The spec takes each layer kind's constants from the kind (LayerKind.kernel_constants) and the
opcode set from the kinds' `flow`; the kinds' own checks run in KernelSpec.validate.
"""

from __future__ import annotations

from typing import Any

from megakernel import isa
from megakernel.common.errors import ConfigError, SpecError
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.host.limits import (
    MIN_PIPELINE_STAGES,
    NUM_THREADS,
    PIPELINE_STAGES,
    step_tokens,
)


def mlp_kinds() -> tuple[str, ...]:
    """The feed-forward layer kinds (layers.mlp.MLPKind: SwiGLU, relu^2, ...), from the kind
    registry; a model the kernel runs has exactly one, and the build's `inter` is its."""
    from megakernel.layers import all_kinds
    from megakernel.layers.mlp import MLPKind

    return tuple(sorted(n for n, k in all_kinds().items() if issubclass(k, MLPKind)))


def kinds_ops(kinds, replay: bool = False, drafts: int = 0,  # noqa: ANN001 (kind names)
              ngram: int = 0) -> set[int]:
    """The opcodes of a program whose blocks are of `kinds`: their `flow` plus the frame's; a
    recurrent kind's core op is its ReplaySSM one when `replay` (a program has one of the two);
    the frame's are those its step declares (isa.step_ops: a speculative step, `drafts` k >= 1,
    has its own end and, with `ngram` >= 1, the device drafter), and a speculative step the
    kinds' opcodes that run after its end (`after`: the recurrent kinds' COMMIT)."""
    from megakernel.layers import kind

    names = {op.name for op in isa.step_ops(drafts, ngram)}
    for k in kinds:
        kd = kind(k)
        names |= set(kd.flow)
        if drafts:
            names |= set(kd.after)
        if kd.recurrent:
            names.discard(isa.spec(kd.core_op if replay else kd.replay_op).name)
    return {int(getattr(isa.Op, n)) for n in names}


def program_ops(cfg, replay: bool = False, drafts: int = 0,  # noqa: ANN001 (ModelConfig)
                ngram: int = 0) -> set[int]:
    """The opcodes a program of `cfg` uses (its kinds' `flow` plus the frame's; `replay`: with a
    ReplaySSM window; `drafts`, `ngram`: a speculative step, kinds_ops)."""
    return kinds_ops({blk.kind for blk in cfg.blocks}, replay, drafts, ngram)


def model_kinds(cfg) -> list[str]:  # noqa: ANN001 (ModelConfig)
    """The layer kinds of `cfg`'s blocks, by name."""
    return sorted({blk.kind for blk in cfg.blocks})


def check_kernel_support(cfg, replay: bool = False,  # noqa: ANN001 (ModelConfig)
                         unhandled: str = "refuse", drafts: int = 0, ngram: int = 0) -> None:
    """SpecError naming what of `cfg` the kernel does not run yet (validate() has accepted it);
    `unhandled="trap"` lets opcodes without a device handler through (make_spec); `drafts`,
    `ngram`: the opcodes of a speculative step (kinds_ops)."""
    from megakernel.layers import kind

    missing = sorted(isa.spec(op).name for op in program_ops(cfg, replay, drafts, ngram)
                     if not isa.spec(op).device)
    if missing and unhandled != "trap":
        kinds = sorted({isa.spec(getattr(isa.Op, n)).kind for n in missing})
        raise SpecError(f"the kernel has no device handlers for {', '.join(missing)} yet (layer "
                        f"kinds {', '.join(kinds)} of {cfg.name or cfg.family}); the CPU "
                        "executor runs its program")
    ffn = mlp_kinds()
    mlps = [k for k in ffn if cfg.has_kind(k)]
    try:  # the build's constants: one config of each kind for every layer of the kind
        if len(mlps) != 1:
            raise ConfigError(f"{cfg.name or cfg.family} has feed-forward kinds {mlps}; "
                              f"expected exactly one of {', '.join(ffn)}")
        for k in model_kinds(cfg):
            cfg.kind_config(k)
    except ConfigError as e:
        raise SpecError(f"the kernel serves stacks whose layers of each kind have one shape "
                        f"(and one feed-forward kind of {'/'.join(ffn)}): {e}") from None
    for k in model_kinds(cfg):
        why = kind(k).kernel_support(cfg.kind_config(k))
        if why:
            raise SpecError(f"the kernel does not support {why} yet ({cfg.name or cfg.family})")


def gate_offset(cfg, batch: int, tokens: int) -> int:  # noqa: ANN001 (ModelConfig)
    """F32 element offset of the gate buffer [N, Hq, D] in the programs of `cfg` at this batch
    (-1: no output gate). The gate is a step-shape region declared before the attention
    partials (layers/attention.py), so its offset does not depend on the split count or the
    cache length: a compile-time constant of the build, checked against the program header's
    F32_GATE_OFF when a program meets the build (launch.checks.check_header)."""
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


def kind_constants(cfg) -> tuple[tuple[str, tuple[int, ...]], ...]:  # noqa: ANN001 (ModelConfig)
    """KernelSpec.kinds of `cfg`: (name, LayerKind.kernel_constants of its one config) for every
    layer kind of the model, by name."""
    from megakernel.layers import kind

    return tuple((k, tuple(int(c) for c in kind(k).kernel_constants(cfg.kind_config(k))))
                 for k in model_kinds(cfg))


def make_spec(cfg, batch: int, tokens: int, arch: str,  # noqa: ANN001 (ModelConfig)
              num_threads: int = NUM_THREADS, smem_stages: int | None = None,
              timeline: bool = False, l2_window: int = -1, replay: bool = False,
              replay_window: int = 0, paged=None,  # noqa: ANN001 (program.paged.PagedKV | None)
              unhandled: str = "refuse", drafts: int = 0, ngram: int = 0) -> KernelSpec:
    """The build's static config for a model, batch and tokens per step (`replay_window` L >= 1:
    programs with that ReplaySSM window, whose recurrent layers run the kinds' ReplaySSM core
    ops; `replay` without a window: the op set only, for support checks). `smem_stages`
    None: the deepest ring (PIPELINE_STAGES down to MIN_PIPELINE_STAGES) whose spec is valid, else 0
    (the global-memory weight path); an int is taken as given (SpecError when it cannot serve
    the model/batch). `timeline`: the variant that records per-instruction times; `l2_window`:
    the L2 lookahead in bytes per SM (-1: the arch's, 0: none, for an A/B of the lookahead);
    `paged`: a program/paged.PagedKV page pool (the paged build, kernel/host/paged_index.py);
    `unhandled`: "refuse" (SpecError) a model with opcodes that have no device handler yet, or
    "trap": build without them (a record of one fails the launch), for developing a handler;
    `drafts` k >= 1: programs of a speculative step (T = 1 + k: tokens 1 is taken as 1 + k),
    `ngram`: with the device n-gram drafter matching up to that many tokens (layers/speculative.py).
    """
    tokens = step_tokens(tokens, drafts)
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
                                 l2_window, replay, replay_window, paged, unhandled, drafts,
                                 ngram)
            except SpecError:
                pass
        return make_spec(cfg, batch, tokens, arch, num_threads, 0, timeline, l2_window, replay,
                         replay_window, paged, unhandled, drafts, ngram)
    from megakernel.layers import kind
    from megakernel.models import validate

    validate(cfg)
    if replay_window and not cfg.recurrent_layers():
        raise SpecError(f"replay_window applies to models with recurrent layers; "
                        f"{cfg.name or cfg.family} has none")
    if unhandled not in ("refuse", "trap"):
        raise SpecError(f"unhandled must be 'refuse' or 'trap', got {unhandled!r}")
    check_kernel_support(cfg, replay, unhandled, drafts, ngram)
    # the layers with a KV (or latent) cache slot, in order (kv_slot)
    attn = tuple(b.layer for b in cfg.blocks if kind(b.kind).kv_cache)
    ops = tuple(sorted(op for op in program_ops(cfg, replay, drafts, ngram)
                       if unhandled == "refuse" or isa.spec(op).device))
    spec = KernelSpec(
        arch=arch, family=cfg.family, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
        layers=cfg.num_layers, eps=float(cfg.rms_norm_eps), batch=batch, tokens=tokens,
        kinds=kind_constants(cfg), norm_one_plus=cfg.norm_kind == "rms_1p",
        gate_off=gate_offset(cfg, batch, tokens), ops=ops,
        attn_layers=() if attn == tuple(range(cfg.num_layers)) else attn,
        replay_window=replay_window, drafts=drafts, ngram=ngram,
        paged=paged_constants(cfg, batch, tokens, paged), **weight_format(cfg),
        num_threads=num_threads, smem_stages=smem_stages, timeline=timeline,
        l2_window=l2_window)
    spec.validate()
    return spec


def weight_format(cfg) -> dict[str, Any]:  # noqa: ANN001 (ModelConfig)
    """KernelSpec's weight-format fields of `cfg` (docs/FP8.md): bf16, or FP8 slabs of the
    model's scale granularity, the LM head FP8 only where the packed layout quantizes it (an
    untied head with Fp8Format.lm_head; a tied head is the bf16 embedding)."""
    q = cfg.quant
    if q is None:
        return {}
    return {"fp8": q.granularity, "fp8_lm_head": bool(q.lm_head and not cfg.tie_word_embeddings)}


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


def default_build(cfg: Any, batch: int, tokens: int, arch: str,  # noqa: ANN401
                  replay_window: int = 0, drafts: int = 0, ngram: int = 0) -> KernelSpec | None:
    """The default build's spec for this model/batch (a ReplaySSM window, a speculative step:
    make_spec), or None when no kernel build serves it."""
    try:
        return make_spec(cfg, batch, tokens, arch, replay_window=replay_window, drafts=drafts,
                         ngram=ngram)
    except SpecError:
        return None


def build_ring_bytes(cfg: Any, batch: int, tokens: int, arch: str) -> int:  # noqa: ANN401
    """Bytes of the default build's shared-memory weight ring for this model/batch (0: the
    global-memory path, or no kernel build serves it). The cost model reads it."""
    spec = default_build(cfg, batch, tokens, arch)
    return spec.ring_bytes if spec else 0
