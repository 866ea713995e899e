"""The megakernel as a torch op: `torch.ops.megakernel.decode_step(...)` runs one decode step of a
registered build (`register_build`: launched by the CUDA driver, or with `emulate=True` its PTX on
the emulator, on CPU tensors) or, on CPU tensors, of a registered program served by the CPU
executor (`register_program`).

The op mutates the counters, the scratch arenas and the KV cache in place and returns the next
tokens (and, on request, the logits). Its fake implementation only describes output shapes, so it
traces under torch.compile (fake, meta or CPU tensors) and the real launch is one driver-API call
on torch's current stream, which CUDA graphs can capture. Importing the package registers it;
nothing here imports the DSL. What owns a model's arguments is device_state.py; what drives
generation through the op is serve/kernel_backend.py.

`torch.ops.megakernel.speculative_step(...)` is the same step of a speculative program (1 + k
tokens per sequence, compiled with drafts=k; layers/speculative.py): it takes the k drafts per
sequence in (None when the program drafts on the device, NGRAM), runs the step, which accepts on
the device, and returns every row's greedy tokens [B, 1 + k] and the accepted drafts [B]
(emitted - 1: the first accepted + 1 tokens of a row are the ones it emitted; -1: none, its cache
is full).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megakernel.launch.checks import ArgumentError, validate_args
from megakernel.launch.runtime import KernelDriver, LoadedKernel, Manifest


# ---- registry of builds the op may launch -------------------------------------------------------
@dataclass
class _Entry:
    """What a `kernel` id launches: a build (`manifest`; on the GPU, or `emulated` on CPU
    tensors), or a program that the CPU executor serves when the op gets CPU tensors (`prog`,
    `packed`)."""

    manifest: Manifest | None = None
    emulated: bool = False
    loaded: KernelDriver | None = None
    prog: object | None = None  # megakernel.program.compiler.Program
    packed: object | None = None  # megakernel.program.pack.PackedWeights
    executor: object | None = None  # megakernel.executor.Executor over the last arenas

    @property
    def rows(self) -> int:
        return self.manifest.rows if self.manifest is not None else self.prog.rows

    @property
    def vocab(self) -> int:
        return (self.manifest.spec["vocab"] if self.manifest is not None
                else self.prog.cfg.vocab_size)


_REGISTRY: dict[int, _Entry] = {}


def register_build(manifest: Manifest, emulate: bool = False) -> int:
    """Make a build launchable by the op (`emulate`: its PTX on the emulator, on CPU tensors);
    returns the `kernel` id to pass to decode_step."""
    for k, e in _REGISTRY.items():
        if (e.manifest is not None and e.manifest.path == manifest.path
                and e.manifest.data == manifest.data and e.emulated == emulate):
            return k
    return _add(_Entry(manifest, emulated=emulate))


def register_program(prog, packed) -> int:  # noqa: ANN001
    """Make a program runnable by the op on CPU tensors (served by the CPU executor, with its
    race and write-count checks); returns the `kernel` id to pass to decode_step."""
    return _add(_Entry(prog=prog, packed=packed))


def _add(e: _Entry) -> int:
    k = len(_REGISTRY) + 1
    _REGISTRY[k] = e
    return k


def _entry(kernel: int) -> _Entry:
    if kernel not in _REGISTRY:
        raise ArgumentError(f"unknown kernel id {kernel}; register a build with register_build()")
    return _REGISTRY[kernel]


MUTATED = ("counters", "f32", "bf16", "i32", "k_cache", "v_cache", "state")


@torch.library.custom_op("megakernel::decode_step", mutates_args=MUTATED)
def decode_step(program: torch.Tensor, counters: torch.Tensor, weights: torch.Tensor,
                f32: torch.Tensor, bf16: torch.Tensor, i32: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, state: torch.Tensor, kernel: int, offsets: list[int],
                return_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step. `state` is the fp32 recurrent state arena (conv windows, states, rings;
    empty for a model without recurrent layers). offsets = [lengths_off (i32), tokens_out_off
    (i32), logits_off (f32), s_max (the program header's S_MAX: the kernel finds the rope sin
    table S_MAX * D/2 after cos, so the cache must have exactly S_MAX positions)].

    Returns (tokens_out [N] int32, logits [N, V] fp32 or [0, V] when not requested), copies.
    """
    return _launch(program, counters, weights, f32, bf16, i32, k_cache, v_cache, state, kernel,
                   offsets, return_logits)


def _launch(program, counters, weights, f32, bf16, i32, k_cache, v_cache, state, kernel,  # noqa: ANN001, ANN202
            offsets, return_logits):
    """The launch of a registered build: every argument checked first, then one launch by its
    driver (ArgumentError "the kernel needs CUDA tensors" for CPU tensors after the checks; an
    emulated build needs CPU tensors)."""
    e = _entry(kernel)
    if e.manifest is None:
        raise ArgumentError(f"kernel id {kernel} is a program for the CPU executor; it runs on "
                            f"CPU tensors, got {program.device}")
    if e.emulated and program.device.type != "cpu":
        raise ArgumentError(f"kernel id {kernel} is an emulated build; it runs on CPU tensors, "
                            f"got {program.device}")
    lengths_off, tok_off, logits_off, s_max = _offsets(offsets)
    tensors = dict(program=program, counters=counters, weights=weights, f32=f32, bf16=bf16,
                   i32=i32, k_cache=k_cache, v_cache=v_cache, state=state)
    validate_args(e.manifest.spec, tensors, lengths_off=lengths_off, max_seq_len=s_max,
                  require_cuda=not e.emulated)
    _check_outputs(e, f32, i32, tok_off, logits_off, return_logits)  # before any launch
    if e.loaded is None:
        e.loaded = _load(e, program.device.index)
    e.loaded.launch(program.shape[0], tensors,
                    dict(queue_len=program.shape[1], s_max=s_max,  # = the cache's (checked)
                         lengths_off=lengths_off))
    return _outputs(e, f32, i32, tok_off, logits_off, return_logits)


@decode_step.register_kernel("cpu")
def _decode_step_cpu(program, counters, weights, f32, bf16, i32, k_cache, v_cache, state,
                     kernel, offsets, return_logits=False):
    """The same step on CPU tensors, served by the CPU executor over these very arenas (its
    checks on): what `gpu-check --simulate` and a machine without a GPU run; an emulated build's
    by the emulator."""
    from megakernel.executor import Executor

    e = _entry(kernel)
    if e.prog is None:  # a build: emulated, or its checks name what is wrong (CUDA tensors)
        return _launch(program, counters, weights, f32, bf16, i32, k_cache, v_cache, state,
                       kernel, offsets, return_logits)
    _, tok_off, logits_off, _ = _offsets(offsets)
    _check_outputs(e, f32, i32, tok_off, logits_off, return_logits)
    ex = e.executor
    mine = dict(f32=f32, bf16=bf16, i32=i32, k=k_cache, v=v_cache, state=state)
    if (ex is None or any(ex.arena_tensor(n) is not t for n, t in mine.items())
            or weights.data_ptr() != ex.weights.data_ptr()):
        if not torch.equal(program, e.prog.records()):
            raise ArgumentError("the program tensor is not the registered program's records")
        arena = e.packed.arena
        if (weights.dtype, weights.shape, weights.device) != (arena.dtype, arena.shape,
                                                              arena.device):
            raise ArgumentError(f"weights {weights.dtype} {tuple(weights.shape)} on "
                                f"{weights.device} is not the registered program's packed arena "
                                f"({arena.dtype} {tuple(arena.shape)} on {arena.device})")
        packed = dataclasses.replace(e.packed, arena=weights)  # the step reads its argument
        ex = e.executor = Executor(e.prog, packed, check=True, arenas=mine)
    if counters.numel() != len(ex.counters):
        raise ArgumentError(f"counters has {counters.numel()} words, the program needs "
                            f"{len(ex.counters)}")
    ex.counters = [int(c) for c in counters.tolist()]
    ex.step()
    counters.copy_(torch.tensor(ex.counters, dtype=torch.int32))
    return _outputs(e, f32, i32, tok_off, logits_off, return_logits)


def _load(e: _Entry, device: int | None) -> KernelDriver:
    """The entry's build loaded by its driver: the CUDA driver on `device`, or the emulator."""
    if e.emulated:
        from megakernel.launch.emulated import EmulatedKernel

        return EmulatedKernel(e.manifest)
    return LoadedKernel(e.manifest, device)


def _check_outputs(e: _Entry, f32: torch.Tensor, i32: torch.Tensor, tok_off: int,
                   logits_off: int, return_logits: bool) -> None:
    n, v = e.rows, e.vocab
    if tok_off < 0 or tok_off + n > i32.numel():
        raise ArgumentError(f"tokens_out_off {tok_off} + {n} rows is outside the i32 arena")
    if return_logits and (logits_off < 0 or logits_off + n * v > f32.numel()):
        raise ArgumentError(f"logits_off {logits_off} + {n}x{v} is outside the f32 arena")


def _outputs(e: _Entry, f32: torch.Tensor, i32: torch.Tensor, tok_off: int, logits_off: int,
             return_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, v = e.rows, e.vocab
    tokens = i32[tok_off: tok_off + n].clone()
    if return_logits:
        logits = f32[logits_off: logits_off + n * v].view(n, v).clone()
    else:
        logits = f32.new_empty((0, v))
    return tokens, logits


# ---- the speculative step -----------------------------------------------------------------------
def _spec_shape(e: _Entry, kernel: int) -> tuple[int, int]:
    """(B, T = 1 + k) of a speculative program or build; ArgumentError for a plain one."""
    from megakernel import isa

    if e.manifest is not None:
        s = e.manifest.spec
        end = isa.frame_ops("speculative")
        if not {int(o) for o in end} <= set(s.get("ops", ())):
            raise ArgumentError(f"kernel id {kernel}: the build in {e.manifest.path} has no "
                                f"speculative step (no {'/'.join(o.name for o in end)} "
                                "handler); build it for a program compiled with drafts")
        return int(s["batch"]), int(s["tokens"])
    if not e.prog.drafts:
        raise ArgumentError(f"kernel id {kernel} is a plain program ({e.prog.tokens} token(s) a "
                            "step, no drafts); compile it with drafts=k for speculative_step")
    return e.prog.batch, e.prog.tokens


def _device_drafts(e: _Entry) -> bool:
    from megakernel import isa

    if e.manifest is not None:
        ops = set(e.manifest.spec.get("ops", ()))
        return {int(o) for o in isa.frame_ops("ngram")} <= ops
    return bool(e.prog.ngram)


def _spec_offsets(offsets: list[int]) -> tuple[list[int], int, int]:
    if len(offsets) != 6:
        raise ArgumentError(f"offsets must be [lengths_off, tokens_out_off, logits_off, s_max, "
                            f"tokens_in_off, emitted_off], got {list(offsets)}")
    return [int(x) for x in offsets[:4]], int(offsets[4]), int(offsets[5])


def _check_drafts(e: _Entry, kernel: int, i32: torch.Tensor, drafts: torch.Tensor | None,
                  tok_in: int, emit: int) -> tuple[int, int]:
    """Every argument the speculative step adds, checked before the step: (B, T)."""
    b, t = _spec_shape(e, kernel)
    k = t - 1
    if drafts is None:
        if not _device_drafts(e):
            raise ArgumentError(f"kernel id {kernel} has no device drafter (NGRAM): pass drafts "
                                f"[{b}, {k}]")
    else:
        if tuple(drafts.shape) != (b, k):
            raise ArgumentError(f"drafts must be [{b}, {k}] (batch, drafts a step), got "
                                f"{tuple(drafts.shape)}")
        if drafts.dtype not in (torch.int32, torch.int64):
            raise ArgumentError(f"drafts must be torch.int32 or torch.int64, got {drafts.dtype}")
        if drafts.device != i32.device:
            raise ArgumentError(f"drafts are on {drafts.device}, the arenas on {i32.device}")
    if tok_in < 0 or tok_in + b * t > i32.numel():
        raise ArgumentError(f"tokens_in_off {tok_in} + {b * t} rows is outside the i32 arena")
    if emit < 0 or emit + b > i32.numel():
        raise ArgumentError(f"emitted_off {emit} + {b} sequences is outside the i32 arena")
    return b, t


@torch.library.custom_op("megakernel::speculative_step", mutates_args=MUTATED)
def speculative_step(program: torch.Tensor, counters: torch.Tensor, weights: torch.Tensor,
                     f32: torch.Tensor, bf16: torch.Tensor, i32: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, state: torch.Tensor,
                     kernel: int, offsets: list[int], drafts: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step (module docstring) of a program compiled with k drafts, registered
    like decode_step's. offsets = decode_step's four, then tokens_in_off and emitted_off (i32).
    `drafts` [B, k] int32/int64 go into tokens_in rows b*T + 1 .. b*T + k (row b*T, the last
    token, is the bonus the previous step fed back, or what the caller wrote before the first
    step); None keeps the device drafter's. Token ids are the caller's to check (as decode_step's
    tokens_in).

    Returns (tokens [B, 1 + k] int32: each row's greedy tokens, the first accepted + 1 of them
    emitted; accepted [B] int32: emitted - 1), copies."""
    e = _entry(kernel)
    base, tok_in, emit = _spec_offsets(offsets)
    b, t = _check_drafts(e, kernel, i32, drafts, tok_in, emit)
    if drafts is not None:
        i32[tok_in: tok_in + b * t].view(b, t)[:, 1:].copy_(drafts)
    args = (program, counters, weights, f32, bf16, i32, k_cache, v_cache, state, kernel, base,
            False)
    if program.device.type == "cpu":
        tokens, _ = _decode_step_cpu(*args)
    else:
        tokens, _ = _launch(*args)
    return tokens.view(b, t), i32[emit: emit + b] - 1


@speculative_step.register_fake
def _(program, counters, weights, f32, bf16, i32, k_cache, v_cache, state, kernel, offsets,
      drafts=None):
    e = _entry(kernel)
    b, t = _spec_shape(e, kernel)
    return i32.new_empty((b, t)), i32.new_empty((b,))


@decode_step.register_fake
def _(program, counters, weights, f32, bf16, i32, k_cache, v_cache, state, kernel, offsets,
      return_logits=False):
    e = _entry(kernel)
    n, v = e.rows, e.vocab
    tokens = i32.new_empty((n,))
    logits = f32.new_empty((n if return_logits else 0, v))
    return tokens, logits


def _offsets(offsets: list[int]) -> tuple[int, int, int, int]:
    if len(offsets) != 4:
        raise ArgumentError(f"offsets must be [lengths_off, tokens_out_off, logits_off, s_max], "
                            f"got {list(offsets)}")
    return int(offsets[0]), int(offsets[1]), int(offsets[2]), int(offsets[3])
