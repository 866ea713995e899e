"""Decode-step benchmark on a GPU: the megakernel vs torch baselines, against the measured
achievable bandwidth, and the targets of the first measurements judged in the same run.

    python bench/decode.py --model llama-3.2-1b --batches 1 --context 1024 \
        [--build-dir out/gpu-builds] [--out out/bench]
    python bench/decode.py --model nemotron-h-8b --batches 1,8,64 --replay-windows 0,16

Hybrid models: the recurrent update against ReplaySSM (one row per fold window L) per batch.

Measured in one run (CUDA events; random bf16 weights): - read: the HBM read-stream kernel on every
SM (megakernel.measure.bandwidth.read_bandwidth; its build in
  measure.stream_build_dir(--build-dir)); copy: device-to-device copy (bytes read + written);
  the yardstick is the larger of the two ("achievable");
- kernel: `decode_step` captured in a CUDA graph, replayed (the program feeds its own tokens back);
- torch eager: a static-cache bf16 decode step in plain torch ops (torch_decode.TorchDecode);
- torch.compile: the same step, mode="reduce-overhead" (measure.compile_timing: a failed compile
  is recorded and the eager step timed instead, flagged);
- time to first token: the context-long prompts prefilled on the kernel itself (ttft_ms);
- SM and memory clocks, sampled during the run (read only).
Reports ms/step, tokens/s, bytes/step (weights + KV read + KV written, from the cost model) and
the achieved fraction of the achievable bandwidth, the cost model's predicted step time, and each
of TARGETS with its measured value, met or not met.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from megakernel.cli.main import check_names  # noqa: E402  (after the sys.path insert)
from megakernel.launch.torch_decode import TorchDecode  # noqa: E402
from megakernel.measure.bandwidth import (  # noqa: E402  (after the sys.path insert)
    ClockSampler,
    clocks,
    compile_timing,
    copy_bandwidth,
    read_bandwidth,
    timed,
)
from megakernel.measure.targets import (  # noqa: E402
    HAZY_H200_S,
    TARGETS,
    Target,
    evaluate_targets,
    metric,
    targets_text,
)

__all__ = ["HAZY_H200_S", "TARGETS", "Target", "evaluate_targets", "metric", "targets_text"]

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def bench_batch(cfg, w: dict[str, torch.Tensor], batch: int, args: argparse.Namespace,  # noqa: ANN001
                bw: float, window: int = 0) -> dict:
    """One batch size: the kernel (CUDA-graph replays) and the torch baselines, same bytes;
    `window` > 0: the recurrent layers by ReplaySSM with that fold window (no torch baselines:
    they implement the dense families' recurrent-free step only)."""
    from megakernel.launch.torch_decode import serves
    from megakernel.serve.kernel_backend import Megakernel

    s_max = args.context + args.iters * 8 + 64
    res: dict = {"batch": batch, "replay_window": window}
    mk = Megakernel(cfg, w, batch=batch, max_seq_len=s_max, build_dir=args.build_dir,
                    replay_window=window or None)
    # prefill on the kernel (one token per step): time to first token of a context-long prompt
    gen = mk.generate_program([[1 + (b * 7919 + i) % (cfg.vocab_size - 1)
                                for i in range(args.context)] for b in range(batch)], 1)
    res["ttft_ms"] = gen.first_token_s * 1e3
    mk.step(torch.ones(batch, 1, dtype=torch.int64, device=mk.device))
    cost = mk.prog.cost
    kargs = mk.op_args()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.megakernel.decode_step(*kargs)
    t_kernel = timed(graph.replay, args.iters)  # tokens feed back: every replay is a new input
    nbytes = cost.bytes_per_step
    res["bytes_per_step"] = nbytes
    res["predicted_ms"] = cost.predicted_s * 1e3
    res["kernel"] = {"ms": t_kernel * 1e3, "tok_s_user": 1 / t_kernel, "tok_s": batch / t_kernel,
                     "bw_fraction": nbytes / t_kernel / bw}
    del mk, graph
    torch.cuda.empty_cache()
    if window or not serves(cfg):
        return res

    base = TorchDecode(cfg, w, batch, s_max)
    tok = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), args.context, dtype=torch.int64, device="cuda")
    with torch.no_grad():
        t_eager = timed(lambda: base.step(tok, pos), max(5, args.iters // 10), groups=3)
        res["torch_eager"] = {"ms": t_eager * 1e3, "tok_s_user": 1 / t_eager,
                              "tok_s": batch / t_eager, "bw_fraction": nbytes / t_eager / bw}
    if not args.no_compile:  # guarded: a failed compile is recorded and timed eager, flagged
        c = compile_timing(base.step, (tok, pos), args.iters)
        res["torch_compile"] = c
        if c.get("s"):
            t_comp = c["s"]
            c.update(tok_s_user=1 / t_comp, tok_s=batch / t_comp, bw_fraction=nbytes / t_comp / bw)
            res["speedup_vs_compile"] = t_comp / t_kernel
    return res  # the baseline's caches are freed with this frame


def markdown(res: dict) -> str:
    read = res["read"].get("GBps")
    lines = [f"{res['device']}: {res['model']}, context {res['context']}, achievable bandwidth "
             f"{res['achievable_GBps']:.0f} GB/s (measured in this run: read "
             f"{f'{read:.0f} GB/s' if read else res['read'].get('error')}, copy "
             f"{res['copy_GBps'] or float('nan'):.0f} GB/s)", "",
             "| B | ReplaySSM L | bytes/step | predicted ms | kernel ms | kernel tok/s/user "
             "| kernel % achievable BW | eager ms | compile ms | speedup vs compile | TTFT ms |",
             "|" + "---|" * 11]
    for r in res["runs"]:
        k, e, c = r["kernel"], r.get("torch_eager", {}), r.get("torch_compile", {})
        lines.append(f"| {r['batch']} | {r.get('replay_window') or '-'} | "
                     f"{r['bytes_per_step'] / 1e9:.3f} GB | "
                     f"{r['predicted_ms']:.3f} | {k['ms']:.3f} | {k['tok_s_user']:.0f} | "
                     f"{100 * k['bw_fraction']:.1f}% | {e.get('ms', float('nan')):.3f} | "
                     f"{c.get('ms', float('nan')):.3f}{'' if c.get('compiled') else ' eager'} | "
                     f"{r.get('speedup_vs_compile', float('nan')):.2f}x | "
                     f"{r.get('ttft_ms', float('nan')):.1f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    """tokens/s per user and % of the achievable bandwidth against B (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    bs = [r["batch"] for r in res["runs"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("kernel", "torch_compile", "torch_eager"):
        if all(name in r for r in res["runs"]):
            a1.plot(bs, [r[name]["tok_s_user"] for r in res["runs"]], "o-", label=name)
            a2.plot(bs, [100 * r[name]["bw_fraction"] for r in res["runs"]], "o-", label=name)
    for a, y in ((a1, "tokens/s per user"), (a2, "% of measured achievable bandwidth")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch B")
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"{res['model']} decode step on {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    from megakernel.models import presets, resolve
    from megakernel.models.weights import random_weights

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="comma list of batch sizes (default 1,2,4,...,64)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50, help="graph replays per timed group")
    ap.add_argument("--build-dir", default=None, help="AOT builds (default: JIT cache)")
    ap.add_argument("--out", default=None, help="directory for decode.{json,md,png}")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--replay-windows", default="0",
                    help="comma list of ReplaySSM fold windows L run next to each other per batch "
                         "(0: the recurrent update; models with recurrent layers), e.g. 0,16")
    args = ap.parse_args()
    if not Path(args.model).is_dir():
        check_names("--model", args.model, list(presets()))
    if not torch.cuda.is_available():
        print("error: bench/decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = resolve(args.model)
    windows = [int(x) for x in args.replay_windows.split(",") if x.strip()]
    if any(x < 0 for x in windows) or (any(windows) and not cfg.recurrent_layers()):
        print(f"error: --replay-windows {args.replay_windows}: windows >= 0, and > 0 only for "
              f"a model with recurrent layers", file=sys.stderr)
        return 2
    w = random_weights(cfg, seed=0)
    copy = copy_bandwidth()
    read = (read_bandwidth(args.build_dir) if args.build_dir else
            {"error": "no --build-dir: the stream kernel's build is looked up under it"})
    ok = [m["GBps"] for m in (read, copy) if "GBps" in m]
    if not ok:
        print(f"error: no bandwidth measured: {copy.get('error')}", file=sys.stderr)
        return 1
    bw = max(ok) * 1e9  # the achievable bandwidth the kernel is judged against
    res: dict = {"model": cfg.name, "context": args.context,
                 "device": torch.cuda.get_device_name(), "copy_GBps": copy.get("GBps"),
                 "read": read, "achievable_GBps": bw / 1e9, "clocks_before": clocks(),
                 "runs": []}
    with ClockSampler(interval_s=0.5) as sampler:
        for b in (int(x) for x in args.batches.split(",") if x.strip()):
            for window in windows:
                try:
                    res["runs"].append(bench_batch(cfg, w, b, args, bw, window))
                except Exception as e:  # a missing build for one B must not lose the others
                    print(f"B={b} L={window}: skipped ({type(e).__name__}: {e})",
                          file=sys.stderr)
    res["clocks"] = sampler.summary()
    res["targets"] = evaluate_targets(res)
    if not res["runs"]:
        print("error: no batch size could be benchmarked", file=sys.stderr)
        return 1
    md = markdown(res)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode.json").write_text(json.dumps(res, indent=2) + "\n")
        (out / "decode.md").write_text(md)
        plot(res, out / "decode.png")
    print(md)
    print(targets_text(res["targets"]))
    return 0 if all(math.isfinite(r["kernel"]["ms"]) for r in res["runs"]) else 1


if __name__ == "__main__":
    from megakernel.cli.main import run_main

    sys.exit(run_main(main))
