"""The kernel backend: `Megakernel` owns one model's program, packed weights, arenas and KV cache on
a GPU and steps it through the op (torch_op.decode_step); `generate` is `--backend kernel`.

Generation runs prefill and decode on the program (megakernel.serve.engine). `prefill` + `step` load
a prefill by the torch reference instead, which the GPU checks compare decode steps from. On
`device="cpu"` the same object runs through the op's CPU implementation, the CPU executor: no GPU
and no build are needed (`gpu-check --simulate`). With `emulate=True` (on the CPU) it runs the
kernel's own build instead, its PTX on the emulator (`--backend emulator`, `gpu-check
--emulate`): the program compiled for an emulated GPU of EMULATED_SMS SMs, the build found in
`build_dir` or made on this machine through the DSL (the JIT cache).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from megakernel.kernel.host.limits import step_tokens
from megakernel.launch.checks import ArgumentError, check_header, check_lengths, check_records
from megakernel.launch.device_state import TENSORS, allocate_state, find_build
from megakernel.launch.runtime import KernelUnavailable, Manifest, device_info
from megakernel.launch.torch_op import register_build, register_program
from megakernel.models import ModelConfig


def _emulated_target(gpu: str | None):  # noqa: ANN202 (program.gpus.GPU)
    """The GPU an emulated program is compiled for: `gpu` (default h200) with EMULATED_SMS SMs."""
    import dataclasses

    from megakernel.launch.emulated import EMULATED_SMS
    from megakernel.program.gpus import gpu as named_gpu

    return dataclasses.replace(named_gpu(gpu or "h200"), num_sms=EMULATED_SMS)


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise KernelUnavailable(
            "the kernel backend needs an sm_90a (H100/H200) or sm_100a (B200) CUDA GPU and none "
            "is available here (torch.cuda.is_available() is False); use --backend reference or "
            "--backend cpu-executor on this machine")


class Megakernel:
    """Packed weights, program, arenas and KV cache of one model on one GPU. `generate` runs
    prefill and decode on the kernel (megakernel.serve.engine); `prefill` + `step` load a prefill by
    the torch reference (bf16 mode) instead, which the GPU checks compare decode steps from.

    On `device="cpu"` the same object runs the program compiled for `gpu` (a name of
    program/gpus.py, default h200) through the op's CPU implementation, the CPU executor: no GPU
    and no build are needed (`gpu-check --simulate`). `emulate=True` (CPU only) runs the
    kernel's build for that GPU's arch on the emulator instead (module docstring). `n_splits`
    forces the attention split count (default: the compiler's choice)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], batch: int,
                 tokens: int = 1, max_seq_len: int | None = None,
                 build_dir: str | Path | None = None, device: str | torch.device = "cuda",
                 replay_window: int | None = None, gpu: str | None = None,
                 n_splits: int | None = None, drafts: int = 0, ngram: int = 0,
                 caches: tuple[torch.Tensor, torch.Tensor] | None = None,
                 emulate: bool = False):
        from megakernel.program.compiler import compile_program
        from megakernel.program.gpus import from_device
        from megakernel.program.gpus import gpu as named_gpu

        tokens = step_tokens(tokens, drafts)  # a speculative step: the last token and k drafts
        self.cfg, self.batch, self.tokens = cfg, batch, tokens
        self.device = torch.device(device)
        self.emulated = emulate
        self.manifest: Manifest | None = None
        arch = None
        if emulate:
            if self.device.type != "cpu":
                raise ArgumentError(f"the emulator runs on CPU tensors; got device {device}")
            target = _emulated_target(gpu)
            arch = target.arch
        elif self.device.type == "cpu":
            target = named_gpu(gpu or "h200")
        else:
            require_gpu()
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            arch = device_info(self.device).arch
            target = from_device(self.device.index)
        if arch is not None:
            spec_kw = {}
            if drafts:  # refused before any build is looked for or made
                spec_kw = _speculative_build(cfg, batch, tokens, arch, replay_window or 0,
                                             drafts, ngram)
            self.manifest = find_build(cfg, batch, tokens, arch, build_dir,
                                       replay_window=replay_window or 0, **spec_kw)
            if drafts:
                _check_speculative_manifest(self.manifest, ngram)
        self.prog = compile_program(cfg, batch, target, tokens=tokens, max_seq_len=max_seq_len,
                                    replay_window=replay_window, n_splits=n_splits,
                                    drafts=drafts, ngram=ngram)
        self.max_seq_len = self.prog.max_seq_len
        if self.manifest is not None:
            check_records(self.prog.records(), self.manifest.spec, self.prog.layout)
            check_header(self.prog.header, self.manifest.spec)
        if caches is not None and (tuple(caches[0].shape), tuple(caches[1].shape)) != (
                self.prog.buffers.kv_shape, self.prog.buffers.v_shape):
            caches = None  # another cache layout: copy_state carries the cache instead
        self.args = allocate_state(cfg, weights, self.prog, self.device, caches=caches)
        self.timeline: torch.Tensor | None = None  # the timeline build's records (timeline.py)
        if self.manifest is not None and self.manifest.spec.get("timeline"):
            from megakernel.measure.timeline import attach_records

            self.timeline = attach_records(self.args)  # it writes past the program records
        self.kernel_id = (register_build(self.manifest, emulate) if self.manifest is not None
                          else register_program(self.prog, self.args.packed))
        for name in TENSORS:
            setattr(self, name, getattr(self.args, name))
        self.offsets = self.args.offsets
        self.lengths: list[int] = [0] * batch  # host mirror of lengths (the op advances them)
        self._weights_hf = weights
        # what a sibling program for T tokens needs
        self._how = dict(build_dir=build_dir, device=self.device, replay_window=replay_window,
                         gpu=gpu, n_splits=n_splits, emulate=emulate)
        self._chunks: dict[int, Megakernel | None] = {}  # T -> the prefill program (None: no build)
        self._specs: dict[tuple[int, int], Megakernel] = {}  # (k, ngram) -> speculative program

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

    def speculative_program(self, drafts: int, ngram: int = 0) -> Megakernel:
        """The same model and batch compiled for a speculative step of 1 + `drafts` tokens
        (`ngram`: with the device n-gram drafter), sharing this one's cache length and, where
        the layouts agree, its KV cache. Made once per (drafts, ngram); a build without the
        speculative step is refused (KernelUnavailable)."""
        key = (drafts, ngram)
        if key not in self._specs:
            self._specs[key] = Megakernel(self.cfg, self._weights_hf, self.batch, 1 + drafts,
                                          self.max_seq_len, drafts=drafts, ngram=ngram,
                                          caches=(self.k_cache, self.v_cache), **self._how)
        return self._specs[key]

    def speculative_step(self, drafts: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of a speculative program through torch.ops.megakernel.speculative_step:
        `drafts` [B, k] (None: the device drafter's) -> (greedy tokens [B, 1 + k] int32,
        accepted drafts [B] int32, -1 for a row whose cache is full). Row b*T of tokens_in, the
        last token, is the bonus the previous step fed back (write it before the first step)."""
        if not self.prog.drafts:
            raise ArgumentError("speculative_step needs a program compiled with drafts "
                                "(Megakernel(..., drafts=k) or speculative_program(k))")
        if self.manifest is not None:  # the executor checks its own
            check_lengths(self.manifest.spec, self.lengths, self.max_seq_len)
        if drafts is not None:
            drafts = torch.as_tensor(drafts, device=self.device)
            if drafts.numel() and bool(((drafts < 0) | (drafts >= self.cfg.vocab_size)).any()):
                raise ArgumentError(f"draft token ids must be in [0, {self.cfg.vocab_size})")
        tokens, accepted = torch.ops.megakernel.speculative_step(
            *(getattr(self, n) for n in TENSORS), self.kernel_id, self.args.spec_offsets, drafts)
        self.lengths = [n + max(0, a + 1) for n, a in zip(self.lengths, accepted.tolist(),
                                                          strict=True)]
        return tokens, accepted

    def generate_program(self, prompts: list[list[int]], steps: int,
                         eos_token_id: int | None = None, live: list[bool] | None = None,
                         chunk_tokens: int = 1, speculative=None,  # noqa: ANN001
                         drafts_fn=None):  # noqa: ANN001, ANN201 (engine.Generated)
        """Greedy generation with the prefill on the program too (megakernel.serve.engine: the
        common prompt prefix in chunks of `chunk_tokens` by `chunk_program`, when built, then one
        token per step: every row consumes its next prompt token or its own last new token), from
        empty caches: the first token comes from the kernel (or the CPU executor on "cpu").
        `speculative` (a megakernel.serve.speculative.Speculative): then steps of 1 + k tokens on
        `speculative_program` (drafted on the device for ngram:K, else by `drafts_fn`). Returns
        engine.Generated (tokens, first_token_s: time to first token, accepted)."""
        from megakernel.serve.engine import program_generate, spec_max_seq_len

        if self.tokens != 1:
            raise ArgumentError("generation runs one token per step; build with --tokens 1")
        if len(prompts) != self.batch or any(len(p) == 0 for p in prompts):
            raise ArgumentError(f"generation needs {self.batch} non-empty prompts, got "
                                f"{[len(p) for p in prompts]} tokens")
        k = speculative.k if speculative is not None else 0
        need = (spec_max_seq_len(max(len(p) for p in prompts), steps, k) if k
                else max(len(p) for p in prompts) + steps - 1)
        if need > self.max_seq_len:
            what = f" and {k} drafts a step" if k else ""
            raise ArgumentError(f"the longest prompt plus {steps} new tokens{what} needs {need} "
                                f"positions; the program has max_seq_len {self.max_seq_len}")
        if k and drafts_fn is None and speculative.ngram == 0:
            raise ArgumentError(f"speculative {speculative} drafts on the host: pass drafts_fn")
        spec = None
        if k:  # made (and refused, without the build) before any step runs
            sp = self.speculative_program(k, speculative.ngram if drafts_fn is None else 0)
            sp.reset()
            spec = _SpecOpStepper(sp)
        self.reset()
        chunk = None
        if chunk_tokens > 1 and min(len(p) for p in prompts) > chunk_tokens:
            ck = self.chunk_program(chunk_tokens)
            if ck is not None:
                ck.reset()
                chunk = _OpStepper(ck)
        return program_generate(_OpStepper(self), prompts, steps, eos_token_id, chunk=chunk,
                                live=live, spec=spec, drafts_fn=drafts_fn)

    def generate(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        """New tokens per prompt, prefill and decode on the program (`generate_program`)."""
        from megakernel.serve.engine import PREFILL_CHUNK

        if steps <= 0:
            return [[] for _ in prompts]
        return self.generate_program(prompts, steps, chunk_tokens=PREFILL_CHUNK).tokens


class _OpStepper:
    """A Megakernel as an engine.Stepper: each step is one `decode_step` through the op."""

    def __init__(self, mk: Megakernel) -> None:
        self.mk, self.prog, self.tokens = mk, mk.prog, mk.tokens
        self.n = 0  # steps run, named by a non-finite error

    def step(self, tokens: torch.Tensor | None) -> torch.Tensor:
        from megakernel.common.finite import check_logits

        out, _ = self.mk.step(tokens)
        check_logits(self.mk.logits, self.n, "kernel")  # greedy of NaN logits is token 0
        self.n += 1
        return out.view(self.mk.batch, self.tokens).to(torch.int64)

    def arenas(self) -> dict[str, torch.Tensor]:
        return dict(i32=self.mk.i32, state=self.mk.state, k=self.mk.k_cache, v=self.mk.v_cache)

    def sync(self) -> None:
        if self.mk.device.type == "cuda":
            torch.cuda.synchronize(self.mk.device)


class _SpecOpStepper(_OpStepper):
    """A speculative Megakernel as an engine.Stepper: each step is one `speculative_step`
    through the op; a feed [B, 1 + k] writes the last tokens and passes the drafts in."""

    def step(self, tokens: torch.Tensor | None) -> torch.Tensor:
        from megakernel.common.finite import check_logits

        mk, drafts = self.mk, None
        if tokens is not None:
            t = torch.as_tensor(tokens).reshape(mk.batch, mk.tokens)
            if bool(((t < 0) | (t >= mk.cfg.vocab_size)).any()):
                raise ArgumentError(f"token ids must be in [0, {mk.cfg.vocab_size})")
            mk._region("i32", "tokens_in").view(mk.batch, mk.tokens)[:, 0].copy_(t[:, 0])
            drafts = t[:, 1:].to(mk.device)
        out, _ = mk.speculative_step(drafts)
        check_logits(mk.logits, self.n, "kernel")
        self.n += 1
        return out.view(mk.batch, mk.tokens).to(torch.int64)


def _speculative_build(cfg: ModelConfig, batch: int, tokens: int, arch: str,
                       replay_window: int, drafts: int, ngram: int) -> dict:
    """KernelUnavailable, before a build is looked for or made, unless the kernel's build of
    this model has the speculative step (ACCEPT, and NGRAM for the device drafter); returns
    find_build's keywords for it."""
    from megakernel.common.errors import SpecError
    from megakernel.kernel.config.model_spec import make_spec

    try:
        need = make_spec(cfg, batch, tokens, arch, replay_window=replay_window, drafts=drafts,
                         ngram=ngram)
    except SpecError as e:
        raise KernelUnavailable(f"speculative decoding on the kernel: {e}") from None
    _require_speculative_ops(need.ops, ngram, f"the kernel build for {cfg.name or cfg.family}")
    return dict(drafts=drafts, ngram=ngram)


def _check_speculative_manifest(manifest: Manifest, ngram: int) -> None:
    _require_speculative_ops(manifest.spec.get("ops", ()), ngram, f"the build in {manifest.path}")


def _require_speculative_ops(ops, ngram: int, what: str) -> None:  # noqa: ANN001
    from megakernel import isa

    need = [op for op in isa.step_ops(drafts=1, ngram=ngram) if op not in isa.step_ops()]
    missing = [op.name for op in need if int(op) not in {int(o) for o in ops}]
    if missing:
        raise KernelUnavailable(
            f"speculative decoding on the kernel needs the speculative step's device handlers "
            f"({', '.join(missing)}), which {what} does not have; run it with --backend "
            f"cpu-executor (or reference) for now")


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax with the lowest index on ties (torch.argmax's documented behaviour)."""
    return torch.argmax(logits, dim=-1)


def generate(cfg: ModelConfig, weights: dict[str, torch.Tensor], prompts: list[list[int]],
             steps: int, max_seq_len: int | None = None, seed: int = 0,
             build_dir: str | Path | None = None, replay_window: int | None = None,
             emulate: bool = False) -> list[list[int]]:
    """Greedy generation for `--backend kernel` (`emulate`: `--backend emulator`, the same
    build's PTX on the emulator, on the CPU): new tokens per prompt (prompt excluded).

    What the kernel cannot run (opcodes without a device handler) is refused first, by name, on
    any machine; then the GPU is required (not by the emulator)."""
    from megakernel.kernel.config.model_spec import check_kernel_support

    del seed  # the kernel is deterministic; kept for the backend signature
    check_kernel_support(cfg, bool(replay_window))  # SpecError: before asking for a GPU
    if not emulate:
        require_gpu()
    if not prompts:
        raise ArgumentError("no prompts given")
    if max_seq_len is None:
        max_seq_len = max(len(p) for p in prompts) + max(steps, 1)
    mk = Megakernel(cfg, weights, batch=len(prompts), tokens=1, max_seq_len=max_seq_len,
                    build_dir=build_dir, replay_window=replay_window, **_where(emulate))
    return mk.generate(prompts, steps)


def emulated_generate(*args, **kwargs) -> list[list[int]]:  # noqa: ANN002, ANN003
    """`--backend emulator`: `generate` on the emulator."""
    return generate(*args, **kwargs, emulate=True)


def _where(emulate: bool) -> dict:
    """Megakernel's keywords of the kernel's place: the GPU, or the emulator on the CPU."""
    return dict(device="cpu", emulate=True) if emulate else {}


def speculative_generate(cfg: ModelConfig, weights: dict[str, torch.Tensor],
                         prompts: list[list[int]], steps: int, max_seq_len: int | None = None,
                         seed: int = 0, replay_window: int | None = None, speculative=None,  # noqa: ANN001
                         drafts_fn=None, build_dir: str | Path | None = None,  # noqa: ANN001
                         emulate: bool = False):  # noqa: ANN201
    """`--backend kernel --speculative METHOD`: greedy speculative generation on the kernel
    (Megakernel.generate_program with `speculative`; `emulate`: on the emulator); returns
    engine.Generated. Refused by name, before a GPU is asked for, where the kernel cannot run
    the model."""
    from megakernel.kernel.config.model_spec import check_kernel_support
    from megakernel.serve.engine import PREFILL_CHUNK, spec_max_seq_len

    del seed
    check_kernel_support(cfg, bool(replay_window), drafts=speculative.k,
                         ngram=speculative.ngram if drafts_fn is None else 0)
    if not emulate:
        require_gpu()
    if not prompts:
        raise ArgumentError("no prompts given")
    if max_seq_len is None:
        max_seq_len = spec_max_seq_len(max(len(p) for p in prompts), steps, speculative.k)
    mk = Megakernel(cfg, weights, batch=len(prompts), tokens=1, max_seq_len=max_seq_len,
                    build_dir=build_dir, replay_window=replay_window, **_where(emulate))
    return mk.generate_program(prompts, steps, chunk_tokens=PREFILL_CHUNK,
                               speculative=speculative, drafts_fn=drafts_fn)


def emulated_speculative_generate(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    """`--backend emulator --speculative METHOD`: `speculative_generate` on the emulator."""
    return speculative_generate(*args, **kwargs, emulate=True)
