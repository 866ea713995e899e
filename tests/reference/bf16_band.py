"""The bf16 numerics band, measured: a bf16 run's error against fp32 truth next to that of
independent bf16 roundings of the same computation (docs/TESTING.md, Numerics). Shared by the
reference's property tests (tiny random models) and the real-model oracle (SmolLM2).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from megakernel.reference import ReferenceModel, all_layers, generate, greedy
from megakernel.reference.layers import common

# bf16 keeps 8 significant bits: rounding to nearest changes a value by a relative error of at most
# u = 2^-9. The mirror rounds at 7 L + 1 stores (per layer: attention-norm output, q, k, v,
# attention output, MLP-norm output, silu(gate)*up; then the final-norm output). How much those
# roundings move the logits depends on the model: an a-priori band such as (7 L + 1) u max|logits|
# assumes each stage has gain ~1, which sharp attention breaks (softmax amplifies score errors).
#
# So the band is measured (docs/TESTING.md, Numerics): the mirror's error vs fp32 truth must be
# at most about twice the error of an independent bf16 computation of the same thing. The
# independent computations are the fp32 model rounded at the same 7 L + 1 points, but onto a
# scaled bf16 grid: x -> bf16(x * s) / s, i.e. storing x * s in bf16 and folding 1 / s into the
# consumer. For s = 1 this is the mirror itself (checked bit for bit below); for s = 2^(1/3) and
# 2^(2/3) the grid points interleave with bf16's, so the rounding errors are independent of the
# mirror's and, for values spread over many binades (mantissas roughly log-uniform), distributed
# like them, with the same relative bound u.
#
# Magnitude: the band is 2x the largest error of the independent roundings over the whole run,
# constant over its steps like the a-priori band it replaces. Per step the comparison is too noisy
# for a bound: one step's error is heavy-tailed (sharp softmax amplifies the odd rounding), and
# over seeds 0-7 of both presets one rounding exceeded 2x the larger of two others at the same step
# by up to 7 u, while the run-level ratio max|err| / max|independent err| stayed within 0.6-1.5.
# The noise term (docs/TESTING.md, Numerics) is for a reference error near zero; the run's largest
# independent error is >= 10 u (measured 14-26 u), so none is added.
#
# Near-ties: a greedy token can flip only where the truth's top-2 margin is <= 2 max|error|. Step
# i is a near-tie when its margin is <= 2 x (2x the larger independent error at step i). Over seeds
# 0-7 of both presets, every token flip (mirror's and independent roundings') had a margin <= 1.7x
# that independent error, mostly < 0.7x; outside near-ties the tokens must agree.
U_BF16 = 2.0**-9
GRID_SCALES = (2.0 ** (1 / 3), 2.0 ** (2 / 3))  # two independent reference roundings

def grid_round(x: torch.Tensor, s: float) -> torch.Tensor:
    """Round x (fp32) to nearest on the bf16 grid scaled by 1/s: bf16(x * s) / s."""
    return (x * s).to(torch.bfloat16).to(torch.float32) / s


def store_users() -> list[ModuleType]:
    """Every reference module that rounds through `store` (the model and the layer modules)."""
    all_layers()  # imports every layer module
    mods = [m for n, m in sys.modules.items()
            if (n == "megakernel.reference.model" or n.startswith("megakernel.reference.layers."))
            and getattr(m, "store", None) is common.store]
    names = {m.__name__ for m in mods}
    want = {"megakernel.reference.model", "megakernel.reference.layers.attention",
            "megakernel.reference.layers.swiglu"}
    assert want <= names, f"store no longer reached as a module name in {want - names}"
    return mods


@contextmanager
def scaled_grid_rounding(s: float) -> Iterator[None]:
    """While active, an fp32-mode `ReferenceModel` rounds at the mirror's 7 L + 1 points, with
    `grid_round(., s)`: every `store` call (norm outputs, q, the k / v cache entries, the
    attention output, the MLP intermediate). Patches the `store` name of every module that uses
    it; if it is renamed, `store_users` fails loudly."""
    with pytest.MonkeyPatch.context() as mp:
        for m in store_users():
            mp.setattr(m, "store", lambda x, mode: grid_round(x, s))
        yield


def teacher_forced(
    model: ReferenceModel, prompts: list[list[int]], stream: torch.Tensor
) -> torch.Tensor:
    """Logits [B, S, V] of prefill then decode of stream[:, :-1] (stream [B, S]): step i's
    logits predict stream[:, i]."""
    cache = model.new_cache(len(prompts), max(map(len, prompts)) + stream.shape[1])
    logits = [model.prefill(cache, prompts)]
    logits += [model.decode(cache, stream[:, i : i + 1])[:, 0] for i in range(stream.shape[1] - 1)]
    return torch.stack(logits, dim=1)


@dataclass
class Bf16Run:
    """One tiny model, 3 prompts, BF16_STEPS greedy steps; per-step quantities are [B, S] and
    relative to max |logits| of fp32 truth at that step."""

    name: str
    stream32: torch.Tensor  # [B, S] fp32 free-running greedy tokens
    out16: torch.Tensor  # [B, S] bf16 free-running greedy tokens
    tokens16: torch.Tensor  # [B, S] bf16 greedy tokens, teacher-forced on stream32
    err: torch.Tensor  # [B, S] max |logits_bf16 - logits_fp32|, teacher-forced
    ref_err: torch.Tensor  # [G, B, S] the same for each scaled-grid rounding
    margin: torch.Tensor  # [B, S] top-1 minus top-2 logit of fp32 truth

    @property
    def band(self) -> float:
        """Measured band: 2x the largest error of the independent bf16 roundings in the run."""
        return 2 * self.ref_err.max().item()

    @property
    def near_tie(self) -> torch.Tensor:
        """[B, S] bool: the truth's top-2 margin is within 2x the per-step band (2x the larger
        independent error at that step), where bf16 rounding may legitimately flip the token."""
        return self.margin <= 2 * (2 * self.ref_err.amax(dim=0))


def measure(name: str, cfg, w: dict[str, torch.Tensor], prompts: list[list[int]],  # noqa: ANN001
            steps: int) -> Bf16Run:
    """The bf16 run of model (cfg, w) (fp32 weights) on `prompts` for `steps` greedy steps:
    free-running streams of both modes, teacher-forced errors of the mirror and of the
    independent roundings on the fp32 stream, and the fp32 top-2 margins."""
    fp32, bf16 = ReferenceModel(cfg, w, "fp32"), ReferenceModel(cfg, w, "bf16")
    stream32 = torch.tensor(generate(fp32, prompts, steps))  # [B, S]
    out16 = torch.tensor(generate(bf16, prompts, steps))  # [B, S]

    l32 = teacher_forced(fp32, prompts, stream32)  # [B, S, V]
    assert torch.equal(greedy(l32), stream32), "fp32 logits do not reproduce fp32 greedy tokens"
    l16 = teacher_forced(bf16, prompts, stream32)
    l_ref = []
    for s in GRID_SCALES:
        with scaled_grid_rounding(s):
            l_ref.append(teacher_forced(fp32, prompts, stream32))
    scale = l32.abs().amax(dim=-1)  # [B, S]
    top2 = l32.topk(2, dim=-1).values  # [B, S, 2]
    return Bf16Run(
        name=name,
        stream32=stream32,
        out16=out16,
        tokens16=greedy(l16),
        err=(l16 - l32).abs().amax(dim=-1) / scale,
        ref_err=torch.stack([(r - l32).abs().amax(dim=-1) / scale for r in l_ref]),
        margin=(top2[..., 0] - top2[..., 1]) / scale,
    )
