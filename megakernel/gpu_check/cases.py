"""What gpu-check runs: cases, the kernel variants they run on, and the stages they come in.

Stage 0 asks the one question that must be answered first (does the kernel launch, finish and agree
at all: the smallest model, B = 1, 8 steps, the global-memory variant before the default one);
stage 1 covers the shapes (the quick tiny set with Nemotron-H's attention and relu^2 blocks,
Qwen3.5's gated attention, the recurrent layers of Qwen3.5, Nemotron-H and Kimi Linear (with
Kimi's MLA and routed MoE) with state parity against the executor, the paged KV build against
the contiguous one, llama-mid cases that reach a K-split > 1 at B = 1 and K-chunked slabs at
B = 16 on both GEMV paths, several attention splits with an empty one, FP8 weights with channel
and block scales on both GEMV paths); stage 2 runs the real presets (dense and hybrid, some
against the CPU executor too, Llama-3.2-1B in FP8 too) and then the benchmark with what the cost
model assumes, measured in the same run (Kimi Linear's 48B preset there only, its weights made on
the GPU; the FP8 Llama-3.2-1B next to its bf16 model, for the FP8 targets).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    tokens: int
    steps: int
    executor_steps: int = 0  # first steps also run by the CPU executor (same cache and tokens)
    bench: bool = False  # time it in the benchmark stage
    n_splits: int | None = None  # attention splits (None: the compiler's choice)
    cap_s: float = 60.0  # the longest it may take (weights, program, reference and all steps)
    paged: int = 0  # block size: also run the paged build next to the contiguous one (0: not)
    replay_window: int = 0  # ReplaySSM fold window L of the recurrent layers (0: recurrent)
    # weights drawn on the GPU (models.weights.LazyRandomWeights) and a random cache in place of
    # a prefill: a model too large to hold twice (packed and reference); benchmark only
    synthetic: bool = False
    # the weight format: "" bf16, or FP8 (e4m3) with scales per output "channel" or per 128x128
    # "block" (models.fp8.Fp8Format): the model is the preset quantized on load, judged against
    # the FP8 model's reference (its weights dequantized exactly), on a build of that format
    fp8: str = ""
    # a speculative step (layers/speculative.py): k drafts a step (tokens = 1 + k), the host's
    # scripted from the plain kernel's run so that every accepted count 0..k occurs, or with
    # `ngram` the device drafter's (gpu_check/spec_case.py)
    drafts: int = 0
    ngram: int = 0

    @property
    def build_kw(self) -> dict[str, int]:
        """make_spec's / build_arch's keywords of the case's build besides its shape."""
        return dict(replay_window=self.replay_window, drafts=self.drafts, ngram=self.ngram)

    @property
    def name(self) -> str:
        s = f" S={self.n_splits}" if self.n_splits is not None else ""
        return f"{self.model} B={self.batch} T={self.tokens}{s}" + (
            f" paged/{self.paged}" if self.paged else "") + (
            f" L={self.replay_window}" if self.replay_window else "") + (
            f" {self.weights}" if self.fp8 else "") + (
            f" k={self.drafts}" if self.drafts else "") + (
            f" ngram={self.ngram}" if self.ngram else "")

    @property
    def weights(self) -> str:
        """The weight format's label: "bf16", "fp8" (channel scales) or "fp8-block" (what the
        report shows and the targets' `weights` field names)."""
        return weights_label(self.fp8)

    def quant(self):  # noqa: ANN201 (models.fp8.Fp8Format | None)
        """The case's `ModelConfig.quant`: None for bf16."""
        if not self.fp8:
            return None
        from megakernel.models.fp8 import Fp8Format

        return Fp8Format(self.fp8)

    def config(self):  # noqa: ANN201 (ModelConfig)
        """The case's model: the preset in the case's weight format (full size; a simulated run
        cuts it, gpu_check.case.config). What prepare builds, and what every run makes."""
        from megakernel.models import preset

        cfg = preset(self.model)
        return cfg if not self.fp8 else cfg.replace(quant=self.quant())

    def pool(self):  # noqa: ANN201 (program.paged.PagedKV | None)
        """The page pool of a paged case (the paged build bakes it in, so it depends on the case
        alone): room for the longest prompt (< 24), the steps and 8 spare positions per
        sequence, 3 spare blocks."""
        if not self.paged:
            return None
        from megakernel.program.paged import PagedKV

        max_blocks = -(-(24 + self.steps * self.tokens + 8) // self.paged)
        return PagedKV(self.batch * max_blocks + 3, self.paged, max_blocks)

    def builds(self) -> tuple[Case, ...]:
        """The cases whose builds this one launches: itself, and a speculative case's plain
        kernel too (one token a step, no drafter: its greedy tokens are the case's truth)."""
        if not self.drafts:
            return (self,)
        return (self, replace(self, tokens=1, drafts=0, ngram=0))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        return cls(**d)


def weights_label(fp8: str) -> str:
    """"" -> "bf16", "channel" -> "fp8", "block" -> "fp8-block"."""
    return {"": "bf16", "channel": "fp8", "block": "fp8-block"}[fp8]


def variant_dir(build_dir: str | Path, name: str) -> Path:
    """Build set of a variant: the default one is build_dir itself (what `Megakernel` finds)."""
    return Path(build_dir) if name == "default" else Path(build_dir) / name


@dataclass(frozen=True)
class Group:
    """Cases that run in one process on one variant (a crash ends the process, not the group:
    the rest go on in a fresh one)."""

    variant: str
    cases: tuple[Case, ...]


@dataclass(frozen=True)
class Stage:
    number: int
    name: str
    doc: str
    groups: tuple[Group, ...] = field(default_factory=tuple)


TINY = (
    Case("llama-tiny", 1, 1, 64, 4, cap_s=45),
    Case("llama-tiny", 4, 1, 32, 2, cap_s=30),
    Case("llama-tiny", 16, 1, 32, 1, cap_s=30),
    Case("llama-tiny", 1, 4, 32, 1, cap_s=30),
    Case("llama-tiny", 4, 4, 32, 1, cap_s=30),
    # several attention splits; with T = 4 and prompts of 2.. tokens some splits hold no keys
    Case("llama-tiny", 4, 4, 16, 1, n_splits=3, cap_s=30),
    Case("llama-tiny", 2, 1, 16, 1, n_splits=5, cap_s=30),
    # one split over up to ~330 keys: the tensor-core partial (attention_mma.py, 1 / 8 of the
    # split a warp) runs two chunks a warp share at D = 64 (32 keys a chunk), two or three at
    # D = 128 (16 keys)
    Case("llama-tiny", 1, 1, 320, 1, n_splits=1, cap_s=60),
    Case("qwen3-tiny", 1, 1, 300, 1, n_splits=1, cap_s=60),
    Case("qwen3-tiny", 1, 1, 64, 4, cap_s=45),
    Case("qwen3-tiny", 4, 1, 32, 2, cap_s=30),
    Case("qwen3-tiny", 16, 1, 32, 1, cap_s=30),
    Case("qwen3-tiny", 4, 4, 32, 1, n_splits=2, cap_s=30),
    Case("qwen3-tiny", 40, 1, 16, 1, cap_s=30),  # 40 > NO = 32 rows: two passes over the rows
    # Nemotron-H's attention (no RoPE, KV cache slots of the attention layers only) and relu^2
    # MLP blocks (pattern "*-*-"): the first hybrid family the kernel runs
    Case("nemotron-h-attn-tiny", 1, 1, 32, 2, cap_s=30),
    Case("nemotron-h-attn-tiny", 4, 1, 32, 1, cap_s=30),
    # Qwen3.5's gated full attention (partial RoPE, (1 + w) q/k norms, sigmoid output gate) and
    # (1 + w) RMSNorm, every layer attention: the second hybrid family's slice the kernel runs
    Case("qwen3.5-attn-tiny", 1, 1, 32, 2, cap_s=30),
    Case("qwen3.5-attn-tiny", 4, 1, 32, 1, cap_s=30),
    # the recurrent layers (GDN_CORE, MAMBA_CORE): every case also against the executor, whose
    # recurrent state arena (conv windows, states) the kernel's must equal after each step
    *(Case(m, b, t, 24, 2, cap_s=30) for m in ("qwen3.5-tiny", "nemotron-h-tiny")
      for b, t in ((1, 1), (4, 1), (1, 4), (4, 4))),
    # ReplaySSM (GDN_REPLAY, MAMBA_REPLAY) with L = 4: 24 steps fill, fold and restart the ring
    # several times; the state arena (committed states, rings) and ring counts against the
    # executor's
    # (B = 1 at T = 4: the global-memory build of B = 2, T = 4 is over the register budget)
    *(Case(m, b, t, 24, 2, replay_window=4, cap_s=30) for m in ("qwen3.5-tiny", "nemotron-h-tiny")
      for b, t in ((1, 1), (4, 1), (1, 4))),
    # the paged build (vLLM's pages, block table, slot mapping; the last sequence padding)
    # against the contiguous one and the references, in the same run
    Case("llama-tiny", 4, 1, 16, 1, paged=16, cap_s=30),
    Case("qwen3-tiny", 3, 2, 16, 1, n_splits=3, paged=8, cap_s=30),
)
# Kimi Linear: KDA (recurrent and ReplaySSM), absorbed MLA over the latent cache, MoE with
# run-time routing (router ties, experts no row picks); the state arena against the executor.
# The global-memory build with every Kimi handler is over the register budget at B = 4 or T = 4
# (198-216), so it runs (1, 1) only; the weight pipeline every shape
KIMI = tuple(Case("kimi-linear-tiny", b, t, 24, 2, replay_window=w, cap_s=30)
             for b, t in ((1, 1), (4, 1), (1, 4)) for w in (0, 4))
KIMI_GLOBAL = tuple(c for c in KIMI if c.batch == c.tokens == 1)
# the speculative step (ACCEPT, the COMMIT records, NGRAM): scripted host drafts make every
# accepted count 0..k occur, the tokens must equal the plain kernel's and the state arena the
# executor's after every step (gpu_check/spec_case.py); the device drafter on a repetitive prompt
SPECULATIVE = (
    Case("llama-tiny", 2, 4, 16, 16, cap_s=30, drafts=3),
    Case("qwen3.5-tiny", 1, 4, 16, 16, cap_s=30, replay_window=4, drafts=3),
    Case("nemotron-h-tiny", 1, 4, 16, 16, cap_s=30, replay_window=4, drafts=3),
    Case("kimi-linear-tiny", 2, 2, 16, 16, cap_s=30, replay_window=4, drafts=1),
    Case("llama-tiny", 2, 4, 16, 16, cap_s=30, drafts=3, ngram=3),
)
MID = (  # K-split 2 on the FMA path (B = 1); K-chunked slabs on mma (default) and FMA (global)
    Case("llama-mid", 1, 1, 16, 1, cap_s=45),
    Case("llama-mid", 16, 1, 16, 1, cap_s=45),
)
# FP8 (e4m3) weights against the FP8 model's reference and the executor: channel scales on the
# FMA GEMV (B = 1) and the mma GEMV (B = 16 on the default variant; the global one's FMA),
# block scales (a 128-input chunk each: 2 and 4 chunks per row at llama-tiny's K = 256, 512),
# and Qwen3.5's recurrent projections with state parity
FP8 = (
    Case("llama-tiny", 1, 1, 32, 2, cap_s=30, fp8="channel"),
    Case("llama-tiny", 16, 1, 16, 1, cap_s=30, fp8="channel"),
    Case("llama-tiny", 4, 1, 16, 1, cap_s=30, fp8="block"),
    Case("qwen3.5-tiny", 1, 1, 24, 2, cap_s=30, fp8="channel"),
    Case("qwen3.5-tiny", 4, 1, 24, 2, cap_s=30, fp8="channel"),
)
# the global-memory build is over the register budget (192) with block scales at B = 4 (208) and
# with Qwen3.5's FP8 at B = 4 (196): it runs those at B = 1 (block scales on its FMA GEMV)
FP8_GLOBAL = (*(c for c in FP8 if c.batch != 4),
              Case("llama-tiny", 1, 1, 16, 1, cap_s=30, fp8="block"))
REAL = (
    Case("llama-3.2-1b", 1, 1, 32, 2, bench=True, cap_s=90),
    # FP8 right after its bf16 model (whose weights it quantizes), and benchmarked right after
    # it too: the FP8 targets compare the two rows of one run
    Case("llama-3.2-1b", 1, 1, 16, 1, bench=True, cap_s=90, fp8="channel"),
    Case("llama-3.2-1b", 16, 1, 16, bench=True, cap_s=60),
    Case("llama-3.2-1b", 1, 4, 16, cap_s=60),
    Case("qwen3-0.6b", 1, 1, 32, bench=True, cap_s=60),
    Case("qwen3-0.6b", 4, 4, 16, cap_s=60),
    Case("qwen3.5-0.8b", 1, 1, 16, 1, bench=True, cap_s=90),
    Case("nemotron-h-8b", 1, 1, 8, 1, bench=True, cap_s=150),
)
# 96 GB of bf16 weights: made on the GPU, benchmarked only (no room for a reference next to them)
SYNTHETIC = (Case("kimi-linear-48b-a3b", 1, 1, 8, bench=True, cap_s=150, synthetic=True),)
STAGES = (
    Stage(0, "launch", "does the kernel launch, finish and agree at all",
          (Group("global", (Case("llama-tiny", 1, 1, 8, 2, cap_s=60),)),
           Group("default", (Case("llama-tiny", 1, 1, 8, 2, cap_s=60),)))),
    Stage(1, "shapes", "the tiny set, K-split and K-chunked slabs, several attention splits, "
          "FP8 weights",
          (Group("default", TINY + KIMI + MID + FP8 + SPECULATIVE),
           Group("global", TINY + KIMI_GLOBAL + MID + FP8_GLOBAL))),
    Stage(2, "real", "the real presets against the references (one against the executor too)",
          (Group("default", REAL), Group("global", REAL[:1]))),
)
BENCH_CASES = tuple(c for c in REAL + SYNTHETIC if c.bench)


def stage_cases(stages: list[int] | None = None) -> list[tuple[Case, str]]:
    """Every (case, variant) of every stage (or of `stages`): what --prepare builds (plus the
    benchmark's timeline build, with stage 2)."""
    out = [(c, g.variant) for s in STAGES if stages is None or s.number in stages
           for g in s.groups for c in g.cases]
    if stages is None or 2 in stages:
        out.append((BENCH_CASES[0], "timeline"))
    return out
