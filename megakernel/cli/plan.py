"""`python -m megakernel plan`: compile a decode-step program and print what the cost model says.

Prints instructions per opcode, bytes moved per step, the predicted step time, the floor (bytes /
copy bandwidth, and bytes / HBM spec), the predicted efficiency (floor / predicted), the worst
SM's idle fraction, and the assumptions. `--json` adds one JSON object as the last line.

`--refit gpu_check.json` fits cost parameters to a GPU run's measured step times
(program/refit.py) and prints them with the predicted/measured table before and after;
`--save-params OUT.json` keeps them and `--params OUT.json` plans with them.

`--speculative ngram:3 --acceptance A` plans the speculative step (1 + k tokens per sequence,
accepting on the device) next to the plain one: both predicted step times, their ratio, the
expected tokens per step and the tokens/s per user of each (`speculative_summary`). A is the
per-draft acceptance rate: the probability that a draft is accepted given that every draft
before it was, the same for each position, so a step emits 1 + A + A^2 + ... + A^k tokens on
average. draft:MODEL:K adds K steps of the draft model's plain program to each step.

`--timeline OUT.png` draws the predicted per-SM timeline of the step
(megakernel/measure/timeline.py), beside the measured one of `--timeline-records FILE` (the timeline
build's records, .npz or .json). `--refit FILE` with such a records file fits the per-instruction
fixed cost and latency (`--fit`) to its busy intervals and finish times
(measure.timeline_fit.fit_timeline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from megakernel.cli.main import add_weight_arguments, weight_options
from megakernel.common.progress import stage
from megakernel.program import cost
from megakernel.program.gpus import GPUS, SOURCES, from_device, gpu

DEFAULT_ACCEPTANCE = 0.7  # --acceptance when not given (an assumption, printed as one)


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
    p.add_argument("--speculative", default=None, metavar="METHOD",
                   help="plan the speculative step of ngram:K, mtp:K or draft:MODEL:K (1 + K "
                        "tokens per sequence) against the plain one")
    p.add_argument("--acceptance", type=float, default=None, metavar="A",
                   help="with --speculative: the per-draft acceptance rate in [0, 1], the "
                        "probability a draft is accepted given the drafts before it were; a step "
                        f"emits 1 + A + ... + A^K tokens (default {DEFAULT_ACCEPTANCE})")
    p.add_argument("--isa", action="store_true", help="also print the instruction set table")
    p.add_argument("--chain", action="store_true",
                   help="also print the step's critical path: its phases per opcode, the time "
                        "each runs and the handoffs between them (program/chain.py)")
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
                        "megakernel/measure/timeline.py) to draw beside the prediction")
    add_weight_arguments(p)


def plan(model: str, gpu_name: str = "h200", batch: int = 1, tokens: int = 1,
         context: int | None = None, max_seq_len: int | None = None, splits: int | None = None,
         policy: str = "cost", copy_bw_gbs: float | None = None,
         params: cost.CostParams | None = None, replay_window: int | None = None,
         programs: list | None = None, quiet: bool = True,
         weights: dict[str, Any] | None = None, drafts: int = 0,
         ngram: int = 0) -> dict[str, Any]:
    """Compile, verify and summarise one program of any family (the JSON-ready result of
    `plan`). `params`: cost parameters (e.g. refitted ones, refit.load_params); default the cited
    ones. `replay_window`: ReplaySSM fold window of the recurrent layers (None: recurrent).
    `programs`: a list that receives the compiled program. `quiet=False` prints progress
    (megakernel.common.progress) on stderr. `drafts` k: the speculative step of 1 + k tokens
    (`ngram`: with the device n-gram drafter)."""
    from megakernel import isa
    from megakernel.models import resolve
    from megakernel.program.bytes import step_bytes_by_category
    from megakernel.program.compiler import compile_program
    from megakernel.program.verify import check_program

    cfg = resolve(model, **(weights or {}))  # weights: cli.weight_options (--weights fp8 ...)
    if drafts:
        tokens = 1 + drafts
    if context is not None:  # named by the flags, before the compiler's own check
        from megakernel.cli.main import CliError
        from megakernel.program.compiler import default_max_seq_len

        s_max = max_seq_len or default_max_seq_len(cfg)
        if context + tokens > s_max:
            given = (f"--max-seq-len {s_max}" if max_seq_len else
                     f"the default --max-seq-len of {s_max} (min(max_position_embeddings, 4096))")
            what = f"{tokens} tokens a speculative step" if drafts else f"--tokens {tokens}"
            raise CliError(f"--context {context} + {what} do not fit {given}; lower "
                           f"--context or raise --max-seq-len")
    g = from_device() if gpu_name == "device" else gpu(gpu_name)
    if copy_bw_gbs is not None:
        g = g.with_copy_bandwidth(copy_bw_gbs * 1e9)
    t0 = time.perf_counter()
    with stage(f"compiling the {model} program", quiet):
        prog = compile_program(cfg, batch, g, tokens=tokens, max_seq_len=max_seq_len,
                               context=context, n_splits=splits, policy=policy, params=params,
                               replay_window=replay_window, drafts=drafts, ngram=ngram)
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
        "drafts": drafts, "ngram": ngram,
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
        # a step emits T tokens per sequence (a plain step; a speculative one: see "speculative")
        "tokens_per_s_per_user": round(tokens / r.predicted_s, 1),
        "tokens_per_s_per_gpu": round(batch * tokens / r.predicted_s, 1),
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
        f"predicted throughput: {r['tokens_per_s_per_user']:.0f} tokens/s per user, "
        f"{r['tokens_per_s_per_gpu']:.0f} tokens/s per GPU ({r['batch']} x {r['tokens']} "
        "tokens a step)",
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


# ---- speculative decoding ------------------------------------------------------------------------
def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a speculative step of k drafts emits per sequence on average when each draft is
    accepted with probability `acceptance` given that the drafts before it were (the bonus token
    always): 1 + A + A^2 + ... + A^k."""
    return sum(acceptance ** i for i in range(k + 1))


def check_acceptance(acceptance: float) -> None:
    from megakernel.cli.main import CliError

    if not (math.isfinite(acceptance) and 0.0 <= acceptance <= 1.0):
        raise CliError(f"--acceptance is the per-draft acceptance rate, a probability in [0, 1], "
                       f"got {acceptance}")


def speculative_summary(method: str, k: int, acceptance: float, plain_s: float, step_s: float,
                        draft_s: float = 0.0, model: str | None = None) -> dict[str, Any]:
    """The `plan --speculative` numbers: a speculative step (the 1 + k step `step_s`, plus k
    draft-model steps of `draft_s` each for draft:MODEL:K) against the plain T = 1 step
    `plain_s`, at per-draft acceptance `acceptance` (expected_tokens)."""
    total = step_s + k * draft_s
    tokens = expected_tokens(k, acceptance)
    out = {"method": method, "k": k, "acceptance": acceptance,
           "plain_step_us": round(plain_s * 1e6, 2), "spec_step_us": round(step_s * 1e6, 2),
           "step_ratio": round(step_s / plain_s, 4),
           "tokens_per_step": round(tokens, 4),
           "accepted_per_step": round(tokens - 1, 4),
           "tokens_per_s_per_user": round(tokens / total, 2),
           "plain_tokens_per_s_per_user": round(1 / plain_s, 2),
           "speedup": round(tokens * plain_s / total, 4)}
    if model is not None:
        out.update(draft_model=model, draft_step_us=round(draft_s * 1e6, 2),
                   total_step_us=round(total * 1e6, 2))
    return out


def describe_speculative(s: dict[str, Any]) -> list[str]:
    what = f"{s['method']}:{s['k']}" if "draft_model" not in s else \
        f"draft:{s['draft_model']}:{s['k']}"
    lines = [f"speculative {what}: the 1 + {s['k']} step {s['spec_step_us']:.1f} us against the "
             f"plain step {s['plain_step_us']:.1f} us ({s['step_ratio']:.3f}x)"]
    if "draft_model" in s:
        lines.append(f"  draft model {s['draft_model']}: {s['k']} plain steps of "
                     f"{s['draft_step_us']:.1f} us before each verify; {s['total_step_us']:.1f} "
                     "us a speculative step in all")
    elif s["method"] == "mtp":
        lines.append("  the MTP drafter's own passes (one decoder layer and the LM head per "
                     "draft) are not counted")
    assumed = " (assumed: --acceptance A)" if s.get("acceptance_assumed") else ""
    lines.append(f"  at per-draft acceptance {s['acceptance']:g}{assumed}: "
                 f"{s['tokens_per_step']:.3f} "
                 f"tokens per step and sequence (1 + A + ... + A^{s['k']}), "
                 f"{s['tokens_per_s_per_user']:.0f} tokens/s per user against "
                 f"{s['plain_tokens_per_s_per_user']:.0f} plain ({s['speedup']:.2f}x)")
    return lines


def plan_speculative(args: argparse.Namespace, params, programs: list) -> dict[str, Any]:  # noqa: ANN001
    """`plan --speculative`: the speculative program's plan (the printed one) with a
    "speculative" object comparing it to the plain program (and the draft model's steps)."""
    from megakernel.cli.main import CliError
    from megakernel.models import resolve
    from megakernel.serve.backends import check_speculative
    from megakernel.serve.speculative import parse

    sp = parse(args.speculative)
    if sp is None:
        raise CliError("--speculative needs a method: ngram:K, mtp:K or draft:MODEL:K")
    if args.tokens != 1:
        raise CliError(f"--speculative plans a step of 1 + {sp.k} tokens; leave --tokens out")
    acceptance = DEFAULT_ACCEPTANCE if args.acceptance is None else args.acceptance
    check_acceptance(acceptance)
    wopts = weight_options(args)
    check_speculative(sp, resolve(args.model, **wopts), args.replay_window, "--replay-window L")
    common = dict(context=args.context, max_seq_len=args.max_seq_len, splits=args.splits,
                  policy=args.policy, copy_bw_gbs=args.copy_bw, params=params,
                  replay_window=args.replay_window, quiet=args.json, weights=wopts)
    r = plan(args.model, args.gpu, args.batch, programs=programs, drafts=sp.k, ngram=sp.ngram,
             **common)
    plain = plan(args.model, args.gpu, args.batch, 1, **common)
    draft_s = 0.0
    if sp.method == "draft":
        from megakernel.serve.drafters import check_draft_model

        dcfg = resolve(sp.model)
        check_draft_model(resolve(args.model, **wopts), dcfg, sp.model)
        draft = plan(sp.model, args.gpu, args.batch, 1, **{**common, "replay_window": None,
                                                           "weights": None})
        draft_s = draft["predicted_step_us"] * 1e-6
    r["speculative"] = speculative_summary(sp.method, sp.k, acceptance,
                                           plain["predicted_step_us"] * 1e-6,
                                           r["predicted_step_us"] * 1e-6, draft_s, sp.model)
    r["speculative"]["acceptance_assumed"] = args.acceptance is None
    return r


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
    from megakernel.measure import timeline
    from megakernel.measure.timeline_fit import describe_timeline, fit_timeline
    from megakernel.program import refit

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
    from megakernel.cli.main import CliError, check_writable

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
    if args.speculative:
        r = plan_speculative(args, params, programs)
    else:
        if args.acceptance is not None:
            from megakernel.cli.main import CliError

            raise CliError("--acceptance needs --speculative METHOD")
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
    if "speculative" in r:
        print("\n".join(describe_speculative(r["speculative"])))
    if args.chain:
        from megakernel.program.chain import critical_chain, table_markdown

        print("\ncritical path (the replay's trace, program/chain.py):")
        print(table_markdown(critical_chain(programs[0], params)))
    if args.timeline:
        print(draw_timeline(programs[0], params, args.timeline, args.timeline_records))
    if args.json:
        print(json.dumps(r))
    return 0


def draw_timeline(prog, params, out: str, records: str | None) -> str:  # noqa: ANN001
    """Write the predicted (and measured) timeline PNG; returns the legend to print."""
    from megakernel.measure import timeline
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
