"""`python -m megakernel plan`: compile a decode-step program and print what the cost model says.

Prints instructions per opcode, bytes moved per step, the predicted step time, the floor (bytes /
copy bandwidth, and bytes / HBM spec), the predicted efficiency (floor / predicted), the worst
SM's idle fraction, and the assumptions. `--json` adds one JSON object as the last line.

`--refit gpu_check.json` fits cost parameters to a GPU run's measured step times
(program/refit.py) and prints them with the predicted/measured table before and after;
`--save-params OUT.json` keeps them and `--params OUT.json` plans with them.

`--timeline OUT.png` draws the predicted per-SM timeline of the step (megakernel/timeline.py),
beside the measured one of `--timeline-records FILE` (the timeline build's records, .npz or
.json). `--refit FILE` with such a records file fits the per-instruction fixed cost and latency
(`--fit`) to its busy intervals and finish times (refit_timeline.fit_timeline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from megakernel.cli import add_weight_arguments, weight_options
from megakernel.program import cost
from megakernel.program.gpus import GPUS, SOURCES, from_device, gpu
from megakernel.progress import stage


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="preset name or Hugging Face checkpoint dir (required unless --refit)")
    p.add_argument("--gpu", default="h200",
                   help=f"{', '.join(GPUS)}, or 'device' for the live CUDA device (default h200)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step B (default 1)")
    p.add_argument("--tokens", type=int, default=1, help="tokens per sequence per step T")
    p.add_argument("--context", type=int, default=None,
                   help="cached tokens per sequence assumed by the cost model (default 1024)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache positions per sequence (default min(4096, model max))")
    p.add_argument("--splits", type=int, default=None, help="attention splits (default: auto)")
    p.add_argument("--replay-window", type=int, default=None, metavar="L",
                   help="models with recurrent layers: ReplaySSM folding every L tokens "
                        "(0 = the recurrent update, the default)")
    p.add_argument("--policy", default="cost", choices=("cost", "round_robin"),
                   help="SM assignment (default cost)")
    p.add_argument("--copy-bw", type=float, default=None,
                   help="measured copy bandwidth in GB/s (replaces the cited read bandwidth)")
    p.add_argument("--measured-step-us", type=float, default=None,
                   help="a measured step time to report against the prediction")
    p.add_argument("--isa", action="store_true", help="also print the instruction set table")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--refit", default=None, metavar="FILE.json",
                   help="fit cost parameters to measured step times: a gpu-check report "
                        "(gpu_check.json) or a list of measurements (program/measurements.py)")
    p.add_argument("--fit", default="mem_latency,fixed_per_instr",
                   help="comma list of parameters --refit fits (default mem_latency,"
                        "fixed_per_instr; also launch, l2_latency)")
    p.add_argument("--save-params", default=None, metavar="OUT.json",
                   help="with --refit: write the fitted parameters here (for --params)")
    p.add_argument("--params", default=None, metavar="FILE.json",
                   help="plan with cost parameters saved by --refit --save-params")
    p.add_argument("--timeline", default=None, metavar="OUT.png",
                   help="draw the predicted per-SM timeline of the step (and the measured one "
                        "of --timeline-records) as a PNG")
    p.add_argument("--timeline-records", default=None, metavar="FILE",
                   help="records of the kernel's timeline build (.npz or .json, "
                        "megakernel/timeline.py) to draw beside the prediction")
    add_weight_arguments(p)


def plan(model: str, gpu_name: str = "h200", batch: int = 1, tokens: int = 1,
         context: int | None = None, max_seq_len: int | None = None, splits: int | None = None,
         policy: str = "cost", copy_bw_gbs: float | None = None,
         params: cost.CostParams | None = None, replay_window: int | None = None,
         programs: list | None = None, quiet: bool = True,
         weights: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compile, verify and summarise one program of any family (the JSON-ready result of
    `plan`). `params`: cost parameters (e.g. refitted ones, refit.load_params); default the cited
    ones. `replay_window`: ReplaySSM fold window of the recurrent layers (None: recurrent).
    `programs`: a list that receives the compiled program. `quiet=False` prints progress
    (megakernel.progress) on stderr."""
    from megakernel import isa
    from megakernel.models import resolve
    from megakernel.program.bytes import step_bytes_by_category
    from megakernel.program.compiler import compile_program
    from megakernel.program.verify import check_program

    cfg = resolve(model, **(weights or {}))  # weights: cli.weight_options (--weights fp8 ...)
    if context is not None:  # named by the flags, before the compiler's own check
        from megakernel.cli import CliError
        from megakernel.program.compiler import default_max_seq_len

        s_max = max_seq_len or default_max_seq_len(cfg)
        if context + tokens > s_max:
            given = (f"--max-seq-len {s_max}" if max_seq_len else
                     f"the default --max-seq-len of {s_max} (min(max_position_embeddings, 4096))")
            raise CliError(f"--context {context} + --tokens {tokens} do not fit {given}; lower "
                           f"--context or raise --max-seq-len")
    g = from_device() if gpu_name == "device" else gpu(gpu_name)
    if copy_bw_gbs is not None:
        g = g.with_copy_bandwidth(copy_bw_gbs * 1e9)
    t0 = time.perf_counter()
    with stage(f"compiling the {model} program", quiet):
        prog = compile_program(cfg, batch, g, tokens=tokens, max_seq_len=max_seq_len,
                               context=context, n_splits=splits, policy=policy, params=params,
                               replay_window=replay_window)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with stage(f"verifying {len(prog.instrs)} instructions", quiet):
        check_program(prog)
    verify_s = time.perf_counter() - t0
    if programs is not None:
        programs.append(prog)
    r = prog.cost
    rates = cost.Rates.of(g, params or cost.CostParams(), prog.ring_bytes)  # what the replay used
    cats = step_bytes_by_category(prog)
    weights = sum(i.w_bytes for i in prog.instrs if not isa.spec(i.op).reach)
    return {
        "model": model, "family": cfg.family, "gpu": g.name, "batch": batch, "tokens": tokens,
        "weights": "bf16" if cfg.quant is None else cfg.quant.describe(),
        "replay_window": replay_window or 0,
        "context": prog.context, "max_seq_len": prog.max_seq_len, "n_splits": prog.n_splits,
        "policy": policy, "num_sms": prog.num_sms,
        "instructions": len(prog.instrs), "ops": prog.ops_histogram(),
        "max_queue": max(len(q) for q in prog.queues), "counters": len(prog.counters),
        "bytes_per_step": r.bytes_per_step, "weight_bytes": weights,
        "kv_read_bytes": int(cats["kv_read"]), "kv_write_bytes": int(cats["kv_written"]),
        "bytes_by_category": {k: int(v) for k, v in cats.items()},
        "predicted_step_us": round(r.predicted_s * 1e6, 2),
        "floor_us": round(r.floor_s * 1e6, 2),
        "spec_floor_us": round(r.spec_floor_s * 1e6, 2),
        "predicted_efficiency": round(r.efficiency, 4),
        "predicted_spec_efficiency": round(r.spec_efficiency, 4),
        "copy_bw_gbs": round(g.copy_bw / 1e9, 1), "copy_bw_measured": g.copy_bw_measured,
        "hbm_bw_gbs": round(g.hbm_bw / 1e9, 1),
        "worst_sm_idle": round(r.worst_idle, 4), "mean_sm_idle": round(r.mean_idle, 4),
        "plan_s": round(plan_s, 3), "verify_s": round(verify_s, 3),
        "format_version": prog.header["FORMAT_VERSION"],
        "cost_params": dataclasses.asdict(params or cost.CostParams()),
        "l2_prefetch_window_bytes": rates.window,
        "smem_window_bytes": int(rates.smem_window),
        "sliding_lookahead": rates.sliding,
    }


def describe(r: dict[str, Any]) -> list[str]:
    gb = 1e9
    lines = [
        f"{r['model']} on {r['gpu']} ({r['num_sms']} SMs): batch {r['batch']} x {r['tokens']} "
        f"token(s), {r['context']} cached tokens per sequence assumed, cache of "
        f"{r['max_seq_len']} positions, {r['n_splits']} attention split(s)"
        + (f", ReplaySSM fold window {r['replay_window']}" if r["replay_window"] else "")
        + f"; weights {r['weights']}",
        f"program: {r['instructions']} instructions ({r['policy']} schedule), longest queue "
        f"{r['max_queue']}, {r['counters']} counters; compiled in {r['plan_s']:.2f} s, verified "
        f"in {r['verify_s']:.2f} s",
        "instructions per opcode: " + ", ".join(f"{k} {v}" for k, v in r["ops"].items()),
        "bytes by kind: " + ", ".join(f"{k} {v / gb:.4f} GB" for k, v in
                                      r["bytes_by_category"].items() if v and k not in
                                      ("read", "written", "total")),
        f"bytes per step: {r['bytes_per_step'] / gb:.3f} GB (weights {r['weight_bytes'] / gb:.3f}"
        f", KV read {r['kv_read_bytes'] / gb:.4f}, KV written {r['kv_write_bytes'] / gb:.5f})",
        f"predicted step: {r['predicted_step_us']:.1f} us",
        f"floor: {r['floor_us']:.1f} us at {r['copy_bw_gbs']:.0f} GB/s"
        + (" (the measured copy bandwidth); " if r["copy_bw_measured"]
           else " (the cited achievable read bandwidth); ") +
        f"{r['spec_floor_us']:.1f} us at the spec {r['hbm_bw_gbs']:.0f} GB/s",
        f"predicted efficiency: {100 * r['predicted_efficiency']:.1f}% of that floor "
        f"({100 * r['predicted_spec_efficiency']:.1f}% of the spec floor)",
        f"worst SM idle fraction: {100 * r['worst_sm_idle']:.1f}% (mean "
        f"{100 * r['mean_sm_idle']:.1f}%)",
    ]
    if r.get("measured_step_us"):
        lines.append(f"measured step: {r['measured_step_us']:.1f} us -> predicted/measured = "
                     f"{r['predicted_step_us'] / r['measured_step_us']:.3f}")
    p = r["cost_params"]
    lines.append(
        f"assumptions: {p['mem_latency'] * 1e9:.0f} ns per load/store on a dependency edge, "
        f"{p['fixed_per_instr'] * 1e6:.2f} us fixed per instruction, launch "
        f"{p['launch'] * 1e6:.1f} us ({cost.CITATIONS['mem_latency']}); "
        f"L2 lookahead prefetch of {r['l2_prefetch_window_bytes'] // 1024} KiB per SM (the "
        f"kernel's window), prefetched bytes read from L2 after {p['l2_latency'] * 1e9:.0f} ns "
        f"({cost.CITATIONS['l2_latency']}); " + (
            f"a loader warp stages the next {r['smem_window_bytes'] // 1024} KiB of weights in "
            f"shared memory ({cost.CITATIONS['smem_window']}) and slides the lookahead ahead of "
            f"its own tiles" if r["sliding_lookahead"] else
            "no loader warp: the lookahead starts at each reached slab"
            + (f" (ring assumed {r['smem_window_bytes'] // 1024} KiB)"
               if r["smem_window_bytes"] else "")) + f"; {SOURCES['COPY']}; {SOURCES['L2']}")
    if r.get("cost_params_file"):
        lines.append(f"cost parameters refitted to measurements: {r['cost_params_file']} "
                     "(replaces the cited values above where they differ)")
    return lines


def is_timeline_file(path: str) -> bool:
    """A timeline build's records (timeline.save_records / run_timeline), not step times."""
    if path.endswith(".npz"):
        return True
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "records" in data and "fields" in data


def timeline_program(args: argparse.Namespace, data: dict, params) -> Any:  # noqa: ANN001, ANN401
    """The program a timeline records file was measured on: its model and batch (or the
    command line's), compiled for --gpu as `plan` does."""
    from megakernel.program.refit import RefitError

    model = args.model or data.get("model")
    if model is None:
        raise RefitError("the timeline records name no model: pass --model")
    programs: list = []
    plan(model, args.gpu, int(data.get("batch", args.batch)), int(data.get("tokens", args.tokens)),
         args.context, args.max_seq_len, args.splits, args.policy, args.copy_bw, params,
         args.replay_window, programs)
    return programs[0]


def run_refit_timeline(args: argparse.Namespace) -> int:
    """`plan --refit RECORDS`: fit per-instruction costs to a timeline build's records."""
    from megakernel import timeline
    from megakernel.program import refit
    from megakernel.program.refit_timeline import describe_timeline, fit_timeline

    start = refit.load_params(args.params) if args.params else None
    fit = tuple(f.strip() for f in args.fit.split(",") if f.strip())
    data = timeline.load_records(args.refit)
    prog = timeline_program(args, data, start)
    result = fit_timeline(prog, timeline.decode(data["records"]), fit, start=start)
    print("\n".join(describe_timeline(result)))
    if args.save_params:
        Path(args.save_params).write_text(json.dumps(
            {"cost_params": dataclasses.asdict(result.params)}, indent=2) + "\n")
        print(f"fitted parameters written to {args.save_params} (plan with --params)")
    return 0


def run_refit(args: argparse.Namespace) -> int:
    """`plan --refit FILE`: fit, print the fitted parameters and the before/after table."""
    from megakernel.program import refit
    from megakernel.program.measurements import load_measurements

    if is_timeline_file(args.refit):
        return run_refit_timeline(args)
    start = refit.load_params(args.params) if args.params else None
    fit = tuple(f.strip() for f in args.fit.split(",") if f.strip())
    result = refit.refit(load_measurements(args.refit), fit, start=start)
    print("\n".join(refit.describe(result)))
    if args.save_params:
        refit.save_params(result, args.save_params)
        print(f"fitted parameters written to {args.save_params} (plan with --params)")
    if args.json:
        print(json.dumps(result.to_json()))
    return 0


def check_flags(args: argparse.Namespace) -> None:
    """CliError naming the flag the user passed, before anything is compiled."""
    from megakernel.cli import CliError, check_writable

    least_of = {"--batch": (args.batch, 1), "--tokens": (args.tokens, 1),
                "--context": (args.context, 0), "--max-seq-len": (args.max_seq_len, 1),
                "--splits": (args.splits, 1), "--replay-window": (args.replay_window, 0)}
    for flag, (v, least) in least_of.items():
        if v is not None and v < least:
            raise CliError(f"{flag} must be >= {least}, got {v}")
    for flag, x in (("--copy-bw", args.copy_bw), ("--measured-step-us", args.measured_step_us)):
        if x is not None and not (math.isfinite(x) and x > 0):
            unit = "GB/s" if flag == "--copy-bw" else "us"
            raise CliError(f"{flag} must be a positive number of {unit}, got {x}")
    for flag, out in (("--timeline", args.timeline), ("--save-params", args.save_params)):
        if out:
            check_writable(out, flag)


def run(args: argparse.Namespace) -> int:
    from megakernel.program.refit import RefitError, load_params

    check_flags(args)
    args.replay_window = args.replay_window or None  # 0 = the recurrent update, as in generate
    if args.save_params and not args.refit:
        raise RefitError("--save-params needs --refit FILE.json")
    if args.refit:
        return run_refit(args)
    if args.model is None:
        raise RefitError("plan needs --model (or --refit FILE.json)")
    params = load_params(args.params) if args.params else None
    if args.timeline_records and not args.timeline:
        raise RefitError("--timeline-records needs --timeline OUT.png (or --refit RECORDS)")
    programs: list = []
    r = plan(args.model, args.gpu, args.batch, args.tokens, args.context, args.max_seq_len,
             args.splits, args.policy, args.copy_bw, params, args.replay_window, programs,
             quiet=args.json, weights=weight_options(args))
    if args.params:
        r["cost_params_file"] = args.params
    if args.measured_step_us is not None:
        r["measured_step_us"] = args.measured_step_us
    if args.isa:
        from megakernel.isa import table_markdown

        print(table_markdown())
        print()
    print("\n".join(describe(r)))
    if args.timeline:
        print(draw_timeline(programs[0], params, args.timeline, args.timeline_records))
    if args.json:
        print(json.dumps(r))
    return 0


def draw_timeline(prog, params, out: str, records: str | None) -> str:  # noqa: ANN001
    """Write the predicted (and measured) timeline PNG; returns the legend to print."""
    from megakernel import timeline
    from megakernel.program.refit import RefitError

    meas = None
    if records:
        meas = timeline.decode(timeline.load_records(records)["records"])
        try:
            timeline.check_matches(meas, prog)
        except ValueError as e:
            raise RefitError(str(e)) from None
    legend = timeline.write_png(out, timeline.predicted(prog, params), meas, prog.num_sms)
    return f"{legend}\nwritten to {out}"
