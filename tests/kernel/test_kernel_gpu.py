"""Rung 4: the megakernel launched on a GPU against the CPU executor and the torch reference.

Skipped without CUDA. Builds come from $MEGAKERNEL_BUILD_DIR (a build set made by
`python -m megakernel gpu-check --prepare`) or, when the DSL is installed, from the JIT cache.
Each case: ragged prompts, poisoned scratch and outputs, DESIGN.md section 4 tolerance per step,
greedy tokens equal to the bf16 reference's at every step whose reference top-2 margin is clear
(above twice the measured kernel-vs-reference logit error; near ties may flip and are counted),
bit-identical replays, and (tiny models) the first steps against the CPU executor of the same
program.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

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
    from megakernel.gpu_check import CASES, prepare
    from megakernel.runtime import device_info

    root = tmp_path_factory.mktemp("gpu-builds")
    prepare(root, [device_info().arch], [c for c in CASES if c.model.endswith("tiny")])
    return root


@pytest.mark.parametrize("model,batch,tokens,steps,ex_steps", [
    ("llama-tiny", 1, 1, 128, 4),
    ("qwen3-tiny", 1, 1, 128, 4),
    ("llama-tiny", 4, 1, 64, 2),
    ("qwen3-tiny", 4, 4, 64, 1),
])
@pytest.mark.parametrize("variant", [0, 1], ids=["default", "other"])
def test_kernel_matches_executor_and_reference(build_dir, model, batch, tokens, steps, ex_steps,
                                               variant):
    """Both sides of the shared-memory weight pipeline switch (gpu_check.variants)."""
    from megakernel.gpu_check import Case, _have_build, run_case, variant_dir, variants
    from megakernel.runtime import device_info

    c = Case(model, batch, tokens, steps, ex_steps)
    vdir = variant_dir(build_dir, variants()[variant][0])
    if not _have_build(vdir, c, device_info().arch):
        pytest.skip(f"no build for {model} B={batch} T={tokens} in {vdir}")
    r = run_case(c, vdir)
    print(r)
    assert r["steps"] == steps
    assert r["unwritten"] == 0, "poisoned outputs survived a step"
    assert r["tolerance_failures"] == 0, (r["max_err_kernel"], r["max_err_bf16ref"])
    assert r["token_mismatches"] == 0, "a token differs at a clear reference margin"
    assert r["near_ties_ok"], (r["near_tie_mismatches"], r["first_mismatch_step"])
    assert r["deterministic"]
    assert r["executor_ok"], {k: v for k, v in r.items() if k.startswith("executor")}


def test_generate_backend_kernel_agrees_with_reference(build_dir, monkeypatch):
    """64 greedy steps. Teacher-forced first (the reference's tokens fed to the kernel): the
    kernel's logit error against the bf16 reference is measured and no token may differ at a
    clear margin. Then free-running `generate`: equal to the reference's tokens up to the first
    step whose reference margin is below twice the largest measured error (a near tie, where
    the two may legitimately part), and that common prefix must be long."""
    from megakernel.gpu_check import MIN_PREFIX, common_prefix, greedy_check, top2_margin
    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.torch_op import Megakernel, generate
    from reference.model import ReferenceModel
    from reference.model import generate as ref_generate

    steps = 64
    cfg = preset("llama-tiny")
    w = random_weights(cfg, seed=3)
    prompts = [[5, 6, 7, 8]]
    monkeypatch.setenv("MEGAKERNEL_BUILD_DIR", str(build_dir))
    ref = ReferenceModel(cfg, w, mode="bf16", device="cuda")
    want = ref_generate(ref, prompts, steps)[0]

    s_max = len(prompts[0]) + steps + 8
    mk = Megakernel(cfg, w, batch=1, tokens=1, max_seq_len=s_max, build_dir=build_dir)
    cache = ref.new_cache(1, s_max)
    l16 = ref.prefill(cache, prompts)  # [1, V]
    assert int(mk.prefill(prompts)[0]) == want[0]  # the prefill is the reference's
    margins, errs, clear = [float(top2_margin(l16)[0])], [0.0], 0
    for t in range(1, steps):
        tok = torch.tensor([[want[t - 1]]], device="cuda")
        kt, kl = mk.step(tok, return_logits=True)
        l16 = ref.decode(cache, tok)[:, -1]  # [1, V]
        gc = greedy_check(kl, kt.long(), l16)
        clear += gc["clear"]
        errs.append(float((kl.float() - l16).abs().max()))
        margins.append(float(top2_margin(l16)[0]))
    assert clear == 0, "teacher-forced: a token differs at a clear reference margin"
    bound = 2 * max(errs)

    got = generate(cfg, w, prompts, steps=steps)[0]
    agree = common_prefix(got, want, margins, bound)
    print({"max_logit_err": max(errs), "bound": bound, **agree})
    assert agree["first_difference"] is None or agree["first_difference"] >= agree["compared"]
    assert agree["compared"] >= min(MIN_PREFIX, steps) or agree["near_tie_stop"], agree
    assert agree["ok"], agree
