"""`python -m megakernel gpu-check`: the one script to run on a lent GPU machine (rung 4).

The GPU machine has torch + cuda-python but not the DSL, so the cubins are built beforehand on a
machine with the DSL and carried over:

    python -m megakernel gpu-check --prepare --build-dir out/gpu-builds --arch sm_90a,sm_100a  # CPU
    python -m megakernel gpu-check --build-dir out/gpu-builds --out OUT                       # GPU
    python -m megakernel gpu-check --simulate --out OUT        # CPU: the whole run, executor-served
    python -m megakernel gpu-check --emulate --build-dir out/gpu-builds --out OUT  # CPU: the
                                     # prepared sm_90a builds' PTX on the emulator, every variant

The run goes in stages (cases.py): 0 does the kernel launch, finish and agree at all; 1 the
shapes; 2 the real presets and the benchmark. Each case is judged against the torch reference in
bf16 and fp32 by bounds that come from the reference's own error (compare.py); cases run in child
processes that the parent bounds and replaces after a crash (driver.py); the report is rewritten
after every item (report.py). `--simulate` runs the same on the CPU, the launches served by the
CPU executor through the op's CPU implementation: the report says so and holds no measurement.
`--emulate` runs the staged check on the CPU with each variant's own sm_90a build (prepared, or
missing and skipped) executed by the PTX emulator: every tiny and mid case, the real comparisons
and verdicts, the report; the real presets (too large to emulate) and the benchmark are skipped
with the reason.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from megakernel.gpu_check.cases import STAGES, Case, variant_dir
from megakernel.gpu_check.compare import MIN_PREFIX, common_prefix, greedy_check, top2_margin
from megakernel.gpu_check.driver import BUDGET_S, EMULATE_BUDGET_S, SIMULATE_BUDGET_S
from megakernel.gpu_check.prepare import prepare
from megakernel.gpu_check.report import markdown, measurements
from megakernel.kernel.host.variants import VARIANTS, variants

__all__ = ["STAGES", "VARIANTS", "Case", "MIN_PREFIX", "common_prefix", "greedy_check",
           "top2_margin", "variant_dir", "variants", "prepare", "gpu_check", "add_arguments",
           "run", "markdown", "measurements"]


def gpu_check(out: Path, build_dir: Path, stages: list[int] | None = None,
              simulate: bool = False, budget_s: float | None = None,
              emulate: bool = False) -> dict[str, Any]:
    """Run the stages (default: all) and return the report (`emulate`: on the PTX emulator)."""
    from megakernel.gpu_check import driver

    simulate = simulate or emulate
    if budget_s is None:
        budget_s = (EMULATE_BUDGET_S if emulate else SIMULATE_BUDGET_S if simulate
                    else BUDGET_S)
    arch = None
    if emulate:
        from megakernel.launch.emulated import EMULATED_ARCH

        arch = EMULATED_ARCH
    elif not simulate:
        import torch

        from megakernel.launch.runtime import KernelUnavailable, device_info

        if not torch.cuda.is_available():  # checked in the parent: no context is created
            raise KernelUnavailable("gpu-check needs a CUDA GPU and none is available here; "
                                    "--simulate runs it on the CPU executor")
        arch = device_info().arch
    stages = [s.number for s in STAGES] if stages is None else stages
    return driver.run(Path(out), Path(build_dir), stages, simulate, budget_s, arch,
                      emulate=emulate)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out/gpu-check",
                   help="directory for the report (gpu_check.json/.md/.log, timeline.json)")
    p.add_argument("--build-dir", default="out/gpu-builds",
                   help="prebuilt cubins (made by --prepare on a machine with the DSL)")
    p.add_argument("--prepare", action="store_true",
                   help="build the cubins every stage needs into --build-dir (needs the DSL)")
    p.add_argument("--arch", default="sm_90a", help="archs for --prepare (comma list)")
    p.add_argument("--stages", default=None,
                   help="comma list of stages to run, or with --prepare to build for "
                        "(default: 0,1,2; --quick: 0,1)")
    p.add_argument("--quick", action="store_true", help="stages 0 and 1 only")
    p.add_argument("--simulate", action="store_true",
                   help="run on the CPU: the CPU executor serves every launch (no GPU, no build)")
    p.add_argument("--emulate", action="store_true",
                   help="run on the CPU: each variant's prepared sm_90a build on the PTX "
                        "emulator (no GPU; real presets and the benchmark skipped)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"the whole run's time limit in seconds (default {BUDGET_S:.0f}; "
                        f"{SIMULATE_BUDGET_S:.0f} simulated, {EMULATE_BUDGET_S:.0f} emulated)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # driver.child's job file


def _stages(args: argparse.Namespace) -> list[int]:
    known = {s.number for s in STAGES}
    if args.stages is None:
        return sorted(known - {2}) if args.quick else sorted(known)
    try:
        got = [int(x) for x in args.stages.split(",") if x.strip()]
    except ValueError:
        got = []
    if not got or set(got) - known:
        raise SystemExit(f"error: --stages takes a comma list of {sorted(known)}, got "
                         f"{args.stages!r}")
    return got


def run(args: argparse.Namespace) -> int:
    import time

    if args.child:
        from megakernel.gpu_check.driver import child

        return child(Path(args.child))
    if args.prepare:
        archs = [a.strip() for a in args.arch.split(",") if a.strip()]
        t0 = time.perf_counter()
        ms, failed = prepare(args.build_dir, archs,
                             stages=None if args.stages is None and not args.quick
                             else _stages(args))
        print(f"prepared {len(ms)} builds in {args.build_dir} in {time.perf_counter() - t0:.0f} s"
              f"; {len(failed)} not built")
        for f in failed:
            print(f"  not built: {f}")
        # the default variant must build everywhere; the others may not serve every case
        return 1 if any(f.startswith("default ") for f in failed) else 0
    if args.budget_s is not None and not args.budget_s > 0:
        raise SystemExit(f"error: --budget-s must be positive, got {args.budget_s}")
    if args.simulate and args.emulate:
        raise SystemExit("error: --simulate and --emulate are two ways to run on the CPU; pick one")
    r = gpu_check(Path(args.out), Path(args.build_dir), _stages(args), args.simulate,
                  args.budget_s, emulate=args.emulate)
    status = "PASS" if r["ok"] else "FAIL"
    sim = " (emulated)" if r.get("emulated") else " (simulated)" if r["simulated"] else ""
    print(f"gpu-check{sim} {status}: {sum(bool(c.get('ok')) for c in r['cases'])}/"
          f"{len(r['cases'])} cases ok in {r['seconds']} s, by stage {r['ok_by_stage']}; "
          f"{len(r['skipped'])} skipped; details in {args.out}/gpu_check.md")
    if r["simulated"] and not r["complete"]:  # on the CPU nothing may be left out for time
        print(f"gpu-check{sim} INCOMPLETE: items were skipped for time")
        return 1
    return 0 if r["ok"] else 1
