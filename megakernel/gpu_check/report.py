"""gpu-check's report: one JSON and one markdown file rewritten after every item, the children's
output in a log, one step's timeline records beside them; at most MAX_FILES files, all directly in
the output directory (a GPU machine returns at most 8 files, at most two folders deep)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from megakernel.gpu_check.cases import Stage

FILES = ("gpu_check.json", "gpu_check.md", "gpu_check.log", "timeline.json")
MAX_FILES = 8
assert len(FILES) <= MAX_FILES


class Report:
    def __init__(self, out: Path, build_dir: Path, simulate: bool, budget_s: float,
                 emulate: bool = False):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        for f in FILES:  # a rerun into the same directory starts clean
            (self.out / f).unlink(missing_ok=True)
        self._lock = threading.Lock()
        self._log = open(self.out / "gpu_check.log", "a", buffering=1)  # noqa: SIM115
        self.data: dict[str, Any] = {
            "simulated": simulate, "emulated": emulate, "budget_s": budget_s,
            "build_dir": str(build_dir),
            "device": "?", "arch": "?", "sms": 0, "stages": [], "cases": [], "bench": [],
            "measure": {}, "compile": [], "timeline": None, "skipped": [], "notes": [],
            "files": ["gpu_check.json", "gpu_check.md", "gpu_check.log"]}
        if emulate:
            self.data["notes"].append("emulated: each variant's build ran on the PTX emulator "
                                      "(the CPU); no number in this report is a GPU measurement")
        elif simulate:
            self.data["notes"].append("simulated: the CPU executor served every launch; no "
                                      "number in this report is a GPU measurement")
        self.write()

    # ---- events ---------------------------------------------------------------------------------
    def log(self, line: str) -> None:
        with self._lock:
            self._log.write(line)
        print(line, end="", flush=True)

    def device(self, info: dict[str, Any]) -> None:
        self.data.update(info)

    def stage(self, st: Stage) -> None:
        self.data["stages"].append({"number": st.number, "name": st.name, "doc": st.doc})
        self.log(f"==== stage {st.number} ({st.name}): {st.doc}\n")

    def skip(self, stage: int, name: str, why: str) -> None:
        self.data["skipped"].append({"stage": stage, "item": name, "why": why})
        self.write()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.write()

    def result(self, stage: int, it: dict[str, Any], res: dict[str, Any]) -> None:
        kind = it.get("kind", "check")
        row = {"stage": stage, "item": it["name"], "variant": it.get("variant"), **res}
        if kind == "check":
            self.data["cases"].append(row)
        elif kind == "bench":
            if "step_us" in row:
                row["step_ms"] = row["step_us"] / 1e3  # the refit's input (program/refit.py)
            self.data["bench"].append(row)
        elif kind == "measure":
            self.data["measure"] = res
            for k in ("read", "copy"):
                bps = (res.get(k) or {}).get("bytes_per_s")
                if bps:
                    self.data[f"{k}_bandwidth_GBps"] = bps / 1e9
        elif kind == "compile":
            self.data["compile"].append(row)
        else:  # the timeline's records go to their own file (`plan --timeline-records`)
            recs = row.pop("records", None)
            if recs is not None:
                (self.out / "timeline.json").write_text(json.dumps(res) + "\n")
                row["records_file"] = "timeline.json"
                if "timeline.json" not in self.data["files"]:
                    self.data["files"].append("timeline.json")
            self.data["timeline"] = row
        self.write()

    def crashed(self, stage: int, it: dict[str, Any], how: str, tail: str) -> None:
        """The process died (or was killed) inside item `it`."""
        self.result(stage, it, {"ok": False, "error": f"process ended inside this item: {how}",
                                "output_tail": tail[-4000:]})

    # ---- summary --------------------------------------------------------------------------------
    def finish(self, seconds: float) -> None:
        d = self.data
        d["seconds"] = round(seconds, 1)
        d["ok"] = bool(d["cases"]) and all(c.get("ok") for c in d["cases"])
        d["complete"] = not any(s["why"] == "time budget spent" for s in d["skipped"])
        d["ok_by_stage"] = _ok_by(d["cases"], "stage")
        d["ok_by_variant"] = _ok_by(d["cases"], "variant")
        d["bench_errors"] = sum("error" in b for b in d["bench"] + d["compile"])
        d["measurements"] = measurements(d)
        d["targets"] = _targets(d)
        d["lookahead_ab"] = lookahead_ab(d["bench"])
        self.write()
        self._log.close()

    def write(self) -> None:
        with self._lock:
            (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1,
                                                                default=str) + "\n")
            (self.out / "gpu_check.md").write_text(markdown(self.data))


def _bench_check(b: dict[str, Any]) -> str:
    """What the benchmark's first step showed wrong (its logits not finite, its tokens not their
    argmax), for the timed cell; '' when nothing (or nothing recorded)."""
    bad = [w for k, w in (("logits_finite", "logits not finite"),
                          ("own_argmax", "tokens not the argmax")) if b.get(k) is False]
    return f" (FIRST STEP: {', '.join(bad)})" if bad else ""


def _ok_by(rows: list[dict[str, Any]], key: str) -> dict[str, bool]:
    return {str(k): all(r.get("ok") for r in rows if r.get(key) == k)
            for k in sorted({r.get(key) for r in rows}, key=str)}


def measurements(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Benchmark rows of the default and global variants as cost-model measurements
    (`plan --refit gpu_check.json`); never raises: the report must be written. bf16 rows only:
    a measurement names its model by preset, which the refit compiles in bf16 (an FP8 row's
    bytes would be fitted as bf16 bytes)."""
    if d.get("simulated"):
        return []
    try:
        from megakernel.program.measurements import from_gpu_check

        rows = [b for b in d.get("bench", []) if b.get("variant", "default") in ("default",
                                                                                 "global")
                and b.get("weights", "bf16") == "bf16"]
        return from_gpu_check({**d, "bench": rows})
    except Exception as e:
        d.setdefault("notes", []).append(f"measurements for the cost-model refit: "
                                         f"{type(e).__name__}: {e}")
        return []


def lookahead_ab(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The L2 lookahead's worth: the same case with the lookahead (default) and without."""
    by = {(r.get("case"), r.get("variant")): r for r in rows if "step_us" in r}
    for (case, v), r in by.items():
        off = by.get((case, "nolookahead"))
        if v == "default" and off is not None:
            return {"case": case, "with_us": r["step_us"], "without_us": off["step_us"],
                    "speedup": off["step_us"] / r["step_us"]}
    return None


def _targets(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The first measurements' targets (megakernel.measure.targets.TARGETS), judged on this run's
    default-variant decode steps and torch.compile baselines; none when simulated."""
    if d.get("simulated"):
        return []
    try:
        from megakernel.measure.targets import TARGETS, evaluate_targets

        bws = [d.get("read_bandwidth_GBps"), d.get("copy_bandwidth_GBps")]
        out = []
        for model in sorted({t.model for t in TARGETS}):
            runs = []
            for b in d["bench"]:
                if b.get("model") != model or b.get("variant") != "default" or "step_us" not in b:
                    continue
                comp = next((c for c in d["compile"] if c.get("case") == b.get("case")), {})
                runs.append({"batch": b["batch"], "weights": b.get("weights", "bf16"),
                             "kernel": {"ms": b["step_us"] / 1e3},
                             "bytes_per_step": b["bytes_per_step"], "torch_compile": comp})
            if runs:
                out += evaluate_targets({"model": model, "runs": runs, "device": d["device"],
                                         "achievable_GBps": max((x for x in bws if x),
                                                                default=None)})
        return out
    except Exception as e:  # the report must be written
        d["notes"].append(f"targets: {type(e).__name__}: {e}")
        return []


def _f(x: Any, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt) if isinstance(x, (int, float)) else str(x)


def markdown(d: dict[str, Any]) -> str:
    sim = (" (EMULATED: the builds' PTX on the CPU)" if d.get("emulated")
           else " (SIMULATED on the CPU executor)" if d.get("simulated") else "")
    lines = [f"# gpu-check on {d.get('device', '?')} ({d.get('arch', '?')}, {d.get('sms', 0)} "
             f"SMs){sim}", ""]
    for st in d["stages"]:
        lines += [f"## stage {st['number']}: {st['name']} ({st['doc']})", "",
                  "| case | variant | steps | ok | max err / band | KV err / band "
                  "| tok clear (near) | executor | s |", "|---|---|---|---|---|---|---|---|---|"]
        for c in (c for c in d["cases"] if c["stage"] == st["number"]):
            if "error" in c:
                lines.append(f"| {c['item']} | {c.get('variant')} | - | FAIL | "
                             f"{c['error'][:120]} | | | | {_f(c.get('seconds'))} |")
                continue
            ex = (f"{_f(c.get('executor_max_logit_diff'))} "
                  f"({'ok' if c.get('executor_ok') else 'NO'})" if "executor_ok" in c else "-")
            lines.append(
                f"| {c.get('case', c['item'])} | {c.get('variant')} ({c.get('gemv', '-')}, "
                f"{c.get('smem_stages', '-')} stages) | {c.get('steps', '-')} | "
                f"{'yes' if c.get('ok') else 'NO'} | {_f(c.get('max_err_kernel'))} / "
                f"{_f(c.get('max_allowed'))} | {_f(c.get('kv_max_err'))} / "
                f"{_f(c.get('kv_allowed'))} | {c.get('token_mismatches', '-')} "
                f"({c.get('near_tie_mismatches', '-')}) | {ex} | {c.get('seconds', '-')} |")
        lines.append("")
    m = d.get("measure") or {}
    if m:
        lines += ["## measured bandwidth and clocks", "",
                  f"- read (stream kernel): {_f(d.get('read_bandwidth_GBps'), '.0f')} GB/s "
                  f"{(m.get('read') or {}).get('error', '')}",
                  f"- copy: {_f(d.get('copy_bandwidth_GBps'), '.0f')} GB/s "
                  f"{(m.get('copy') or {}).get('error', '')}",
                  f"- clocks: {json.dumps(m.get('clocks'))}", ""]
    if d["bench"]:
        lines += ["## decode steps", "", "| case | variant | weights | us/step | tok/s | MB/step "
                  "| of achievable | cost model us | timed |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for b in d["bench"]:
            if "error" in b:
                lines.append(f"| {b['item']} | {b.get('variant')} | | FAIL: {b['error'][:120]} "
                             f"| | | | | |")
                continue
            frac = b.get("fraction_of_achievable")
            mb = b.get("bytes_per_step")
            lines.append(f"| {b.get('case', b['item'])} | {b.get('variant')} | "
                         f"{b.get('weights', 'bf16')} | "
                         f"{_f(b.get('step_us'), '.1f')} | {_f(b.get('tokens_per_s'), '.0f')} | "
                         f"{_f(mb / 1e6 if mb else None, '.1f')} | "
                         f"{'-' if frac is None else f'{100 * frac:.1f}%'} | "
                         f"{_f(b.get('predicted_us'), '.1f')} | {b.get('timed', '-')}"
                         f"{_bench_check(b)} |")
        lines.append("")
    ab = d.get("lookahead_ab")
    if ab:
        lines.append(f"- L2 lookahead A/B, {ab['case']}: {ab['with_us']:.1f} us with, "
                     f"{ab['without_us']:.1f} us without ({ab['speedup']:.3f}x)")
    for c in d["compile"]:
        lines.append(f"- torch.compile {c.get('item')}: {_f(c.get('ms'))} ms/step "
                     f"{c.get('error') or ''}")
    if d.get("timeline"):
        t = d["timeline"]
        lines.append(f"- timeline: {t.get('records_file') or t.get('error') or t.get('note')}")
    for t in d.get("targets", []):
        lines.append(f"- target {t.get('target')}: measured {_f(t.get('measured'))} "
                     f"({'met' if t.get('met') else 'not met' if t.get('met') is False else '-'}; "
                     f"{t.get('note', '')})")
    for s in d["skipped"]:
        lines.append(f"- skipped (stage {s['stage']}) {s['item']}: {s['why']}")
    for n in d["notes"]:
        lines.append(f"- note: {n}")
    if "ok" in d:
        lines += ["", f"**{'PASS' if d['ok'] else 'FAIL'}** in {d['seconds']} s; by stage "
                  f"{d['ok_by_stage']}, by variant {d['ok_by_variant']}"]
    return "\n".join(lines) + "\n"
