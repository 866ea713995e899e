"""gpu-check's driver: stages of groups, each group in child processes, everything bounded.

The parent launches nothing on the GPU (it only reads the device's arch). A group's items (check
cases, or the benchmark's items) run in a child process that writes an event line before and after
each item; the parent streams the child's output (unbuffered) into the log, rewrites the report
after every finished item, and:
- kills the child when its current item outlives its cap (or the child's startup outlives
  STARTUP_S), or when the whole run's deadline comes;
- when a child dies (a device trap or sticky CUDA error ends the process: its context is gone),
  records which item it was running and how it ended (exit status, the output's tail), and
  starts a fresh child for the group's remaining items while time is left.
Every child's timeout is at most the time left before the deadline, so the whole command ends
within `budget_s` (BUDGET_S: 8.5 minutes, the parent's own start included) whatever hangs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from megakernel.gpu_check import report as rep
from megakernel.gpu_check.cases import BENCH_CASES, STAGES, Case, Stage, variant_dir

BUDGET_S = 8.5 * 60
SIMULATE_BUDGET_S = 3 * BUDGET_S  # the CPU executor serves the launches: slower, same deadlines
EMULATE_BUDGET_S = 6 * 3600.0  # the PTX emulator: every stage-1 case is minutes of CPU
PARENT_START_S = 10.0  # the parent's own imports and setup, counted against the budget
STARTUP_S = 60.0  # a child's imports and CUDA context before its first item
REPORT_S = 5.0  # kept for writing the last report
SIMULATE_CAP = 4.0  # the CPU executor is slower than a GPU: caps scale by this when simulated
EMULATE_CAP = 20.0  # and the emulator slower again: a tiny step is seconds of CPU
# the largest preset an emulated case runs (the tiny and mid presets; a cut real preset's
# vocabulary alone is minutes a step)
EMULATE_MAX_PARAMS = 3.0e7
MIN_ITEM_S = 5.0  # an item is not started with less time than this left
# the largest (cut) preset a simulated case builds random weights and references for on the CPU
SIMULATE_MAX_PARAMS = 1.0e9
SAME_EXECUTOR = "simulated: one CPU executor serves every variant (stage 0 runs both)"


# ---- items ---------------------------------------------------------------------------------------
def item(kind: str, case: Case, variant: str, cap_s: float | None = None) -> dict[str, Any]:
    return {"kind": kind, "case": case.to_dict(), "variant": variant,
            "cap_s": case.cap_s if cap_s is None else cap_s,
            "name": f"{kind} {case.name} [{variant}]"}


def bench_items(build_dir: Path, arch: str | None) -> list[dict[str, Any]]:
    """The benchmark stage: bandwidths and clocks first, then the decode benchmarks (default
    variant; the global one and the one without the L2 lookahead on the first case), the
    torch.compile baselines at B = 1 (dense families) and one step's timeline."""
    from megakernel.launch.torch_decode import serves
    from megakernel.models import preset

    first = BENCH_CASES[0]
    out = [item("measure", first, "default", 60)]
    out += [item("bench", c, "default", 45) for c in BENCH_CASES]
    out += [item("bench", first, v, 45) for v in ("global", "nolookahead")]
    # the torch.compile baseline (torch_decode.TorchDecode) is of the dense families' bf16
    # models only
    out += [item("compile", c, "default", 90) for c in BENCH_CASES
            if c.batch == 1 and not c.fp8 and serves(preset(c.model))]
    out.append(item("timeline", first, "timeline", 45))
    return [it for it in out if it["kind"] in ("measure", "compile")
            or have_build(build_dir, it, arch)]


def have_build(build_dir: Path, it: dict[str, Any], arch: str | None) -> bool:
    """The item's variant has a build for its case and this GPU's arch (None: simulated)."""
    if arch is None:
        return True
    from megakernel.kernel.config.model_spec import make_spec
    from megakernel.kernel.host.variants import VARIANTS

    c = Case.from_dict(it["case"])
    try:
        cfg = c.config()  # the case's weight format: an FP8 case's build is an FP8 build
        make_spec(cfg, c.batch, c.tokens, arch, **VARIANTS[it["variant"]], **c.build_kw)
        # as prepare names it
        tag = make_spec(cfg, c.batch, c.tokens, arch, **c.build_kw).tag
    except Exception:  # the variant cannot serve the case: not built either
        return False
    return (variant_dir(build_dir, it["variant"]) / tag / arch / "manifest.json").is_file()


# ---- parent --------------------------------------------------------------------------------------
def run(out: Path, build_dir: Path, stages: list[int], simulate: bool = False,
        budget_s: float = BUDGET_S, arch: str | None = None,
        stage_table: tuple[Stage, ...] = STAGES, emulate: bool = False) -> dict[str, Any]:
    """Run the stages; returns the report (also in `out`, rewritten after every item).
    `simulate`: on the CPU, the CPU executor serving every launch; with `emulate` too, each
    variant's own `arch` build on the PTX emulator (every variant runs: each is its own code)."""
    t0 = time.time()
    deadline = t0 + budget_s - PARENT_START_S - REPORT_S
    r = rep.Report(out, build_dir, simulate, budget_s, emulate)
    hung: set[str] = set()  # variants that hung: later stages do not wait for them again
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        work_dir = Path(work)
        (work_dir / "weights").mkdir()
        for st in stage_table:
            if st.number not in stages:
                continue
            r.stage(st)
            for g in st.groups:
                items = [item("check", c, g.variant) for c in g.cases]
                if g.variant in hung:
                    for it in items:
                        r.skip(st.number, it["name"], f"the {g.variant} variant hung earlier")
                    continue
                if simulate and not emulate and st.number > 0 and g.variant != "default":
                    for it in items:
                        r.skip(st.number, it["name"], SAME_EXECUTOR)
                    continue
                if simulate:
                    items = _simulable(items, r, st.number, emulate)
                missing = [it for it in items if not have_build(build_dir, it, arch)]
                for it in missing:
                    r.skip(st.number, it["name"], f"no {arch} build in {build_dir}")
                items = [it for it in items if it not in missing]
                if _run_group(st.number, items, r, work_dir, build_dir, simulate, deadline,
                              emulate=emulate):
                    hung.add(g.variant)
        if 2 in stages and any(s.number == 2 for s in stage_table) and emulate:
            for it in bench_items(build_dir, None):
                r.skip(2, it["name"], "emulated: the emulator measures no time")
        elif 2 in stages and any(s.number == 2 for s in stage_table):
            items = bench_items(build_dir, arch)
            if simulate:
                for it in [it for it in items if it["variant"] not in ("default", "timeline")]:
                    r.skip(2, it["name"], SAME_EXECUTOR)
                items = _simulable([it for it in items
                                    if it["variant"] in ("default", "timeline")], r, 2)
            _run_group(2, items, r, work_dir, build_dir, simulate, deadline, task="bench")
    r.finish(time.time() - t0)
    return r.data


def _run_group(stage: int, items: list[dict[str, Any]], r: rep.Report, work: Path,
               build_dir: Path, simulate: bool, deadline: float, task: str = "check",
               emulate: bool = False) -> bool:
    """Run `items` in as many children as crashes need; returns whether one hung."""
    pending, hung, n = list(items), False, 0
    while pending:
        left = deadline - time.time()
        if left < MIN_ITEM_S + 1:
            for it in pending:
                r.skip(stage, it["name"], "time budget spent")
            return hung
        n += 1
        events = work / f"events-{stage}-{task}-{id(items)}-{n}.jsonl"
        job = work / f"job-{stage}-{id(items)}-{n}.json"
        scale = EMULATE_CAP if emulate else SIMULATE_CAP if simulate else 1.0
        job.write_text(json.dumps({"items": pending, "build_dir": str(build_dir),
                                   "events": str(events), "deadline": deadline,
                                   "simulate": simulate, "emulate": emulate, "cap_scale": scale,
                                   "weights_dir": str(work / "weights")}))
        done, running, how, tail = _child(job, events, pending, r, stage, deadline, scale)
        finished = {name for name in done}
        if running is not None:  # the child ended inside an item: that item failed
            r.crashed(stage, running, how, tail)
            finished.add(running["name"])
            hung = hung or how.startswith("timed out")
        elif not all(it["name"] in finished for it in pending):
            if how != "exit 0":
                r.note(f"stage {stage}: a child process ended ({how}) before starting its next "
                       f"item: {tail.strip().splitlines()[-1] if tail.strip() else ''}")
            hung = hung or how.startswith("timed out")
            if not done:  # nothing ran (no time left, or it could not start): do not loop
                why = "time budget spent" if how == "exit 0" else f"the child process ended " \
                                                                   f"({how})"
                for it in pending:
                    r.skip(stage, it["name"], why)
                return hung
        pending = [it for it in pending if it["name"] not in finished]
    return hung


def child_command(job: Path) -> list[str]:
    """The command line of a child process running `job`."""
    return [sys.executable, "-u", "-m", "megakernel.gpu_check", "--child", str(job)]


def _child(job: Path, events: Path, items: list[dict[str, Any]], r: rep.Report, stage: int,
           deadline: float, scale: float):  # noqa: ANN202
    """Start one child on `job`; watch it until it ends or must be killed."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    proc = subprocess.Popen(child_command(job), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tail: list[str] = []
    reader = threading.Thread(target=_pump, args=(proc, r, tail), daemon=True)
    reader.start()
    caps = {it["name"]: it["cap_s"] * scale for it in items}
    started = time.time()
    seen, done, running, how = 0, [], None, ""
    while True:
        rc = proc.poll()
        seen, evs = _read_events(events, seen)
        for ev in evs:
            if ev["event"] == "start":
                running, started = next(it for it in items if it["name"] == ev["name"]), ev["t"]
            elif ev["event"] == "done":
                r.result(stage, running or {"name": ev["name"]}, ev["result"])
                done.append(ev["name"])
                running = None
            elif ev["event"] == "device":
                r.device(ev["info"])
        if rc is not None:
            how = f"exit {rc}"
            break
        now = time.time()
        cap = caps[running["name"]] if running is not None else STARTUP_S
        if now - started > cap or now > deadline:
            why = (f"timed out after {now - started:.0f} s (cap {cap:.0f} s)" if now <= deadline
                   else "timed out: the run's deadline came")
            _kill(proc)
            how = why
            break
        time.sleep(0.2)
    reader.join(timeout=5)
    return done, running, how, "".join(tail[-60:])


def _pump(proc: subprocess.Popen, r: rep.Report, tail: list[str]) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        r.log(line)
        tail.append(line)
        del tail[:-200]


def _kill(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait(timeout=30)


def _read_events(path: Path, seen: int) -> tuple[int, list[dict[str, Any]]]:
    if not path.is_file():
        return seen, []
    lines = path.read_text().splitlines()
    out = []
    for line in lines[seen:]:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written: read it next time
            break
    return seen + len(out), out


# ---- child ---------------------------------------------------------------------------------------
def child(job_file: Path) -> int:
    """Run a job's items in order, an event line before and after each; 3 when the CUDA context
    is broken (the parent goes on in a fresh process)."""
    job = json.loads(Path(job_file).read_text())
    events = open(job["events"], "a", buffering=1)  # noqa: SIM115 (line-buffered for the parent)
    simulate, build_dir = job["simulate"], Path(job["build_dir"])
    emulate = job.get("emulate", False)

    def emit(**ev: Any) -> None:
        events.write(json.dumps(ev, default=str) + "\n")
        events.flush()

    import torch

    from megakernel.gpu_check import bench
    from megakernel.gpu_check.case import Weights, run_case
    from megakernel.gpu_check.spec_case import run_speculative_case

    emit(event="device", info=_device_info(simulate, emulate))
    weights = Weights(Path(job["weights_dir"]), "cpu" if simulate else "cuda")
    measured: dict[str, Any] = {}
    for it in job["items"]:
        if time.time() + MIN_ITEM_S > job["deadline"]:
            return 0  # the parent records what is left as skipped
        c = Case.from_dict(it["case"])
        emit(event="start", name=it["name"], t=time.time())
        print(f"== {it['name']}", flush=True)
        t0 = time.perf_counter()
        try:
            kind, v = it["kind"], it["variant"]
            if kind == "check":
                run = run_speculative_case if c.drafts else run_case  # spec_case.py
                res = run(c, variant_dir(build_dir, v), weights, simulate, emulate=emulate)
            elif kind == "measure":
                res = measured = bench.measure_bandwidth(build_dir, simulate)
            elif kind == "bench":
                res = bench.bench_case(c, build_dir, weights, v,
                                       measured.get("achievable_bytes_per_s"), simulate)
            elif kind == "compile":
                res = bench.torch_compile_baseline(c, weights, simulate)
            else:
                res = bench.timeline(c, build_dir, weights, simulate)
        except Exception as e:  # recorded with its full text; a broken context ends the process
            res = {"ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]}
        res.setdefault("seconds", round(time.perf_counter() - t0, 2))
        emit(event="done", name=it["name"], result=res)
        print(f"   {'ok' if res.get('ok', 'error' not in res) else 'FAILED'} "
              f"in {res['seconds']} s {res.get('error', '')}", flush=True)
        if not simulate and "error" in res and not _context_alive(torch):
            return 3
    return 0


def _context_alive(torch) -> bool:  # noqa: ANN001
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def _simulable(items: list[dict], r, stage: int, emulate: bool = False  # noqa: ANN001 (Report)
               ) -> list[dict]:
    """The items a simulated (or emulated) run can afford; the rest are skipped with the reason
    (a cut preset still too big for the CPU machine's memory and minutes)."""
    cap, who = ((EMULATE_MAX_PARAMS, "the PTX emulator") if emulate
                else (SIMULATE_MAX_PARAMS, "the CPU executor"))
    out = []
    for it in items:
        if "case" in it and _simulated_params(Case.from_dict(it["case"])) > cap:
            r.skip(stage, it["name"], f"{'emulated' if emulate else 'simulated'}: more than "
                   f"{cap / 1e6:g}M parameters for {who}")
        else:
            out.append(it)
    return out


def _simulated_params(case: Case) -> int:
    """Parameters of the preset as a simulated case cuts it (case.config); 0 for a name that is
    no preset (the case itself then says so)."""
    import math

    from megakernel.gpu_check.case import config
    from megakernel.models import ConfigError
    from megakernel.models.weights import expected_shapes

    try:
        cfg = config(case, True)
    except ConfigError:
        return 0
    return sum(math.prod(s) for s in expected_shapes(cfg).values())


def _device_info(simulate: bool, emulate: bool = False) -> dict[str, Any]:
    import torch

    if emulate:
        from megakernel.launch.emulated import EMULATED_ARCH, EMULATED_SMS

        return {"device": "PTX emulator",
                "arch": EMULATED_ARCH, "sms": EMULATED_SMS, "torch": torch.__version__}
    if simulate:
        return {"device": "CPU executor (simulated)", "arch": "simulated", "sms": 0,
                "torch": torch.__version__}
    from megakernel.launch.runtime import device_info

    d = device_info()
    return {"device": d.name, "capability": list(d.capability), "arch": d.arch,
            "sms": d.sm_count, "torch": torch.__version__}
