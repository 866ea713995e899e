"""The megakernel as a torch op, a `Megakernel` object that owns a model's GPU state, and the
`generate` function behind `python -m megakernel generate --backend kernel`.

`torch.ops.megakernel.decode_step(...)` runs one decode step: it mutates the counters, the scratch
arenas and the KV cache in place and returns the next tokens (and, on request, the logits). Its
fake implementation only describes output shapes, so it traces under torch.compile (fake, meta or
CPU tensors) and the real launch is one driver-API call on torch's current stream, which CUDA
graphs can capture. Nothing here imports the DSL; a build comes from a directory (AOT) or, when
the DSL is installed, from the JIT cache (megakernel.kernel.jit).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megakernel.models import ModelConfig
from megakernel.runtime import (
    ArgumentError,
    KernelUnavailable,
    LoadedKernel,
    Manifest,
    check_header,
    check_lengths,
    check_records,
    device_info,
    load_manifest,
    validate_args,
)

ENV_BUILD_DIR = "MEGAKERNEL_BUILD_DIR"


# ---- registry of builds the op may launch -------------------------------------------------------
@dataclass
class _Entry:
    """What a `kernel` id launches: a GPU build (`manifest`), or a program that the CPU executor
    serves when the op gets CPU tensors (`prog`, `packed`)."""

    manifest: Manifest | None = None
    loaded: LoadedKernel | None = None
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


def register_build(manifest: Manifest) -> int:
    """Make a build launchable by the op; returns the `kernel` id to pass to decode_step."""
    for k, e in _REGISTRY.items():
        if (e.manifest is not None and e.manifest.path == manifest.path
                and e.manifest.data == manifest.data):
            return k
    return _add(_Entry(manifest))


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
    """The GPU launch of a registered build: every argument checked first, then one driver
    call (ArgumentError "the kernel needs CUDA tensors" for CPU tensors after the checks)."""
    e = _entry(kernel)
    if e.manifest is None:
        raise ArgumentError(f"kernel id {kernel} is a program for the CPU executor; it runs on "
                            f"CPU tensors, got {program.device}")
    lengths_off, tok_off, logits_off, s_max = _offsets(offsets)
    tensors = dict(program=program, counters=counters, weights=weights, f32=f32, bf16=bf16,
                   i32=i32, k_cache=k_cache, v_cache=v_cache, state=state)
    validate_args(e.manifest.spec, tensors, lengths_off=lengths_off, max_seq_len=s_max)
    _check_outputs(e, f32, i32, tok_off, logits_off, return_logits)  # before CUDA
    if e.loaded is None:
        e.loaded = LoadedKernel(e.manifest, program.device.index)
    e.loaded.launch(program.shape[0], tensors,
                    dict(queue_len=program.shape[1], s_max=s_max,  # = the cache's (checked)
                         lengths_off=lengths_off))
    return _outputs(e, f32, i32, tok_off, logits_off, return_logits)


@decode_step.register_kernel("cpu")
def _decode_step_cpu(program, counters, weights, f32, bf16, i32, k_cache, v_cache, state,
                     kernel, offsets, return_logits=False):
    """The same step on CPU tensors, served by the CPU executor over these very arenas (its
    checks on): what `gpu-check --simulate` and a machine without a GPU run."""
    from megakernel.executor import Executor

    e = _entry(kernel)
    if e.prog is None:  # a GPU build: its checks name what is wrong (CUDA tensors first)
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


# ---- a model's GPU state ------------------------------------------------------------------------
def _require_gpu() -> None:
    if not torch.cuda.is_available():
        raise KernelUnavailable(
            "the kernel backend needs an sm_90a (H100/H200) or sm_100a (B200) CUDA GPU and none "
            "is available here (torch.cuda.is_available() is False); use --backend reference or "
            "--backend cpu-executor on this machine")


def find_build(cfg: ModelConfig, batch: int, tokens: int, arch: str,
               build_dir: str | Path | None, replay_window: int = 0,
               paged=None) -> Manifest:  # noqa: ANN001 (program.paged.PagedKV | None)
    """The manifest to launch: `build_dir` / $MEGAKERNEL_BUILD_DIR (AOT; a single build
    DIR/<arch>/ or a build set DIR/<spec tag>/<arch>/) or the JIT cache (`replay_window`: for
    programs with that ReplaySSM window, 0 = the recurrent update; `paged`: the paged-KV build
    for this page pool)."""
    from megakernel.kernel.spec import make_spec

    # SpecError names what the kernel cannot run
    need = make_spec(cfg, batch, tokens, arch, replay_window=replay_window, paged=paged)
    build_dir = build_dir or os.environ.get(ENV_BUILD_DIR)
    if build_dir is None:
        from megakernel.kernel.jit import ensure_build

        build_dir = ensure_build(cfg, batch, tokens, arch, replay_window=replay_window)
    build_dir = Path(build_dir)
    if not (build_dir / arch / "manifest.json").is_file():  # a build set: DIR/<tag>/<arch>/
        tagged = build_dir / need.tag
        if (tagged / arch / "manifest.json").is_file():
            build_dir = tagged
    m = load_manifest(build_dir, arch)
    s = m.spec
    # everything the build bakes in as a constant (eps included: a checkpoint whose
    # rms_norm_eps differs from the build's would otherwise run with the wrong one)
    want = {k: v for k, v in need.to_dict().items()
            if k not in ("arch", "num_threads", "smem_stages", "timeline", "l2_window")}
    bad = {k: (s.get(k), v) for k, v in want.items() if s.get(k) != v}
    if bad:
        raise ArgumentError(
            f"the build in {m.path} does not serve this model/batch: "
            + ", ".join(f"{k} built {b} vs needed {n}" for k, (b, n) in bad.items())
            + f"; rebuild with `python -m megakernel build --batch {batch} --tokens {tokens}`")
    return m


TENSORS = ("program", "counters", "weights", "f32", "bf16", "i32", "k_cache", "v_cache",
           "state")


@dataclass
class DeviceState:
    """The kernel's arguments for one program: records, counters, arenas, KV cache, recurrent
    state."""

    prog: object  # megakernel.program.compiler.Program
    program: torch.Tensor
    counters: torch.Tensor
    weights: torch.Tensor
    f32: torch.Tensor
    bf16: torch.Tensor
    i32: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    state: torch.Tensor  # fp32 [buffers.state_numel]: conv windows, states, rings (persistent)
    offsets: list[int]  # [lengths_off, tokens_out_off, logits_off, S_MAX] for decode_step
    packed: object = None  # megakernel.program.pack.PackedWeights (`weights` is its arena)

    def region(self, arena: str, name: str) -> torch.Tensor:
        r = getattr(self.prog.buffers, arena)[name]
        return getattr(self, arena)[r.offset: r.offset + r.numel]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in TENSORS}

    def load_cache(self, cache) -> None:  # noqa: ANN001 (reference.model.Cache)
        """Copy a reference cache (bf16 mode) into the KV cache, the recurrent state arena (conv
        windows, states, rings, ring counts) and the lengths: what the first kernel step reads
        after a prefill by the reference."""
        from megakernel.executor.core import ExecutorError, load_cache

        try:
            load_cache(self.prog, cache, k=self.k_cache, v=self.v_cache, state=self.state,
                       i32=self.i32)
        except (ExecutorError, RuntimeError) as e:  # a cache of another shape than the program's
            raise ArgumentError(f"the reference cache does not fit the kernel's arguments: {e}"
                                ) from None


def allocate_state(cfg: ModelConfig, weights: dict[str, torch.Tensor] | None, prog,  # noqa: ANN001
                   device: str | torch.device, packed=None,  # noqa: ANN001
                   caches: tuple[torch.Tensor, torch.Tensor] | None = None) -> DeviceState:
    """Pack the weights (or take `packed`, packed once for several programs) and allocate every
    buffer of `prog` on `device` (CPU works too: the layout is checked there); `caches`: K and V
    shared with other programs of one cache layout (paged buckets). Counters start at zero and
    are never reset (epochs)."""
    from megakernel.layers import kind
    from megakernel.program.pack import pack_weights

    buf, hdr, d = prog.buffers, prog.header, torch.device(device)
    packed = packed if packed is not None else pack_weights(cfg, weights, device=d)
    k_cache, v_cache = caches if caches is not None else (
        torch.zeros(buf.kv_shape, dtype=torch.bfloat16, device=d),
        torch.zeros(buf.v_shape, dtype=torch.bfloat16, device=d))
    st = DeviceState(
        prog=prog,
        program=prog.records().to(d),
        counters=torch.zeros(prog.counter_words(), dtype=torch.int32, device=d),
        weights=packed.arena.to(d),
        f32=torch.zeros(buf.f32_numel, dtype=torch.float32, device=d),
        bf16=torch.zeros(buf.bf16_numel, dtype=torch.bfloat16, device=d),
        i32=torch.zeros(buf.i32_numel, dtype=torch.int32, device=d),
        k_cache=k_cache, v_cache=v_cache,
        state=torch.zeros(buf.state_numel, dtype=torch.float32, device=d),
        offsets=[hdr["I32_LENGTHS_OFF"], hdr["I32_TOKENS_OUT_OFF"], hdr["F32_LOGITS_OFF"],
                 hdr["S_MAX"]],
        packed=packed,
    )
    for blk in cfg.blocks:  # host-written constants (RoPE tables, ...) and checkpoint tables
        for name, t in kind(blk.kind).constants(blk, cfg, prog.step_shape()).items():
            st.region("f32", name).copy_(t.reshape(-1))
    for (name, layer), t in packed.tables.items():
        r = buf.f32[name]
        row = buf.region_row(name, layer) * (r.numel // r.shape[0])
        st.region("f32", name)[row : row + t.numel()].copy_(t)
    return st


class Megakernel:
    """Packed weights, program, arenas and KV cache of one model on one GPU. `generate` runs
    prefill and decode on the kernel (megakernel.engine); `prefill` + `step` load a prefill by
    the torch reference (bf16 mode) instead, which the GPU checks compare decode steps from.

    On `device="cpu"` the same object runs the program compiled for `gpu` (a name of
    program/gpus.py, default h200) through the op's CPU implementation, the CPU executor: no GPU
    and no build are needed (`gpu-check --simulate`). `n_splits` forces the attention split count
    (default: the compiler's choice)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], batch: int,
                 tokens: int = 1, max_seq_len: int | None = None,
                 build_dir: str | Path | None = None, device: str | torch.device = "cuda",
                 replay_window: int | None = None, gpu: str | None = None,
                 n_splits: int | None = None):
        from megakernel.program.compiler import compile_program
        from megakernel.program.gpus import from_device
        from megakernel.program.gpus import gpu as named_gpu

        self.cfg, self.batch, self.tokens = cfg, batch, tokens
        self.device = torch.device(device)
        self.manifest: Manifest | None = None
        if self.device.type == "cpu":
            target = named_gpu(gpu or "h200")
        else:
            _require_gpu()
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            dev = device_info(self.device)
            self.manifest = find_build(cfg, batch, tokens, dev.arch, build_dir,
                                       replay_window=replay_window or 0)
            target = from_device(self.device.index)
        self.prog = compile_program(cfg, batch, target, tokens=tokens, max_seq_len=max_seq_len,
                                    replay_window=replay_window, n_splits=n_splits)
        self.max_seq_len = self.prog.max_seq_len
        if self.manifest is not None:
            check_records(self.prog.records(), self.manifest.spec)
            check_header(self.prog.header, self.manifest.spec)
        self.args = allocate_state(cfg, weights, self.prog, self.device)
        self.timeline: torch.Tensor | None = None  # the timeline build's records (timeline.py)
        if self.manifest is not None and self.manifest.spec.get("timeline"):
            from megakernel.timeline import attach_records

            self.timeline = attach_records(self.args)  # it writes past the program records
        self.kernel_id = (register_build(self.manifest) if self.manifest is not None
                          else register_program(self.prog, self.args.packed))
        for name in TENSORS:
            setattr(self, name, getattr(self.args, name))
        self.offsets = self.args.offsets
        self.lengths: list[int] = [0] * batch  # host mirror of lengths (the op advances them)
        self._weights_hf = weights
        self._how = dict(build_dir=build_dir, device=self.device, replay_window=replay_window,
                         gpu=gpu, n_splits=n_splits)  # what a sibling program for T tokens needs
        self._chunks: dict[int, Megakernel | None] = {}  # T -> the prefill program (None: no build)

    def _region(self, arena: str, name: str) -> torch.Tensor:
        return self.args.region(arena, name)

    @property
    def logits(self) -> torch.Tensor:
        """[N, V] fp32 logits of the last step (a view of the scratch arena)."""
        return self._region("f32", "logits").view(self.prog.rows, self.cfg.vocab_size)

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill with the reference (bf16 mode) on this GPU, its cache copied into the KV cache;
        returns the first tokens [B]. (`generate` prefills on the program instead.)"""
        from megakernel.reference.model import ReferenceModel

        if len(prompts) != self.batch:
            raise ArgumentError(f"{len(prompts)} prompts for a kernel built for batch "
                                f"{self.batch}")
        ref = ReferenceModel(self.cfg, self._weights_hf, mode="bf16", device=self.device,
                             replay_window=self.prog.replay_window or None)
        cache = ref.new_cache(self.batch, self.max_seq_len)
        logits = ref.prefill(cache, prompts)  # [B, V] fp32
        self.args.load_cache(cache)
        self.lengths = [int(x) for x in cache.lengths.tolist()]
        return _greedy(logits)

    def step(self, tokens: torch.Tensor | None = None, return_logits: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel step; `tokens` [B, T] (None: the tokens the last step fed back)."""
        if self.manifest is not None:  # the executor checks its own
            check_lengths(self.manifest.spec, self.lengths, self.max_seq_len)
        if tokens is not None:
            t = torch.as_tensor(tokens).reshape(-1)
            if t.numel() != self.prog.rows:
                raise ArgumentError(f"tokens must be [{self.batch}, {self.tokens}], got "
                                    f"{tuple(torch.as_tensor(tokens).shape)}")
            if bool(((t < 0) | (t >= self.cfg.vocab_size)).any()):
                raise ArgumentError(f"token ids must be in [0, {self.cfg.vocab_size})")
            self._region("i32", "tokens_in").copy_(t.to(torch.int32))
        out = torch.ops.megakernel.decode_step(*self.op_args(return_logits))
        self.lengths = [n + self.tokens for n in self.lengths]
        return out

    def op_args(self, return_logits: bool = False) -> tuple:
        """The arguments of one `torch.ops.megakernel.decode_step` of this program (what a CUDA
        graph captures): the tensors in TENSORS order, the kernel id, the offsets."""
        return (*(getattr(self, n) for n in TENSORS), self.kernel_id, self.offsets,
                return_logits)

    def fill_context(self, context: int, seed: int = 0) -> None:
        """Stand in for a prefill of `context` tokens per sequence without the reference (a
        benchmark of a model too large to hold twice, `weights` drawn on the device): every
        sequence's length is `context`, its KV (or latent) cache positions below it random
        N(0, 1) bf16 values, its recurrent state, conv windows and rings zero. Step times do not
        depend on the values; logits of such steps are checked only for being finite."""
        if not 0 <= context <= self.max_seq_len - self.tokens:
            raise ArgumentError(f"context {context} leaves no room for a step of {self.tokens} "
                                f"token(s) in max_seq_len {self.max_seq_len}")
        self.reset()
        g = torch.Generator(device=self.device).manual_seed(seed)
        for cache in (self.k_cache, self.v_cache):
            if cache.dim() == 5 and not self.prog.buffers.paged:  # [slots, B, heads, S_max, D]
                cache[:, :, :, :context].normal_(generator=g)
            else:
                cache.normal_(generator=g)
        self._region("i32", "lengths").fill_(context)
        self.lengths = [context] * self.batch

    def reset(self) -> None:
        """Empty every sequence: lengths, ring counts and recurrent state to zero (KV slots past
        the lengths are never read)."""
        for arena, name in self.prog.buffers.persistent:
            self.args.region(arena, name).zero_()
        self.state.zero_()
        self.lengths = [0] * self.batch

    def chunk_program(self, tokens: int) -> Megakernel | None:
        """The same model and batch built for `tokens` per step (sharing this one's cache length),
        for a chunked prefill; None when there is no build for it (then the prefill runs one token
        per step). Made once per T."""
        if tokens not in self._chunks:
            try:
                self._chunks[tokens] = Megakernel(self.cfg, self._weights_hf, self.batch, tokens,
                                                  self.max_seq_len, **self._how)
            except Exception as e:  # no build for T (or no DSL to make one): one token a step
                print(f"prefill one token per step: no {tokens}-token program ({e})",
                      file=sys.stderr)
                self._chunks[tokens] = None
        return self._chunks[tokens]

    def generate_program(self, prompts: list[list[int]], steps: int,
                         eos_token_id: int | None = None, live: list[bool] | None = None,
                         chunk_tokens: int = 1):  # noqa: ANN201 (engine.Generated)
        """Greedy generation with the prefill on the program too (megakernel.engine: the common
        prompt prefix in chunks of `chunk_tokens` by `chunk_program`, when built, then one token
        per step: every row consumes its next prompt token or its own last new token), from
        empty caches: the first token comes from the kernel (or the CPU executor on "cpu").
        Returns engine.Generated (tokens, first_token_s: time to first token)."""
        from megakernel.engine import program_generate

        if self.tokens != 1:
            raise ArgumentError("generation runs one token per step; build with --tokens 1")
        if len(prompts) != self.batch or any(len(p) == 0 for p in prompts):
            raise ArgumentError(f"generation needs {self.batch} non-empty prompts, got "
                                f"{[len(p) for p in prompts]} tokens")
        need = max(len(p) for p in prompts) + steps - 1
        if need > self.max_seq_len:
            raise ArgumentError(f"the longest prompt plus {steps} new tokens needs {need} "
                                f"positions; the program has max_seq_len {self.max_seq_len}")
        self.reset()
        chunk = None
        if chunk_tokens > 1 and min(len(p) for p in prompts) > chunk_tokens:
            ck = self.chunk_program(chunk_tokens)
            if ck is not None:
                ck.reset()
                chunk = _OpStepper(ck)
        return program_generate(_OpStepper(self), prompts, steps, eos_token_id, chunk=chunk,
                                live=live)

    def generate(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        """New tokens per prompt, prefill and decode on the program (`generate_program`)."""
        from megakernel.engine import PREFILL_CHUNK

        if steps <= 0:
            return [[] for _ in prompts]
        return self.generate_program(prompts, steps, chunk_tokens=PREFILL_CHUNK).tokens


class _OpStepper:
    """A Megakernel as an engine.Stepper: each step is one `decode_step` through the op."""

    def __init__(self, mk: Megakernel) -> None:
        self.mk, self.prog, self.tokens = mk, mk.prog, mk.tokens
        self.n = 0  # steps run, named by a non-finite error

    def step(self, tokens: torch.Tensor | None) -> torch.Tensor:
        from megakernel.finite import check_logits

        out, _ = self.mk.step(tokens)
        check_logits(self.mk.logits, self.n, "kernel")  # greedy of NaN logits is token 0
        self.n += 1
        return out.view(self.mk.batch, self.tokens).to(torch.int64)

    def arenas(self) -> dict[str, torch.Tensor]:
        return dict(i32=self.mk.i32, state=self.mk.state, k=self.mk.k_cache, v=self.mk.v_cache)

    def sync(self) -> None:
        if self.mk.device.type == "cuda":
            torch.cuda.synchronize(self.mk.device)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax with the lowest index on ties (torch.argmax's documented behaviour)."""
    return torch.argmax(logits, dim=-1)


def generate(cfg: ModelConfig, weights: dict[str, torch.Tensor], prompts: list[list[int]],
             steps: int, max_seq_len: int | None = None, seed: int = 0,
             build_dir: str | Path | None = None, replay_window: int | None = None
             ) -> list[list[int]]:
    """Greedy generation for `--backend kernel`: new tokens per prompt (prompt excluded).

    What the kernel cannot run (opcodes without a device handler, e.g. every recurrent kind) is
    refused first, by name, on any machine; then the GPU is required."""
    from megakernel.kernel.spec import check_kernel_support

    del seed  # the kernel is deterministic; kept for the backend signature
    check_kernel_support(cfg, bool(replay_window))  # SpecError: before asking for a GPU
    _require_gpu()
    if not prompts:
        raise ArgumentError("no prompts given")
    if max_seq_len is None:
        max_seq_len = max(len(p) for p in prompts) + max(steps, 1)
    mk = Megakernel(cfg, weights, batch=len(prompts), tokens=1, max_seq_len=max_seq_len,
                    build_dir=build_dir, replay_window=replay_window)
    return mk.generate(prompts, steps)
