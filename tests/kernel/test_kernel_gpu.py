"""Rung 4: the megakernel launched on a GPU against the CPU executor and the torch reference.

Skipped without CUDA. Builds come from $MEGAKERNEL_BUILD_DIR (a build set made by
`python -m megakernel gpu-check --prepare`) or, when the DSL is installed, from the JIT cache.
Each case is gpu-check's (megakernel/gpu_check/case.py): ragged prompts, poisoned scratch and
outputs, the Numerics band (docs/TESTING.md) per step and on the KV cache, greedy tokens where the
fp32 truth's margin is clear by the reference's own error, bit-identical replays, and the first
steps against the CPU executor of the same program.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megakernel.gpu_check.cases import Case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _build_dir() -> Path | None:
    d = os.environ.get("MEGAKERNEL_BUILD_DIR")
    return Path(d) if d else None


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    d = _build_dir()
    if d is not None:
        return d
    pytest.importorskip("cutlass", reason="no MEGAKERNEL_BUILD_DIR and no DSL to JIT-compile")
    from megakernel.gpu_check import prepare
    from megakernel.launch.runtime import device_info

    root = tmp_path_factory.mktemp("gpu-builds")
    prepare(root, [device_info().arch], [(c, v) for c in CASES for v in ("default", "global")])
    return root


CASES = [Case("llama-tiny", 1, 1, 128, 4), Case("qwen3-tiny", 1, 1, 128, 4),
         Case("llama-tiny", 4, 1, 64, 2), Case("qwen3-tiny", 4, 4, 64, 1),
         Case("llama-tiny", 4, 4, 32, 1, n_splits=3)]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("variant", ["default", "global"])
def test_kernel_matches_executor_and_reference(build_dir, c, variant):
    from megakernel.gpu_check import variant_dir
    from megakernel.gpu_check.case import Weights, run_case

    r = run_case(c, variant_dir(build_dir, variant), Weights())
    print(r)
    assert r["steps"] == c.steps
    assert r["unwritten"] == 0, "poisoned outputs survived a step"
    assert r["band_failures"] == 0, (r["max_err_kernel"], r["max_allowed"])
    assert r["token_mismatches"] == 0 and r["not_own_argmax"] == 0
    assert r["near_ties_ok"], (r["near_tie_mismatches"], r["ref_near_ties"])
    assert r["kv_ok"], (r["kv_max_err"], r["kv_allowed"])
    assert r["deterministic"]
    assert r["executor_ok"], {k: v for k, v in r.items() if k.startswith("executor")}


def test_generate_backend_kernel_agrees_with_reference(build_dir, monkeypatch):
    """64 greedy steps. Teacher-forced first (the reference's tokens fed to the kernel): every
    step within the band and no clear token mismatch. Then free-running `generate`: equal to the
    bf16 reference's tokens up to the first step whose fp32 margin is within twice the band (a
    near tie by the reference's own error), and that common prefix must be long."""
    from megakernel.gpu_check import MIN_PREFIX, common_prefix, compare
    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as ref_generate
    from megakernel.serve.kernel_backend import Megakernel, generate

    steps = 64
    cfg = preset("llama-tiny")
    w = random_weights(cfg, seed=3)
    prompts = [[5, 6, 7, 8]]
    monkeypatch.setenv("MEGAKERNEL_BUILD_DIR", str(build_dir))
    ref16 = ReferenceModel(cfg, w, mode="bf16", device="cuda")
    ref32 = ReferenceModel(cfg, w, mode="fp32", device="cuda")
    want = ref_generate(ref16, prompts, steps)[0]

    s_max = len(prompts[0]) + steps + 8
    mk = Megakernel(cfg, w, batch=1, tokens=1, max_seq_len=s_max, build_dir=build_dir)
    c16, c32 = ref16.new_cache(1, s_max), ref32.new_cache(1, s_max)
    l16, l32 = ref16.prefill(c16, prompts), ref32.prefill(c32, prompts)  # [1, V]
    assert int(mk.prefill(prompts)[0]) == want[0]  # the prefill is the reference's
    margins = [float(compare.top2_margin(l32)[0])]
    bounds = [float(2 * compare.row_allowance(l16, l32)[0])]
    for t in range(1, steps):
        tok = torch.tensor([[want[t - 1]]], device="cuda")
        kt, kl = mk.step(tok, return_logits=True)
        l16, l32 = ref16.decode(c16, tok)[:, -1], ref32.decode(c32, tok)[:, -1]  # [1, V]
        v = compare.step_verdict(kl, kt, l16, l32)
        assert v["ok"], (t, v)
        margins.append(float(compare.top2_margin(l32)[0]))
        bounds.append(float(2 * compare.row_allowance(l16, l32)[0]))

    got = generate(cfg, w, prompts, steps=steps)[0]
    agree = common_prefix(got, want, margins, max(bounds))
    print({"bound": max(bounds), **agree})
    assert agree["compared"] >= min(MIN_PREFIX, steps) or agree["near_tie_stop"], agree
    assert agree["ok"], agree
