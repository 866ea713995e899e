"""One model's kernel, emulated, against the CPU executor of the same program: the rung's check.

`run_case(Case(...))` compiles the program for a small emulated GPU (`sms` CTAs), finds or builds
the kernel for the model's shapes (sm_90a), and runs `steps` decode steps twice from the same
arguments: on the CPU executor and on the emulator (a scheduler seed per step). Each step poisons
the scratch arenas first. Verdicts (gpu_check.compare): tokens equal; each row of logits and each
head vector of the KV cache within two bf16 ulps of the row's scale of the executor's
(`same_program`: the two round at the same points, but a summation order may flip one, and the
flip moves what the next matvec sums); the recurrent state arena within STATE_RTOL of its scale.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from megakernel.emulator.machine import LaunchStats
from megakernel.launch.emulated import EMULATED_SMS, EmulatedKernel


@dataclass(frozen=True)
class Case:
    """A model and build variant to emulate."""

    model: str
    batch: int = 1
    tokens: int = 1  # tokens a sequence a step (T: a multi-token step's causal rows)
    replay_window: int | None = None
    fp8: str = ""  # "" (bf16) | "channel" | "block"
    steps: int = 2
    sms: int = EMULATED_SMS
    seed: int = 0  # the scheduler seed of the first step (step s uses seed + s)
    max_seq_len: int = 64
    # keys each sequence has cached before the first step (random K/V rows, the same on both
    # sides): enough of them run attention's key loop over several chunks of 32 and splits
    context: int = 0
    n_splits: int | None = None  # attention splits (None: the compiler's choice)

    @property
    def label(self) -> str:
        extra = [f"B={self.batch}"] + ([f"T={self.tokens}"] if self.tokens > 1 else [])
        if self.context:
            extra.append(f"context {self.context}")
        if self.n_splits:
            extra.append(f"{self.n_splits} splits")
        if self.replay_window:
            extra.append(f"replay {self.replay_window}")
        if self.fp8:
            extra.append(f"fp8 {self.fp8}")
        return f"{self.model} ({', '.join(extra)}, seed {self.seed})"


@dataclass
class StepResult:
    step: int
    tokens: list[int]
    executor_tokens: list[int]
    logits: dict[str, Any]
    stats: LaunchStats

    @property
    def ok(self) -> bool:
        return self.tokens == self.executor_tokens and self.logits["ok"]


@dataclass
class CaseResult:
    case: Case
    steps: list[StepResult] = field(default_factory=list)
    caches: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps) and all(c["ok"] for c in self.caches.values())

    def summary(self) -> str:
        rows = [f"{self.case.label}: {'ok' if self.ok else 'FAILED'}"]
        for s in self.steps:
            rows.append(f"  step {s.step}: tokens {s.tokens} (executor {s.executor_tokens}), "
                        f"logits max diff {s.logits['max_diff']:.3g} "
                        f"({s.logits['ulps']:.2f} ulps of the row, {s.logits['over']} over), "
                        f"{s.stats.warp_instructions} warp-instructions in "
                        f"{s.stats.seconds:.1f} s")
        for name, c in self.caches.items():
            extra = f" ({c['ulps']:.2f} ulps of the row)" if "ulps" in c else ""
            rows.append(f"  {name}: max diff {c['max_diff']:.3g}{extra} "
                        f"{'ok' if c['ok'] else 'FAILED'}")
        return "\n".join(rows)


def model_config(case: Case):  # noqa: ANN201 (ModelConfig)
    from megakernel.models import preset

    cfg = preset(case.model)
    if case.fp8:
        from megakernel.models.fp8 import Fp8Format

        cfg = cfg.replace(quant=Fp8Format(case.fp8))
    return cfg


def model_weights(cfg, seed: int = 0):  # noqa: ANN001, ANN201
    """Random weights of the preset; an FP8 model's are its bf16 weights quantized on load."""
    from megakernel.models.weights import random_weights

    if cfg.quant is None:
        return random_weights(cfg, seed=seed)
    from megakernel.gpu_check.case import quantized

    return quantized(cfg, random_weights(cfg.replace(quant=None), seed=seed), "cpu")


def run_case(case: Case, build_dir: str | None = None) -> CaseResult:
    """Emulate `case.steps` steps and compare each with the CPU executor's."""
    from megakernel.executor import Executor
    from megakernel.gpu_check.compare import same_program, state_parity
    from megakernel.launch.device_state import allocate_state, find_build
    from megakernel.program.compiler import compile_program
    from megakernel.program.gpus import gpu as named_gpu

    cfg = model_config(case)
    target = dataclasses.replace(named_gpu("h200"), num_sms=case.sms)
    prog = compile_program(cfg, case.batch, target, tokens=case.tokens,
                           max_seq_len=case.max_seq_len,
                           replay_window=case.replay_window, context=case.context,
                           n_splits=case.n_splits)
    manifest = find_build(cfg, case.batch, case.tokens, "sm_90a", build_dir,
                          replay_window=case.replay_window or 0)
    st = allocate_state(cfg, model_weights(cfg), prog, "cpu")
    n = prog.rows
    st.region("i32", "tokens_in").copy_(
        (torch.arange(n, dtype=torch.int32) * 7 + 5) % cfg.vocab_size)
    if case.context:
        cache_context(st, case.batch, case.context, case.seed)
    ref = {k: v.clone() for k, v in st.tensors().items()}
    ex = Executor(prog, st.packed, arenas=dict(f32=ref["f32"], bf16=ref["bf16"], i32=ref["i32"],
                                               k=ref["k_cache"], v=ref["v_cache"],
                                               state=ref["state"]))
    kernel = EmulatedKernel(manifest, seed=case.seed)
    tensors = st.tensors()
    ints = dict(queue_len=st.program.shape[1], s_max=st.offsets[3],
                lengths_off=st.offsets[0])
    _, tok_off, logits_off, _ = st.offsets
    out = CaseResult(case)
    for s in range(case.steps):
        ex.poison()
        want = ex.step().view(-1).tolist()
        prog.buffers.poison_scratch(st.f32, st.bf16)
        st.i32[tok_off:tok_off + n].fill_(-1)
        kernel.launch(st.program.shape[0], tensors, ints)
        stats = kernel.last
        got = st.i32[tok_off:tok_off + n].tolist()
        lo = slice(logits_off, logits_off + n * cfg.vocab_size)
        out.steps.append(StepResult(s, got, want, same_program(st.f32[lo].view(n, -1),
                                                    ref["f32"][lo].view(n, -1)),
                                    stats))
    lengths = st.i32[st.offsets[0]:st.offsets[0] + case.batch].tolist()
    for name in ("k_cache", "v_cache"):
        a, b = st.tensors()[name], ref[name]
        parts = [(a[:, i, :, :ln], b[:, i, :, :ln]) for i, ln in enumerate(lengths)]
        d = a.shape[-1]
        out.caches[name] = same_program(torch.cat([p[0].reshape(-1, d) for p in parts]),
                                        torch.cat([p[1].reshape(-1, d) for p in parts]))
    if st.state.numel():
        out.caches["state"] = state_parity(st.state, ref["state"])
    return out


def cache_context(st, batch: int, context: int, seed: int) -> None:  # noqa: ANN001 (DeviceState)
    """`context` cached keys per sequence: lengths = context and random K/V rows below it in
    every cache slot (unit scale, so that the scores spread over the softmax)."""
    k, v = st.tensors()["k_cache"], st.tensors()["v_cache"]
    if context > k.shape[3]:
        raise ValueError(f"context {context} does not fit the cache's {k.shape[3]} positions")
    gen = torch.Generator().manual_seed(1000 + seed)
    for t in (k, v):
        rows = torch.randn(t[:, :, :, :context].shape, generator=gen)
        t[:, :, :, :context] = rows.to(t.dtype)
    st.i32[st.offsets[0]:st.offsets[0] + batch] = context
