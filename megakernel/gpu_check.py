"""`python -m megakernel gpu-check`: the one script to run on a lent GPU machine (rung 4).

The GPU machine has torch + cuda-python but not the DSL, so the cubins are built beforehand on any
machine and carried over:

    python -m megakernel gpu-check --prepare --build-dir out/gpu-builds --arch sm_90a   # CPU, DSL
    python -m megakernel gpu-check --build-dir out/gpu-builds --out out/gpu-check       # GPU

Kernel variants (`variants()`): the default build and the other side of the shared-memory weight
pipeline switch (spec.smem_stages); --prepare builds both (DIR/<tag>/ and DIR/<variant>/<tag>/),
the run checks each in its own child process (a device-side trap in one cannot take the other's
CUDA context down) with half of the time budget, and reports them side by side.

For each case (model, B, T) whose build is present it runs the kernel against the torch reference
(bf16 mirror and fp32 truth, on the GPU) with random weights and ragged prompt lengths, every step
teacher-forced with the kernel's own tokens so that all three see the same inputs:
- scratch poisoned (NaN, tokens_out -1) before the first step and the outputs before every step;
  every logit must be finite and every token in range afterwards (nothing left unwritten);
- DESIGN.md section 4: max |kernel - fp32| <= 2 max |ref_bf16 - fp32| + noise, per step;
- greedy tokens of kernel and bf16 reference agree at every step where the reference's top-2
  margin is clear: above twice the kernel's measured logit error against the reference at that
  step (a smaller margin is a near tie that rounding may legitimately flip; near ties are counted
  and must stay rare, see `greedy_check`);
- repeated runs from the same state are bit-identical;
- tiny models: the first steps against the CPU executor of the same program (logits close, bf16
  KV-cache entries equal up to a few one-ulp flips at shared rounding points).
Then a short benchmark (CUDA graph of decode steps, CUDA events) next to the cost model's
prediction and a measured device-to-device copy. Results: DIR/gpu_check.json, DIR/gpu_check.md,
and a table printed last. The whole run is kept under 8 minutes (cases are skipped, and reported,
when the time budget runs out).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIME_BUDGET_S = 7 * 60 + 30


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    tokens: int
    steps: int
    executor_steps: int = 0  # steps also checked against the CPU executor (tiny models)
    bench: bool = False


CASES = (
    Case("llama-tiny", 1, 1, 128, 4),
    Case("llama-tiny", 4, 1, 64, 2),
    Case("llama-tiny", 16, 1, 64, 1),
    Case("llama-tiny", 1, 4, 64, 1),
    Case("llama-tiny", 4, 4, 64, 1),
    Case("qwen3-tiny", 1, 1, 128, 4),
    Case("qwen3-tiny", 4, 1, 64, 2),
    Case("qwen3-tiny", 16, 1, 64, 1),
    Case("qwen3-tiny", 4, 4, 64, 1),
    Case("qwen3-tiny", 40, 1, 64, 1),  # 40 > NO = 32 rows: two passes over the activation rows
    Case("llama-3.2-1b", 1, 1, 64, 0, bench=True),
    Case("llama-3.2-1b", 4, 1, 64),
    Case("llama-3.2-1b", 16, 1, 64, bench=True),  # a second batch size: the refit needs it
    Case("llama-3.2-1b", 1, 4, 64),
    Case("qwen3-0.6b", 1, 1, 64, 0, bench=True),
    Case("qwen3-0.6b", 4, 4, 64),
)


# ---- prepare (CPU, needs the DSL) ---------------------------------------------------------------
def variants() -> tuple[tuple[str, int | None], ...]:
    """(name, smem_stages) of the kernel variants gpu-check compares: the default build (None:
    the deepest shared-memory ring that fits, spec.make_spec) and the global-memory weight path
    (0: no loader warp, the lookahead at each reached slab)."""
    return (("default", None), ("global", 0))


def variant_dir(build_dir: str | Path, name: str) -> Path:
    """Build set of a variant: the default one is build_dir itself (what `Megakernel` finds)."""
    return Path(build_dir) if name == "default" else Path(build_dir) / name


def prepare(build_dir: str | Path, archs: list[str], cases=CASES) -> tuple[list[dict], list[str]]:
    """Build every case for every arch and variant; a build that fails (or a variant whose spec
    cannot serve a case) is reported and skipped: it does not stop the others. Returns the
    manifests and the failures ('variant case arch: error')."""
    from megakernel.kernel.build import build_arch
    from megakernel.kernel.spec import make_spec
    from megakernel.models import preset

    out, failed = [], []
    done = set()
    for c in cases:
        cfg = preset(c.model)
        for arch in archs:
            for name, stages in variants():
                tag = make_spec(cfg, c.batch, c.tokens, arch).tag
                if (tag, arch, name) in done:
                    continue
                done.add((tag, arch, name))
                what = f"{name} {c.model} B={c.batch} T={c.tokens} {arch}"
                t0 = time.perf_counter()
                try:
                    m = build_arch(cfg, arch, variant_dir(build_dir, name) / tag, c.batch,
                                   c.tokens, smem_stages=stages)
                except Exception as e:  # SpecError (variant cannot serve the case), BuildError
                    failed.append(f"{what}: {type(e).__name__}: {str(e)[:300]}")
                    print(f"FAILED {failed[-1]}")
                    continue
                r = m["resources"]
                print(f"built {what}: {r['registers']} regs, spills {r['spill_stores']}/"
                      f"{r['spill_loads']}, smem {m['dynamic_smem_bytes']} B, "
                      f"{time.perf_counter() - t0:.1f} s")
                out.append(m)
    return out, failed


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _noise(x) -> float:
    """Rounding-noise term of DESIGN.md section 4: 2 max |(x + 0.3 - 0.3) - x| (fp32)."""
    return 2.0 * float(((x + 0.3) - 0.3 - x).abs().max())


NEAR_TIE_FRACTION = 0.05  # at most this share of tokens may be near ties that flipped
MIN_PREFIX = 16  # free-running generations must agree this long unless a near tie comes first


def top2_margin(logits):  # noqa: ANN001, ANN201
    """[..., V] logits -> [...] gap between the largest and the second largest (fp32)."""
    import torch

    top = torch.topk(logits.float(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def greedy_check(kernel_logits, kernel_tokens, ref_logits) -> dict[str, Any]:  # noqa: ANN001
    """Teacher-forced greedy comparison of one step: [R, V] logits, [R] kernel tokens.

    Row r's tokens must be equal when the reference's top-2 margin exceeds 2 * max |kernel -
    reference| on that row: then no error of that size can reorder the top two, so a mismatch is
    a real defect ("clear"). Below it the row is a near tie and a mismatch is only counted.
    """
    import torch

    k = kernel_logits.float()
    ref = ref_logits.float().to(k.device)
    err = (k - ref).abs().amax(dim=-1)  # [R]
    bound = 2.0 * err
    margin = top2_margin(ref)
    want = torch.argmax(ref, dim=-1)
    bad = kernel_tokens.to(want.device).long() != want
    clear = bad & (margin > bound)
    return {"clear": int(clear.sum()), "near_ties": int((bad & ~clear).sum()),
            "mismatch": bool(bad.any()), "min_margin": float(margin.min()),
            "max_bound": float(bound.max())}


def common_prefix(kernel_tokens: list[int], ref_tokens: list[int], ref_margins: list[float],
                  bound: float) -> dict[str, Any]:
    """Free-running greedy comparison of one sequence.

    Steps are compared until the first one whose reference top-2 margin is <= `bound` (a near
    tie: both generations may legitimately part there, and later steps see different inputs).
    Returns the compared length, where the sequences first differ (None if they agree), whether
    a near tie ended the comparison, and `ok`: no difference in the compared steps, and the
    compared prefix is at least MIN_PREFIX long (or all steps) unless a near tie came first.
    """
    n = min(len(kernel_tokens), len(ref_tokens), len(ref_margins))
    compared, tie = n, False
    for t in range(n):
        if ref_margins[t] <= bound:
            compared, tie = t, True  # the near-tie step itself may differ: not compared
            break
    first = next((t for t in range(n) if kernel_tokens[t] != ref_tokens[t]), None)
    diverged = first is not None and first < compared
    long_enough = compared >= min(n, MIN_PREFIX) or tie
    return {"compared": compared, "first_difference": first, "near_tie_stop": tie,
            "ok": not diverged and long_enough and len(kernel_tokens) == len(ref_tokens)}


def run_case(c: Case, build_dir: Path, seed: int = 0) -> dict[str, Any]:
    import torch

    from megakernel.kernel.spec import KernelSpec
    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.torch_op import Megakernel
    from reference.model import ReferenceModel

    t0 = time.perf_counter()
    cfg = preset(c.model)
    dev = torch.device("cuda", torch.cuda.current_device())
    weights = random_weights(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    lens = [int(x) for x in torch.randint(2, 24, (c.batch,), generator=g)]
    prompts = [[int(t) for t in torch.randint(0, cfg.vocab_size, (n,), generator=g)]
               for n in lens]
    s_max = max(lens) + c.steps * c.tokens + 8
    mk = Megakernel(cfg, weights, batch=c.batch, tokens=c.tokens, max_seq_len=s_max,
                    build_dir=build_dir, device=dev)
    built = KernelSpec.from_dict(mk.manifest.spec)  # the build this case runs
    ref16 = ReferenceModel(cfg, weights, mode="bf16", device=dev)
    ref32 = ReferenceModel(cfg, weights, mode="fp32", device=dev)
    cache16, cache32 = ref16.new_cache(c.batch, s_max), ref32.new_cache(c.batch, s_max)
    first = mk.prefill(prompts)
    ref16.prefill(cache16, prompts)
    ref32.prefill(cache32, prompts)
    # poison every scratch value (the program's constants, e.g. RoPE tables, are kept) before
    # the first kernel step
    consts = mk.prog.buffers.constants
    keep = [mk._region("f32", n).clone() for n in consts]
    mk.f32.fill_(float("nan"))
    mk.bf16.fill_(float("nan"))
    for n, k in zip(consts, keep, strict=True):
        mk._region("f32", n).copy_(k)
    snap = None
    res: dict[str, Any] = dict(model=c.model, batch=c.batch, tokens=c.tokens, prompt_lengths=lens,
                               steps=0, token_mismatches=0, max_err_kernel=0.0,
                               max_err_bf16ref=0.0, tolerance_failures=0, unwritten=0,
                               near_tie_mismatches=0, first_mismatch_step=None,
                               gemv="mma" if built.mma else "fma",
                               smem_stages=built.smem_stages)
    tok = first[:, None].repeat(1, c.tokens) if c.tokens > 1 else first[:, None]
    last = first
    for step in range(c.steps):
        if c.tokens > 1 and step > 0:  # a verify-style step: last token + random drafts
            draft = torch.randint(0, cfg.vocab_size, (c.batch, c.tokens - 1), generator=g)
            tok = torch.cat((last[:, None].cpu(), draft), dim=1)
        tok = tok.to(dev)
        if step == 8:
            snap = _snapshot(mk)
        mk.logits.fill_(float("nan"))
        mk._region("i32", "tokens_out").fill_(-1)
        out_tok, logits = mk.step(tok, return_logits=True)
        logits = logits.view(c.batch, c.tokens, -1)
        l16 = ref16.decode(cache16, tok)
        l32 = ref32.decode(cache32, tok)
        if not bool(torch.isfinite(logits).all()) or bool((out_tok < 0).any()):
            res["unwritten"] += 1
        ek, e16 = _err(logits, l32), _err(l16, l32)
        res["max_err_kernel"] = max(res["max_err_kernel"], ek)
        res["max_err_bf16ref"] = max(res["max_err_bf16ref"], e16)
        if not ek <= 2 * e16 + _noise(l32):
            res["tolerance_failures"] += 1
        kt = out_tok.view(c.batch, c.tokens).long()
        gc = greedy_check(logits.reshape(-1, logits.shape[-1]), kt.reshape(-1),
                          l16.reshape(-1, l16.shape[-1]))
        res["token_mismatches"] += gc["clear"]
        res["near_tie_mismatches"] += gc["near_ties"]
        if gc["mismatch"] and res["first_mismatch_step"] is None:
            res["first_mismatch_step"] = step
        last = kt[:, -1]
        tok = last[:, None] if c.tokens == 1 else tok
        res["steps"] += 1
    torch.cuda.synchronize()
    if snap is not None:
        res["deterministic"] = _replay_is_identical(mk, snap, cfg, c)
    if c.executor_steps:
        res.update(_against_executor(cfg, weights, prompts, c, dev, build_dir))
    res["seconds"] = round(time.perf_counter() - t0, 2)
    res["near_ties_ok"] = (res["near_tie_mismatches"]
                           <= max(1, int(NEAR_TIE_FRACTION * c.steps * c.batch * c.tokens)))
    res["ok"] = (res["unwritten"] == 0 and res["tolerance_failures"] == 0
                 and res["token_mismatches"] == 0 and res["near_ties_ok"]
                 and res.get("deterministic", True)
                 and res.get("executor_ok", True))
    return res


def _snapshot(mk) -> dict:
    return {n: getattr(mk, n).clone() for n in ("counters", "f32", "bf16", "i32", "k_cache",
                                                "v_cache")} | {"lengths": list(mk.lengths)}


def _replay_is_identical(mk, snap: dict, cfg, c: Case) -> bool:
    """Run 4 steps from the snapshot twice (same tokens): logits must be bit-identical."""
    import torch

    outs = []
    counters_now = mk.counters.clone()
    for _ in range(2):
        for n in ("f32", "bf16", "i32", "k_cache", "v_cache"):
            getattr(mk, n).copy_(snap[n])
        mk.lengths = list(snap["lengths"])
        g = torch.Generator().manual_seed(123)
        seq = []
        for _ in range(4):
            tok = torch.randint(0, cfg.vocab_size, (c.batch, c.tokens), generator=g)
            _, lg = mk.step(tok.to(mk.device), return_logits=True)
            seq.append(lg)
        outs.append(torch.stack(seq))
    del counters_now  # counters keep counting epochs: no reset needed between replays
    return bool(torch.equal(outs[0], outs[1]))


def _against_executor(cfg, weights, prompts, c: Case, dev, build_dir) -> dict:
    """First steps of the same program on the CPU executor vs the kernel (same cache/tokens)."""
    import torch

    from megakernel.executor import Executor
    from megakernel.program.pack import pack_weights
    from megakernel.torch_op import Megakernel

    s_max = max(len(p) for p in prompts) + c.executor_steps * c.tokens + 8
    mk = Megakernel(cfg, weights, batch=c.batch, tokens=c.tokens, max_seq_len=s_max,
                    build_dir=build_dir, device=dev)
    mk.prefill(prompts)
    ex = Executor(mk.prog, pack_weights(cfg, weights), check=True)
    ex.k.copy_(mk.k_cache.cpu())  # the kernel's cache after its prefill, as the executor's
    ex.v.copy_(mk.v_cache.cpu())
    ex.lengths.copy_(torch.tensor(mk.lengths, dtype=torch.int32))
    g = torch.Generator().manual_seed(99)
    worst, kv_diff, tok_diff = 0.0, 0, 0
    for _ in range(c.executor_steps):
        tok = torch.randint(0, cfg.vocab_size, (c.batch, c.tokens), generator=g)
        kt, lg = mk.step(tok.to(dev), return_logits=True)
        et = ex.step(tok)
        worst = max(worst, _err(lg.cpu(), ex.logits))
        del et  # = argmax of ex.logits; compared below with the near-tie rule
        v = ex.logits.shape[-1]
        tok_diff += greedy_check(lg.cpu().reshape(-1, v), kt.cpu().reshape(-1),
                                 ex.logits.reshape(-1, v))["clear"]
        for mine, theirs in ((mk.k_cache, ex.k), (mk.v_cache, ex.v)):
            a, b = mine.cpu().float(), theirs.float()
            kv_diff += int(((a != b) & torch.isfinite(a) & torch.isfinite(b)).sum())
    scale = float(ex.logits.abs().max())
    return {"executor_max_logit_diff": worst, "executor_logit_scale": scale,
            "executor_token_mismatches": tok_diff, "executor_kv_bf16_flips": kv_diff,
            "executor_ok": worst <= 1e-3 * max(scale, 1.0) and tok_diff == 0}


# ---- benchmark ----------------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    import torch

    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 * iters / (e0.elapsed_time(e1) / 1e3)


def bench_case(c: Case, build_dir: Path, copy_bw: float, replays: int = 50) -> dict[str, Any]:
    """Decode steps captured in a CUDA graph; time per step next to the cost model."""
    import torch

    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.torch_op import Megakernel

    cfg = preset(c.model)
    mk = Megakernel(cfg, random_weights(cfg, seed=1), batch=c.batch, tokens=1,
                    max_seq_len=1024 + 2 * replays + 64, build_dir=build_dir)
    mk.prefill([[1] * 1024 for _ in range(c.batch)])
    mk.step(torch.ones(c.batch, 1, dtype=torch.int64, device=mk.device))
    torch.cuda.synchronize()
    args = (mk.program, mk.counters, mk.weights, mk.f32, mk.bf16, mk.i32, mk.k_cache,
            mk.v_cache, mk.kernel_id, mk.offsets, False)
    graph, how = torch.cuda.CUDAGraph(), "cuda graph"
    try:
        with torch.cuda.graph(graph):
            torch.ops.megakernel.decode_step(*args)
        run_once = graph.replay
    except Exception as e:  # capture refused (e.g. a cooperative launch): time plain launches
        how = f"stream launches (graph capture failed: {type(e).__name__}: {e})"
        torch.cuda.synchronize()

        def run_once() -> None:
            torch.ops.megakernel.decode_step(*args)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        run_once()
    e1.record()
    torch.cuda.synchronize()
    step_s = e0.elapsed_time(e1) / 1e3 / replays
    cost = mk.prog.cost
    nbytes = cost.bytes_per_step if cost is not None else 0
    return {"model": c.model, "batch": c.batch, "tokens": 1, "context": 1024,
            "max_seq_len": mk.max_seq_len, "timed": how,
            "step_ms": step_s * 1e3,
            "tokens_per_s": c.batch / step_s, "bytes_per_step": nbytes,
            "bandwidth_fraction_of_copy": nbytes / step_s / copy_bw if nbytes else None,
            "predicted_ms": cost.predicted_s * 1e3 if cost is not None else None}


# ---- driver -------------------------------------------------------------------------------------
def _have_build(build_dir: Path, c: Case, arch: str) -> bool:
    """`build_dir` (one variant's build set) has this case's build for `arch`."""
    from megakernel.kernel.spec import make_spec
    from megakernel.models import preset

    tag = make_spec(preset(c.model), c.batch, c.tokens, arch).tag
    return (build_dir / tag / arch / "manifest.json").is_file()


def gpu_check(out: Path, build_dir: Path, quick: bool = False, variant: str | None = None,
              budget_s: float = TIME_BUDGET_S) -> dict[str, Any]:
    """Run the cases (and benches) of one variant in this process, or (variant None) every
    variant in its own child process: a variant that traps (a device-side watchdog) or hangs
    leaves the CUDA context unusable, and must not take the other variant down with it."""
    import torch

    from megakernel.runtime import KernelUnavailable, device_info

    if not torch.cuda.is_available():  # checked before any child starts (creates no context)
        raise KernelUnavailable("gpu-check needs a CUDA GPU; none is available here")
    if variant is None:
        return _run_variants(out, build_dir, quick)
    t_start = time.perf_counter()
    dev = device_info()
    report: dict[str, Any] = {"device": dev.name, "capability": list(dev.capability),
                              "arch": dev.arch, "sms": dev.sm_count, "torch": torch.__version__,
                              "build_dir": str(build_dir), "cases": [], "bench": [],
                              "skipped": []}
    cases = [c for c in CASES if not quick or c.model.endswith("tiny")]
    vdirs = [(variant, variant_dir(build_dir, variant))]
    for c in cases:
        for vname, vdir in vdirs:
            name = f"{c.model} B={c.batch} T={c.tokens} [{vname}]"
            if not _have_build(vdir, c, dev.arch):
                report["skipped"].append(f"{name}: no {dev.arch} build in {vdir}")
                continue
            if time.perf_counter() - t_start > budget_s * 0.8:
                report["skipped"].append(f"{name}: time budget spent")
                continue
            try:
                res = run_case(c, vdir)
            except Exception as e:  # record and go on: one failure must not hide the others
                res = {"model": c.model, "batch": c.batch, "tokens": c.tokens, "ok": False,
                       "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()[-3000:]}
            report["cases"].append({**res, "variant": vname})
    bw = copy_bandwidth()
    report["copy_bandwidth_GBps"] = bw / 1e9
    for c in cases:
        for vname, vdir in vdirs:
            if c.bench and _have_build(vdir, c, dev.arch):
                if time.perf_counter() - t_start > budget_s:
                    report["skipped"].append(f"bench {c.model} [{vname}]: time budget spent")
                    continue
                try:
                    b = bench_case(c, vdir, bw)
                except Exception as e:
                    b = {"model": c.model, "error": f"{type(e).__name__}: {e}"}
                report["bench"].append({**b, "variant": vname})
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    report["ok"] = bool(report["cases"]) and all(c.get("ok") for c in report["cases"])
    report["ok_by_variant"] = {v: all(c.get("ok") for c in report["cases"] if c["variant"] == v)
                               for v in {c["variant"] for c in report["cases"]}}
    report["measurements"] = measurements(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    return report


def _run_variants(out: Path, build_dir: Path, quick: bool) -> dict[str, Any]:
    """Each variant in a child process with its share of the time budget; reports merged."""
    import os
    import subprocess
    import sys

    names = [name for name, _ in variants()]
    share = TIME_BUDGET_S / len(names)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    merged: dict[str, Any] = {"build_dir": str(build_dir), "cases": [], "bench": [],
                              "skipped": [], "variants": names}
    t0 = time.perf_counter()
    for name in names:
        vout = out / name
        cmd = [sys.executable, "-m", "megakernel.gpu_check", "--out", str(vout), "--build-dir",
               str(build_dir), "--variant", name, "--budget-s", str(share)]
        if quick:
            cmd.append("--quick")
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=share + 120)
            tail, rc = (proc.stdout + proc.stderr)[-3000:], proc.returncode
        except subprocess.TimeoutExpired as e:
            tail, rc = f"timed out after {e.timeout:.0f} s", None
        f = vout / "gpu_check.json"
        if f.is_file() and rc is not None:
            r = json.loads(f.read_text())
            for k in ("device", "capability", "arch", "sms", "torch", "copy_bandwidth_GBps"):
                merged.setdefault(k, r.get(k))
            merged["cases"] += r["cases"]
            merged["bench"] += r["bench"]
            merged["skipped"] += r["skipped"]
        else:  # the child died (or hung) before writing its report: a failed variant
            last = tail.strip().splitlines()[-1] if tail.strip() else ""
            merged["cases"].append({"model": "-", "batch": 0, "tokens": 0, "variant": name,
                                    "ok": False, "error": f"variant process exit {rc}: {last}",
                                    "traceback": tail})
    for k, v in (("device", "?"), ("arch", "?"), ("sms", 0)):
        merged.setdefault(k, v)
        if merged[k] is None:
            merged[k] = v
    merged["seconds"] = round(time.perf_counter() - t0, 1)
    merged["ok"] = bool(merged["cases"]) and all(c.get("ok") for c in merged["cases"])
    merged["ok_by_variant"] = {n: any(c["variant"] == n for c in merged["cases"])
                               and all(c.get("ok") for c in merged["cases"]
                                       if c["variant"] == n) for n in names}
    merged["measurements"] = measurements(merged)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(merged, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(merged))
    return merged


def measurements(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark rows as cost-model measurements (program/refit.py's input format:
    `python -m megakernel plan --refit gpu_check.json`); a device without a GPU description
    gives none and a note in `skipped`. Never raises: the run's report must be written."""
    try:
        from megakernel.program.refit import from_gpu_check

        return from_gpu_check(report)
    except Exception as e:  # RefitError (unknown device), or anything else: keep the report
        report["skipped"].append(f"measurements for the cost-model refit: "
                                 f"{type(e).__name__}: {e}")
        return []


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# gpu-check on {r.get('device', '?')} ({r.get('arch', '?')}, {r.get('sms', 0)} SMs)",
             "",
             "| case | variant | steps | ok | max err kernel | max err bf16 ref "
             "| tok mismatch (near ties) | executor | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        if "error" in c:
            lines.append(f"| {c['model']} B={c['batch']} T={c['tokens']} | "
                         f"{c.get('variant', '-')} | - | FAIL | {c['error'][:80]} | | | | |")
            continue
        ex = (f"{c['executor_max_logit_diff']:.2e}" if "executor_max_logit_diff" in c else "-")
        lines.append(f"| {c['model']} B={c['batch']} T={c['tokens']} | "
                     f"{c.get('variant', '-')} ({c.get('gemv', '?')}, "
                     f"{c.get('smem_stages', '?')} stages) | {c['steps']} | "
                     f"{'yes' if c['ok'] else 'NO'} | {c['max_err_kernel']:.3e} | "
                     f"{c['max_err_bf16ref']:.3e} | {c['token_mismatches']} "
                     f"({c.get('near_tie_mismatches', 0)}) | {ex} | "
                     f"{c['seconds']} |")
    bw = r.get("copy_bandwidth_GBps") or float("nan")
    lines += ["", f"copy bandwidth: {bw:.0f} GB/s", ""]
    for b in r["bench"]:
        if "error" in b:
            lines.append(f"- bench {b['model']} [{b.get('variant', '-')}]: {b['error']}")
        else:
            frac = b["bandwidth_fraction_of_copy"]
            lines.append(f"- bench {b['model']} B={b['batch']} [{b.get('variant', '-')}]: "
                         f"{b['step_ms']:.3f} ms/step "
                         f"({b['tokens_per_s']:.0f} tok/s), "
                         f"{'-' if frac is None else f'{100 * frac:.0f}%'} of copy bandwidth, "
                         f"cost model {b['predicted_ms']:.3f} ms")
    for s in r["skipped"]:
        lines.append(f"- skipped: {s}")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out/gpu-check", help="directory for JSON + markdown")
    p.add_argument("--build-dir", default="out/gpu-builds",
                   help="prebuilt cubins (made by --prepare on a machine with the DSL)")
    p.add_argument("--prepare", action="store_true",
                   help="build the cubins every case needs into --build-dir (needs the DSL)")
    p.add_argument("--arch", default="sm_90a", help="archs for --prepare (comma list)")
    p.add_argument("--quick", action="store_true", help="tiny models only")
    p.add_argument("--variant", default=None,
                   help="run only this kernel variant in this process (default: every variant "
                        "of gpu_check.variants(), each in a child process)")
    p.add_argument("--budget-s", type=float, default=TIME_BUDGET_S,
                   help="time budget of a --variant run in seconds")


def run(args: argparse.Namespace) -> int:
    if args.prepare:
        archs = [a.strip() for a in args.arch.split(",") if a.strip()]
        t0 = time.perf_counter()
        ms, failed = prepare(args.build_dir, archs)
        print(f"prepared {len(ms)} builds in {args.build_dir} in {time.perf_counter() - t0:.0f} s"
              f"; {len(failed)} not built")
        for f in failed:
            print(f"  not built: {f}")
        # the default variant must build everywhere; the other one may not serve every case
        return 1 if any(f.startswith("default ") for f in failed) else 0
    r = gpu_check(Path(args.out), Path(args.build_dir), args.quick, args.variant, args.budget_s)
    print(markdown(r))
    status = "PASS" if r["ok"] else "FAIL"
    print("ok by variant: " + ", ".join(f"{v} {'PASS' if ok else 'FAIL'}"
                                        for v, ok in sorted(r["ok_by_variant"].items())))
    print(f"gpu-check {status}: {sum(bool(c.get('ok')) for c in r['cases'])}/{len(r['cases'])} "
          f"cases ok in {r['seconds']} s; details in {args.out}/gpu_check.md")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    import sys

    ap = argparse.ArgumentParser(prog="python -m megakernel.gpu_check")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))

