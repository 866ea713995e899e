"""gpu-check on the CPU: its judgement (every bound from the reference's own error; zero, negated
and shifted logits, a wrong argmax and a bad KV cache all fail), its driver (a crash or a hang ends
one item, the next process carries on, the deadline holds, the report is rewritten after every
item, at most 8 files) with scripted children, and the whole run simulated on the CPU executor."""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest
import torch

from megakernel.gpu_check import MIN_PREFIX, common_prefix, compare, driver
from megakernel.gpu_check.cases import Case, Group, Stage


def _refs(seed: int = 0, rows: int = 6, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 reference, fp32 truth) logits [rows, vocab]: the bf16 one off by rounding."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, vocab, generator=g) * 3
    return t.to(torch.bfloat16).float() + 1e-3 * torch.randn(rows, vocab, generator=g), t


def _verdict(logits: torch.Tensor, ref16: torch.Tensor, ref32: torch.Tensor) -> dict:
    return compare.step_verdict(logits, compare.greedy(logits), ref16, ref32)


def test_the_bf16_reference_itself_passes():
    r16, r32 = _refs()
    assert _verdict(r16, r16, r32)["ok"]
    assert _verdict(r32, r16, r32)["ok"]


@pytest.mark.parametrize("broken", ["zeros", "negated", "shifted", "scaled", "nan"])
def test_broken_logits_fail(broken):
    r16, r32 = _refs(1)
    bad = {"zeros": torch.zeros_like(r16), "negated": -r16, "shifted": r16 + 0.5,
           "scaled": r16 * 1.05, "nan": r16.masked_fill(r16 > 5, float("nan"))}[broken]
    v = _verdict(bad, r16, r32)
    assert not v["ok"] and not v["band"]["ok"], v


def test_a_token_that_is_not_the_logits_argmax_fails():
    r16, r32 = _refs(2)
    tok = compare.greedy(r16).clone()
    tok[3] = (tok[3] + 1) % r16.shape[-1]  # a broken argmax: logits fine, token wrong
    v = compare.step_verdict(r16, tok, r16, r32)
    assert not v["ok"] and v["greedy"]["not_own_argmax"] == 1 and v["greedy"]["clear"] == 1


def test_ties_go_to_the_lowest_index():
    r16, r32 = _refs(3)
    x = r16.clone()
    top = int(compare.greedy(x)[0])
    x[0, top + 1 if top + 1 < x.shape[1] else top - 1] = x[0, top]  # an exact tie
    lo, hi = sorted((top, top + 1 if top + 1 < x.shape[1] else top - 1))
    assert int(compare.greedy(x)[0]) == lo
    tok = compare.greedy(x).clone()
    tok[0] = hi
    assert compare.greedy_check(x, tok, r16, r32)["not_own_argmax"] == 1


def test_a_near_tie_flip_is_counted_and_a_clear_one_fails():
    r16, r32 = _refs(4)
    want, second = (int(i) for i in torch.topk(r32[0], 2).indices)
    allow = float(compare.row_allowance(r16, r32)[0])
    for gap, clear in ((0.5 * allow, 0), (1.0, 1)):  # inside twice the band / far outside it
        t32, t16 = r32.clone(), r16.clone()
        t32[0, second] = t16[0, second] = t32[0, want] - gap  # references agree there
        k = t32.clone()
        k[0, second] = k[0, want] + 1e-4  # the kernel's logits reorder row 0's top two
        g = compare.greedy_check(k, compare.greedy(k), t16, t32)
        assert (g["clear"], g["near_ties"]) == (clear, 1 - clear), (gap, g)


def test_the_bound_never_grows_with_the_kernels_error():
    """A kernel far off cannot widen the near-tie bound (it comes from the reference)."""
    r16, r32 = _refs(5)
    noisy = r32 + 5.0 * torch.randn(r32.shape, generator=torch.Generator().manual_seed(9))
    g1 = compare.greedy_check(noisy, compare.greedy(noisy), r16, r32)
    g0 = compare.greedy_check(r16, compare.greedy(r16), r16, r32)
    assert g1["max_bound"] == g0["max_bound"] and g1["clear"] > 0


def test_near_ties_are_bounded_by_the_references_own_flips():
    assert compare.near_ties_ok(1, 0, 10)
    assert not compare.near_ties_ok(2, 0, 10)
    assert compare.near_ties_ok(4, 2, 10) and not compare.near_ties_ok(5, 2, 10)
    assert compare.near_ties_ok(5, 0, 100) and not compare.near_ties_ok(6, 0, 100)


def test_kv_band_checks_written_positions_only():
    g = torch.Generator().manual_seed(6)
    t = torch.randn(2, 3, 2, 10, 8, generator=g)  # [layers, B, Hkv, S, D]
    r16 = t.to(torch.bfloat16).float()
    lengths = [4, 7, 10]
    k = r16.clone()
    k[:, 0, :, 4:] = float("nan")  # beyond sequence 0's length: never compared
    assert compare.kv_band(k, r16, t, lengths)["ok"]
    k[1, 1, 0, 6, 3] += 1.0  # a wrong entry inside sequence 1
    assert not compare.kv_band(k, r16, t, lengths)["ok"]
    k = r16.clone()
    k[0, 2, 1, 9] = 0.0  # a position never written (zeros) at the last slot
    assert not compare.kv_band(k, r16, t, lengths)["ok"]


def test_same_program_allows_flips_up_to_two_ulps_of_the_row():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    y = x.clone()
    y[0, 0] = torch.nextafter(y[0, 0].float(), torch.tensor(1e9)).to(torch.bfloat16)
    y.view(torch.int16)[1, 1] += 1  # one bf16 ulp
    small = int(x[2].float().abs().argmin())  # a cancellation: off by its row's scale, not its own
    y[2, small] = x[2, small].float() + 1.5 * 2.0 ** -8 * x[2].float().abs().max()
    r = compare.same_program(x, y)
    assert r["ok"] and 1.0 < r["ulps"] < 2.0
    y[3, small] = x[3, small].float() + 3 * 2.0 ** -8 * x[3].float().abs().max()
    assert not compare.same_program(x, y)["ok"]


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


# ---- the driver, with scripted children ---------------------------------------------------------
FAKE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    job = json.load(open(sys.argv[1]))
    ev = open(job["events"], "a")
    def emit(**e):
        ev.write(json.dumps(e) + "\\n"); ev.flush()
    emit(event="device", info={"device": "scripted"})
    for it in job["items"]:
        emit(event="start", name=it["name"], t=time.time())
        what = it["case"]["model"]
        print("running", it["name"], flush=True)
        if what == "crash":
            print("CUDA error: an illegal instruction was encountered", flush=True)
            os._exit(3)
        if what == "hang":
            time.sleep(600)
        seen = len(json.load(open(os.environ["FAKE_OUT"] + "/gpu_check.json"))["cases"])
        emit(event="done", name=it["name"], result={"ok": True, "seen": seen})
""")


@pytest.fixture
def scripted(tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text(FAKE_CHILD)
    monkeypatch.setattr(driver, "child_command", lambda job: [sys.executable, str(script),
                                                              str(job)])
    monkeypatch.setattr(driver, "PARENT_START_S", 0.0)
    monkeypatch.setattr(driver, "REPORT_S", 0.5)
    monkeypatch.setattr(driver, "MIN_ITEM_S", 0.5)
    out = tmp_path / "out"
    monkeypatch.setenv("FAKE_OUT", str(out))

    def run(stages: tuple[Stage, ...], budget_s: float = 60.0) -> dict:
        return driver.run(out, tmp_path / "builds", [s.number for s in stages], simulate=True,
                          budget_s=budget_s, stage_table=stages)
    return run, out


def _case(what: str, cap_s: float = 30.0) -> Case:
    return Case(what, 1, 1, 1, cap_s=cap_s)


def test_a_crash_fails_its_item_and_the_next_process_carries_on(scripted):
    run, out = scripted
    r = run((Stage(0, "s", "doc", (Group("v", (_case("ok"), _case("crash"), _case("ok2"))),)),))
    a, b, c = r["cases"]
    assert a["ok"] and a["seen"] == 0
    assert not b["ok"] and "exit 3" in b["error"] and "illegal instruction" in b["output_tail"]
    assert "crash" in b["item"]
    assert c["ok"] and c["seen"] == 2  # a fresh process, and the report had both earlier items
    assert not r["ok"] and r["ok_by_stage"] == {"0": False}
    assert json.loads((out / "gpu_check.json").read_text())["cases"][1]["item"] == b["item"]
    assert "illegal instruction" in (out / "gpu_check.log").read_text()


def test_a_hang_is_cut_at_its_cap_and_its_variant_is_not_waited_for_again(scripted):
    run, _ = scripted
    t0 = time.time()
    r = run((Stage(0, "s", "doc", (Group("v", (_case("hang", cap_s=1.0), _case("ok"))),)),
             Stage(1, "t", "doc", (Group("v", (_case("ok3"),)),
                                   Group("default", (_case("ok4"),))))))
    assert time.time() - t0 < 30
    hang, ok, ok4 = r["cases"]
    assert "timed out after" in hang["error"] and ok["ok"] and ok4["variant"] == "default"
    assert [s["why"] for s in r["skipped"]] == ["the v variant hung earlier"]


def test_the_deadline_holds_whatever_hangs(scripted):
    run, _ = scripted
    t0 = time.time()
    r = run((Stage(0, "s", "doc", (Group("v", (_case("hang", cap_s=300.0), _case("ok"))),
                                   Group("w", (_case("ok2"),)))),), budget_s=4.0)
    assert time.time() - t0 < 4.0 + 3.0  # the kill and the last report included
    assert "deadline" in r["cases"][0]["error"]
    assert {s["why"] for s in r["skipped"]} == {"time budget spent"}


def test_the_report_files_fit_what_a_gpu_machine_returns(scripted):
    from megakernel.gpu_check.report import MAX_FILES

    run, out = scripted
    run((Stage(0, "s", "doc", (Group("v", (_case("ok"),)),)),))
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= MAX_FILES
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)  # at most two folders down


# ---- the whole run, simulated on the CPU executor -----------------------------------------------
def test_simulated_stage_0_runs_end_to_end(tmp_path, capsys):
    from megakernel.cli.main import main

    rc = main(["gpu-check", "--simulate", "--stages", "0", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 0, out
    r = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert r["simulated"] and r["ok"] and [c["variant"] for c in r["cases"]] == ["global",
                                                                                 "default"]
    for c in r["cases"]:
        assert c["steps"] > 0 and c["executor_ok"] and c["kv_ok"] and c["deterministic"]
        assert 0 < c["max_err_kernel"] <= c["max_allowed"]
    assert "SIMULATED" in (tmp_path / "o" / "gpu_check.md").read_text()


def test_simulated_case_catches_a_broken_launch(tmp_path, monkeypatch):
    """The simulated path judges what the op returns: a launch that negates the logits fails."""
    from megakernel.gpu_check.case import Weights, run_case
    from megakernel.launch import torch_op

    real = torch_op._outputs

    def negated(*a, **k):  # noqa: ANN002, ANN003, ANN202
        tok, logits = real(*a, **k)
        return tok, -logits
    monkeypatch.setattr(torch_op, "_outputs", negated)
    r = run_case(Case("llama-tiny", 2, 1, 2), None, Weights(), simulate=True)
    assert not r["ok"] and r["band_failures"] == r["steps"] == 2


def test_state_parity_allows_rounding_only():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g)
    assert compare.state_parity(x, x * (1 + 1e-6))["ok"]
    bad = x.clone()
    bad[17] += 0.05 * float(x.abs().max())  # one element of a skipped or misplaced update
    r = compare.state_parity(bad, x)
    assert not r["ok"] and r["max_diff"] > 0
    assert not compare.state_parity(x[:10], x)["ok"]  # another arena
    assert compare.state_parity(torch.zeros(0), torch.zeros(0))["ok"]  # a dense model's


def test_simulated_hybrid_case_catches_a_corrupt_state(tmp_path, monkeypatch):
    """The last step leaving a slightly wrong recurrent state (one element nudged by 1% of the
    arena's largest: no logits see it) fails the case through the state parity alone."""
    from megakernel.gpu_check.case import Weights, run_case
    from megakernel.serve import kernel_backend

    case = Case("qwen3.5-tiny", 2, 1, 2, 2)
    good = run_case(case, None, Weights(), simulate=True)
    assert good["ok"] and good["executor_state_ok"]
    real_step = kernel_backend.Megakernel.step
    calls = []

    def step(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = real_step(self, *a, **k)
        calls.append(1)
        if len(calls) == case.steps:  # the last checked step; the replays come after
            self.state[self.state.numel() // 2] += 0.01 * float(self.state.abs().max())
        return out
    monkeypatch.setattr(kernel_backend.Megakernel, "step", step)
    r = run_case(case, None, Weights(), simulate=True)
    assert r["band_failures"] == 0 and r["executor_logit_over"] == 0
    assert not r["executor_state_ok"] and r["executor_state_max_diff"] > 0 and not r["ok"]


def test_stages_flag_is_checked(capsys):
    from megakernel.cli.main import main

    with pytest.raises(SystemExit, match="--stages"):
        main(["gpu-check", "--simulate", "--stages", "7", "--out", "unused"])


def test_variants_and_their_directories():
    from megakernel.gpu_check import variant_dir, variants

    v = dict(variants())
    assert v["default"] is None and v["global"] == 0
    assert variant_dir("b", "default").as_posix() == "b"
    assert variant_dir("b", "global").as_posix() == "b/global"


def test_prepare_reports_a_variant_that_cannot_serve_the_case(tmp_path, monkeypatch, capsys):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")
    from megakernel.gpu_check import prepare
    from megakernel.kernel.host import variants

    monkeypatch.setitem(variants.VARIANTS, "huge", {"smem_stages": 8})
    ms, failed = prepare(tmp_path, ["sm_90a"], [(Case("llama-tiny", 1, 1, 1), "global"),
                                                (Case("llama-tiny", 1, 1, 1), "huge")])
    assert [m["smem_stages"] for m in ms] == [0]
    assert len(failed) == 1 and failed[0].startswith("huge llama-tiny B=1 T=1 sm_90a: SpecError")
    assert "FAILED huge" in capsys.readouterr().out


def test_prepare_builds_a_speculative_cases_plain_kernel_too(tmp_path, monkeypatch):
    """A speculative case launches two builds (its truth is the plain kernel's greedy tokens):
    prepare makes both, or the case cannot find its plain kernel on a machine without the DSL."""
    from megakernel.gpu_check import prepare
    from megakernel.gpu_check.cases import SPECULATIVE
    from megakernel.kernel.toolchain import build

    made = []

    def fake_build(cfg, arch, out, batch, tokens, **kw):  # noqa: ANN001, ANN202
        made.append((cfg.name, batch, tokens, kw.get("replay_window"), kw.get("drafts")))
        return {"resources": {"registers": 0, "spill_stores": 0, "spill_loads": 0},
                "dynamic_smem_bytes": 0}

    monkeypatch.setattr(build, "build_arch", fake_build)
    _, failed = prepare(tmp_path, ["sm_90a"], [(c, "default") for c in SPECULATIVE])
    assert not failed
    for c in SPECULATIVE:
        assert (c.model, c.batch, c.tokens, c.replay_window, c.drafts) in made
        assert (c.model, c.batch, 1, c.replay_window, 0) in made, c.name


def test_stage_tables_cover_what_the_issue_asks():
    from megakernel.gpu_check.cases import STAGES
    from megakernel.kernel.config.model_spec import make_spec
    from megakernel.kernel.host.limits import tile_rows
    from megakernel.kernel.host.variants import VARIANTS
    from megakernel.models import preset

    s0 = STAGES[0]
    assert [g.variant for g in s0.groups] == ["global", "default"]
    assert all(c.model == "llama-tiny" and c.batch == 1 and c.steps == 8 and c.cap_s <= 60
               for g in s0.groups for c in g.cases)
    reach = set()
    for g in STAGES[1].groups:
        for c in g.cases:
            if c.model != "llama-mid":
                continue
            s = make_spec(preset(c.model), c.batch, c.tokens, "sm_90a", **VARIANTS[g.variant])
            ks = (s.hidden, s.heads * s.head_dim, s.inter)
            if any(tile_rows(min(s.k_chunk, k), s.num_warps) < s.num_warps for k in ks):
                reach.add(("ksplit", s.mma))
            if any(k > s.k_chunk for k in ks):
                reach.add(("kchunk", s.mma))
    assert ("ksplit", False) in reach and ("kchunk", True) in reach and ("kchunk", False) in reach
    assert any(c.n_splits and c.n_splits > 1 and c.tokens > 1
               for g in STAGES[1].groups for c in g.cases)
    # the recurrent layers, against the executor (state parity), B in {1, 4}, T in {1, 4}
    for m in ("qwen3.5-tiny", "nemotron-h-tiny"):
        shapes = {(c.batch, c.tokens) for c in STAGES[1].groups[0].cases
                  if c.model == m and c.executor_steps > 0 and not c.replay_window}
        assert shapes == {(1, 1), (4, 1), (1, 4), (4, 4)}, m
        replay = {(c.batch, c.tokens) for c in STAGES[1].groups[0].cases
                  if c.model == m and c.executor_steps > 0 and c.replay_window == 4}
        assert replay >= {(1, 1), (4, 1)} and any(t > 1 for _, t in replay), m
    assert {"qwen3.5-0.8b", "nemotron-h-8b"} <= {c.model for g in STAGES[2].groups
                                                 for c in g.cases if c.bench}
    # Kimi Linear: B in {1, 4}, recurrent and L = 4, against the executor; the real preset a
    # synthetic benchmark (weights made on the GPU)
    kimi = {(c.batch, c.tokens, c.replay_window) for c in STAGES[1].groups[0].cases
            if c.model == "kimi-linear-tiny" and c.executor_steps > 0}
    assert {(b, 1, w) for b in (1, 4) for w in (0, 4)} <= kimi
    assert {(c.batch, c.tokens) for g in STAGES[1].groups if g.variant == "global"
            for c in g.cases if c.model == "kimi-linear-tiny"} == {(1, 1)}  # over budget else
    from megakernel.gpu_check.cases import BENCH_CASES

    assert any(c.model == "kimi-linear-48b-a3b" and c.synthetic and c.batch == 1
               for c in BENCH_CASES)


def test_a_gpu_report_renders_and_judges_the_targets(tmp_path):
    """A synthetic GPU report (no GPU here): bandwidths, decode steps, the torch.compile baseline
    and the timeline records land in the report, and the targets are judged from them."""
    from megakernel.gpu_check.report import Report

    r = Report(tmp_path, tmp_path / "b", simulate=False, budget_s=510)
    r.device({"device": "NVIDIA H200", "arch": "sm_90a", "sms": 132})
    r.stage(Stage(2, "real", "doc"))
    r.result(2, {"kind": "measure", "name": "measure"},
             {"read": {"bytes_per_s": 4.0e12}, "copy": {"bytes_per_s": 3.8e12}, "clocks": {}})
    row = {"case": "llama-3.2-1b B=1 T=1", "model": "llama-3.2-1b", "batch": 1,
           "variant": "default", "step_us": 660.0, "tokens_per_s": 1515.0,
           "bytes_per_step": 2.5e9, "predicted_us": 700.0, "timed": "cuda graph",
           "fraction_of_achievable": 2.5e9 / 660e-6 / 4.0e12}
    r.result(2, {"kind": "bench", "name": "bench a", "variant": "default"}, row)
    r.result(2, {"kind": "bench", "name": "bench b", "variant": "nolookahead"},
             {**row, "variant": "nolookahead", "step_us": 726.0})
    r.result(2, {"kind": "compile", "name": "compile a"},
             {"case": row["case"], "ms": 1.0, "compiled": True})
    r.result(2, {"kind": "timeline", "name": "timeline"},
             {"case": row["case"], "records": {"rows": [[0, 1, 2]]}})
    r.finish(12.0)
    d = json.loads((tmp_path / "gpu_check.json").read_text())
    assert d["read_bandwidth_GBps"] == 4000.0 and d["bench"][0]["step_ms"] == 0.66
    met = {t["metric"]: t["met"] for t in d["targets"] if t["weights"] == "bf16"}
    # 2.5 GB in 660 us = 3.79 TB/s = 0.947 of 4.0; 760 / 660 = 1.15; 1.0 ms / 0.66 ms = 1.52
    assert met == {"bw_fraction": True, "vs_hazy": True, "vs_compile": True}
    # no FP8 row in this run: the FP8 targets are reported, not judged
    assert all(t["met"] is None and "fp8 not run" in t["note"] for t in d["targets"]
               if t["weights"] == "fp8")
    assert d["lookahead_ab"] == {"case": row["case"], "with_us": 660.0, "without_us": 726.0,
                                 "speedup": pytest.approx(1.1)}
    assert json.loads((tmp_path / "timeline.json").read_text())["records"] == {"rows": [[0, 1, 2]]}
    md = (tmp_path / "gpu_check.md").read_text()
    assert ("| llama-3.2-1b B=1 T=1 | default | bf16 | 660.0 | 1515 | 2500.0 | 94.7% | 700.0 | "
            "cuda graph |") in md
    assert "read (stream kernel): 4000 GB/s" in md and "(met; of 4000 GB/s)" in md
    assert "L2 lookahead A/B, llama-3.2-1b B=1 T=1: 660.0 us with, 726.0 us without" in md


def test_a_synthetic_bench_case_runs_without_a_reference(tmp_path, monkeypatch):
    """A synthetic case (a model too large to hold twice) packs weights drawn where the kernel
    runs and fills a random cache in place of a prefill; its row says whether the first step's
    logits were finite and its tokens their argmax. Planted: logits that turn NaN are reported
    and shown in the report's decode-step table."""
    from megakernel.gpu_check import bench
    from megakernel.gpu_check.case import Weights
    from megakernel.gpu_check.report import markdown
    from megakernel.launch import torch_op
    from megakernel.serve import kernel_backend

    def no_reference(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a synthetic case must not build the reference")
    monkeypatch.setattr(kernel_backend.Megakernel, "prefill", no_reference)
    c = Case("kimi-linear-tiny", 2, 1, 4, bench=True, synthetic=True)
    res = bench.bench_case(c, tmp_path, Weights(), "default", None, simulate=True)
    assert res["synthetic"] and res["logits_finite"] and res["own_argmax"], res
    assert res["step_us"] > 0 and res["bytes_per_step"] > 0

    real = torch_op._outputs

    def nan(*a, **k):  # noqa: ANN002, ANN003, ANN202
        tok, logits = real(*a, **k)
        return tok, logits * float("nan")
    monkeypatch.setattr(torch_op, "_outputs", nan)
    bad = bench.bench_case(c, tmp_path, Weights(), "default", None, simulate=True)
    assert not bad["logits_finite"] and not bad["own_argmax"]
    d = {"bench": [{**bad, "item": "bench"}], "compile": [], "skipped": [], "notes": [],
         "cases": [], "stages": [], "device": "cpu", "simulated": True}
    assert "FIRST STEP: logits not finite" in markdown(d)


def test_fill_context_stands_in_for_a_prefill():
    """fill_context: every sequence at `context`, cache positions below it random and the rest
    untouched, recurrent state zero; a context with no room for the step is refused."""
    from megakernel.launch.checks import ArgumentError
    from megakernel.models import preset
    from megakernel.models.weights import LazyRandomWeights
    from megakernel.serve.kernel_backend import Megakernel

    cfg = preset("qwen3.5-tiny")
    mk = Megakernel(cfg, LazyRandomWeights(cfg), batch=2, max_seq_len=32, device="cpu")
    mk.state.fill_(1.0)
    mk.fill_context(20, seed=1)
    assert mk.lengths == [20, 20] and mk._region("i32", "lengths").tolist() == [20, 20]
    for cache in (mk.k_cache, mk.v_cache):
        assert bool((cache[:, :, :, :20] != 0).all()) and not bool(cache[:, :, :, 20:].any())
    assert not bool(mk.state.any())
    tok, logits = mk.step(torch.ones(2, 1, dtype=torch.int64), return_logits=True)
    assert bool(torch.isfinite(logits).all()) and mk.lengths == [21, 21]
    with pytest.raises(ArgumentError, match="no room"):
        mk.fill_context(32)
