"""The greedy-token rules of gpu-check on CPU tensors (no GPU): near ties of the reference may
flip, a clear margin may not; free-running generations are compared up to the first near tie."""

from __future__ import annotations

import pytest
import torch

from megakernel.gpu_check import MIN_PREFIX, common_prefix, greedy_check, top2_margin


def _logits(seed: int, rows: int = 6, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_top2_margin():
    x = torch.tensor([[1.0, 5.0, 4.5, -2.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(top2_margin(x), torch.tensor([0.5, 0.0]))


def test_clear_margin_mismatch_is_a_failure():
    ref = _logits(1)
    kern = ref + 1e-3 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    tok = torch.argmax(ref, dim=-1)
    r = greedy_check(kern, tok, ref)
    assert r == {**r, "clear": 0, "near_ties": 0, "mismatch": False}
    wrong = tok.clone()
    wrong[3] = (wrong[3] + 1) % ref.shape[-1]  # e.g. a broken argmax: logits fine, token wrong
    r = greedy_check(kern, wrong, ref)
    assert r["clear"] == 1 and r["near_ties"] == 0 and r["mismatch"]


def test_near_tie_flip_is_only_counted():
    ref = _logits(3)
    tok = torch.argmax(ref, dim=-1)
    second = torch.topk(ref[0], 2).indices[1]
    kern = ref.clone()
    gap = float(ref[0, tok[0]] - ref[0, second])
    kern[0, second] += gap * 0.6  # an error of 0.6 gap on each of the two: the order flips
    kern[0, tok[0]] -= gap * 0.6
    ktok = torch.argmax(kern, dim=-1)
    assert ktok[0] != tok[0]
    r = greedy_check(kern, ktok, ref)
    assert r["clear"] == 0 and r["near_ties"] == 1
    # the same flip with a tiny measured error elsewhere is a clear mismatch
    r = greedy_check(ref, ktok, ref)
    assert r["clear"] == 1


def test_common_prefix_stops_at_the_first_near_tie():
    ref = list(range(40))
    margins = [1.0] * 40
    assert common_prefix(ref, ref, margins, 0.1)["ok"]
    k = ref.copy()
    k[20] = -1  # diverges at a clear margin
    r = common_prefix(k, ref, margins, 0.1)
    assert not r["ok"] and r["first_difference"] == 20 and r["compared"] == 40
    margins[20] = 0.05  # ... but step 20 was a near tie: comparison ends there
    r = common_prefix(k, ref, margins, 0.1)
    assert r["ok"] and r["compared"] == 20 and r["near_tie_stop"]
    k[5] = -1  # a difference before the near tie still fails
    assert not common_prefix(k, ref, margins, 0.1)["ok"]
    short = list(range(MIN_PREFIX - 1))
    assert not common_prefix(short, ref, margins, 0.1)["ok"]  # lengths differ


def test_variants_are_the_two_sides_of_the_pipeline_switch():
    from megakernel.gpu_check import variant_dir, variants

    # the default build (None: the deepest ring that fits, spec.make_spec) and the global path
    (d_name, d_stages), (o_name, o_stages) = variants()
    assert (d_name, d_stages) == ("default", None)
    assert (o_name, o_stages) == ("global", 0)
    assert variant_dir("b", "default").as_posix() == "b"
    assert variant_dir("b", o_name).as_posix() == f"b/{o_name}"


def test_a_failing_variant_process_is_reported_not_fatal(tmp_path):
    """Each variant runs in its own process; here (no GPU) both die before writing a report:
    each is recorded as a failed case of its variant, and the merged report is still written."""
    import json

    from megakernel.gpu_check import _run_variants, variants

    r = _run_variants(tmp_path / "out", tmp_path / "builds", quick=True)
    names = [n for n, _ in variants()]
    assert [c["variant"] for c in r["cases"]] == names
    assert not r["ok"] and r["ok_by_variant"] == {n: False for n in names}
    for c in r["cases"]:
        assert "needs a CUDA GPU" in c["error"], c["error"]
    on_disk = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert on_disk["ok_by_variant"] == r["ok_by_variant"]
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert all(f"| {n} |" in md for n in names)


def test_prepare_builds_one_variant_when_the_other_cannot_serve_the_case(tmp_path, monkeypatch,
                                                                          capsys):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")
    from megakernel import gpu_check

    monkeypatch.setattr(gpu_check, "variants", lambda: (("default", 0), ("huge", 8)))
    ms, failed = gpu_check.prepare(tmp_path, ["sm_90a"], [gpu_check.Case("llama-tiny", 1, 1, 1)])
    assert [m["smem_stages"] for m in ms] == [0]
    assert len(failed) == 1 and failed[0].startswith("huge llama-tiny B=1 T=1 sm_90a: SpecError")
    assert "shared memory > budget" in failed[0]
    assert "FAILED huge" in capsys.readouterr().out


def test_markdown_renders_passing_cases_and_bench_rows():
    """The report table of a GPU run (rendered here from a synthetic report: no GPU) names the
    variant, the GEMV path and the ring depth of each case."""
    from megakernel.gpu_check import markdown

    case = dict(model="llama-3.2-1b", batch=16, tokens=1, steps=64, ok=True,
                max_err_kernel=1.5e-2, max_err_bf16ref=2.0e-2, token_mismatches=1,
                near_tie_mismatches=1, executor_max_logit_diff=3.0e-3, seconds=4.2,
                variant="default", gemv="mma", smem_stages=4)
    bench = dict(model="llama-3.2-1b", batch=1, variant="default", step_ms=0.7,
                 tokens_per_s=1428.6, bandwidth_fraction_of_copy=0.83, predicted_ms=0.63)
    md = markdown({"device": "NVIDIA H200", "arch": "sm_90a", "sms": 132, "cases": [case],
                   "bench": [bench], "skipped": [], "copy_bandwidth_GBps": 4300.0})
    assert "| llama-3.2-1b B=16 T=1 | default (mma, 4 stages) | 64 | yes | 1.500e-02 |" in md
    assert "| 1 (1) | 3.00e-03 | 4.2 |" in md
    assert "0.700 ms/step (1429 tok/s), 83% of copy bandwidth, cost model 0.630 ms" in md
