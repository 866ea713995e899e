"""The emulated coverage matrix: which device code the emulator's cases execute.

`python -m megakernel.gpu_check.coverage run [--out FILE] [--gpu-check]` emulates the matrix's
cases (tiny presets of every family, B = 1 and the multi-row build, ReplaySSM, FP8) on
line-info builds, with `--gpu-check` also the staged gpu-check (speculative, paged and
global-memory variants), and writes the report; `report RECORDS...` reports on records collected
elsewhere (a test run with the two variables set); megakernel.emulator.coverage collects and
folds the records.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megakernel.emulator.coverage import ENV_COVERAGE, Coverage


def matrix_cases():  # noqa: ANN201 (list[Case])
    """The emulated matrix's kinds of case, one step each where one step shows the path."""
    from megakernel.gpu_check.emulated import Case

    cases = [Case(m, steps=1) for m in ("llama-tiny", "qwen3-tiny", "qwen2-tiny",
                                        "qwen3.5-tiny", "nemotron-h-tiny", "kimi-linear-tiny",
                                        "qwen3.5-attn-tiny", "nemotron-h-attn-tiny")]
    cases += [Case("llama-tiny", batch=16, steps=1), Case("qwen3-tiny", batch=4, steps=1),
              Case("llama-tiny", steps=1, max_seq_len=1024)]
    cases += [Case(m, replay_window=16, steps=2) for m in ("qwen3.5-tiny", "nemotron-h-tiny",
                                                           "kimi-linear-tiny")]
    cases += [Case("llama-tiny", fp8="channel", steps=1),
              Case("llama-tiny", fp8="block", batch=4, steps=1),
              Case("qwen3.5-tiny", fp8="channel", steps=1)]
    return cases


def run(out: Path | None, gpu_check: bool) -> Coverage:
    """Emulate the matrix's cases (and, with `gpu_check`, the staged gpu-check) on line-info
    builds, collecting into a fresh records file; the folded coverage."""
    import subprocess
    import tempfile

    from megakernel.gpu_check.emulated import run_case
    from megakernel.kernel.toolchain.fingerprint import ENV_LINE_INFO

    os.environ[ENV_LINE_INFO] = "1"
    work = Path(tempfile.mkdtemp(prefix="mk-coverage-"))
    records = work / "records.jsonl"
    os.environ[ENV_COVERAGE] = str(records)
    for c in matrix_cases():
        r = run_case(c)
        print(f"{c.label}: {'ok' if r.ok else 'FAILED'}", flush=True)
    if gpu_check:
        builds = work / "builds"
        for argv in (["--prepare", "--stages", "0,1", "--arch", "sm_90a", "--build-dir",
                      str(builds)],
                     ["--emulate", "--stages", "0,1", "--build-dir", str(builds), "--out",
                      str(work / "gpu-check")]):
            p = subprocess.run([sys.executable, "-m", "megakernel", "gpu-check", *argv])
            print(f"gpu-check {argv[0]}: rc {p.returncode}", flush=True)
    cov = Coverage()
    cov.add_records(records)
    if out is not None:
        out.write_text(cov.report())
    return cov


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m megakernel.gpu_check.coverage",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="emulate the matrix's cases on line-info builds; report")
    r.add_argument("--out", type=Path, help="write the Markdown report here (else stdout)")
    r.add_argument("--gpu-check", action="store_true",
                   help="also prepare and emulate gpu-check stages 0-1 (every variant; hours)")
    q = sub.add_parser("report", help="report on collected records ($MEGAKERNEL_COVERAGE files)")
    q.add_argument("records", type=Path, nargs="+")
    q.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "run":
        cov = run(a.out, a.gpu_check)
    else:
        cov = Coverage()
        for f in a.records:
            cov.add_records(f)
        if a.out:
            a.out.write_text(cov.report())
    if not a.out:
        print(cov.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
