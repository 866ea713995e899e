"""gpu-check's benchmark stage: decode steps timed next to the cost model, and what the cost model
assumes measured in the same run (read-only HBM stream with the kernel's bulk-copy pattern, the
device-to-device copy, SM and memory clocks while the steps run, the torch.compile baseline, and
one step's timeline from the timeline variant). Efficiency is reported against the larger of the
measured read and copy bandwidths, for the bytes of the case's own weight format (an FP8 row's
are the FP8 program's: codes and scales). Every item records its error instead of raising."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from megakernel.gpu_check.cases import Case, variant_dir
from megakernel.models.fp8 import QuantizedWeights
from megakernel.models.weights import LazyRandomWeights


def measure_bandwidth(build_dir: Path, simulate: bool) -> dict[str, Any]:
    """Read and copy bandwidth (bytes/s) and the clocks before the steps."""
    if simulate:
        return {"simulated": True, "note": "no GPU: nothing measured"}
    from megakernel.measure import bandwidth as measure

    read = measure.read_bandwidth(measure.stream_build_dir(build_dir))
    copy = measure.copy_bandwidth()
    best = max((x.get("bytes_per_s") or 0.0) for x in (read, copy))
    return {"read": read, "copy": copy, "clocks": measure.clocks(),
            "achievable_bytes_per_s": best or None}


def bench_case(c: Case, build_dir: Path, weights, variant: str, achievable: float | None,  # noqa: ANN001
               simulate: bool, replays: int = 50, context: int = 1024) -> dict[str, Any]:
    """Steps at `context` cached tokens, captured in a CUDA graph; time per step (median of 5
    groups of CUDA-event-timed replays) next to the cost model's prediction and the floor."""
    from megakernel.gpu_check.case import config
    from megakernel.serve.kernel_backend import Megakernel

    cfg = config(c, simulate)
    dev = "cpu" if simulate else "cuda"
    replays, context = (1, 16) if simulate else (replays, context)
    if c.synthetic:  # drawn (and quantized, FP8) on the device, one tensor at a time
        w = LazyRandomWeights(cfg.replace(quant=None), 0, dev)
        w = QuantizedWeights(cfg, w) if cfg.quant is not None else w
    else:
        w = weights.get(cfg)
    mk = Megakernel(cfg, w, batch=c.batch, tokens=1, max_seq_len=context + 2 * replays + 64,
                    build_dir=variant_dir(build_dir, variant), device=dev)
    if c.synthetic:  # no reference to prefill with: a random cache of `context` positions
        mk.fill_context(context)
    else:
        mk.prefill([[1] * context for _ in range(c.batch)])
    tok = torch.ones(c.batch, 1, dtype=torch.int64, device=mk.device)
    out, logits = mk.step(tok, return_logits=True)
    finite = bool(torch.isfinite(logits).all())
    own = bool((logits.view(c.batch, -1).argmax(-1) == out.view(-1)).all()) if finite else False
    args = mk.op_args()

    def launch() -> None:
        torch.ops.megakernel.decode_step(*args)

    how, run_once = "cpu executor (simulated)", launch
    if not simulate:
        torch.cuda.synchronize()
        graph, how = torch.cuda.CUDAGraph(), "cuda graph"
        try:
            with torch.cuda.graph(graph):
                launch()
            run_once = graph.replay
        except Exception as e:  # capture refused: time plain launches, say so
            how = f"stream launches (graph capture failed: {type(e).__name__}: {e})"
            torch.cuda.synchronize()
    res: dict[str, Any] = {"case": c.name, "model": c.model, "batch": c.batch, "tokens": 1,
                           "weights": c.weights, "variant": variant, "context": context,
                           "timed": how,
                           "max_seq_len": mk.max_seq_len,
                           "simulated": simulate, "synthetic": c.synthetic,
                           # the first step's logits finite and its tokens their argmax
                           "logits_finite": finite, "own_argmax": own}
    if simulate:
        t0 = time.perf_counter()
        for _ in range(replays):
            run_once()
        step_s = (time.perf_counter() - t0) / replays
    else:
        from megakernel.measure import bandwidth as measure

        with measure.ClockSampler() as sampler:  # clocks while the steps run (read only)
            step_s = measure.timed(run_once, max(1, replays // 5), warmup=2, groups=5)
        res["clocks"] = sampler.summary()
    cost = mk.prog.cost  # of the program's own weight format: an FP8 step's bytes are FP8 bytes
    nbytes = cost.bytes_per_step if cost is not None else 0
    res.update(step_us=step_s * 1e6, tokens_per_s=c.batch / step_s, bytes_per_step=nbytes,
               predicted_us=cost.predicted_s * 1e6 if cost is not None else None)
    if achievable and nbytes:
        res["floor_us"] = nbytes / achievable * 1e6
        res["fraction_of_achievable"] = nbytes / step_s / achievable
    return res


def torch_compile_baseline(c: Case, weights, simulate: bool, context: int = 1024  # noqa: ANN001
                           ) -> dict[str, Any]:
    """torch.compile (reduce-overhead) of a plain torch decode step of the same model and batch,
    timed in this run (the ratio the targets quote)."""
    if simulate:
        return {"case": c.name, "simulated": True, "note": "no GPU: not timed"}
    from megakernel.launch.torch_decode import TorchDecode
    from megakernel.measure import bandwidth as measure
    from megakernel.models import preset

    if c.fp8:  # the baseline is the bf16 torch step; an FP8 row has none
        return {"case": c.name, "note": "no torch.compile baseline of FP8 weights"}
    cfg = preset(c.model)
    td = TorchDecode(cfg, weights.get(cfg), c.batch, context + 64)
    tok = torch.ones(c.batch, dtype=torch.int64, device="cuda")
    pos = torch.full((c.batch,), context, dtype=torch.int64, device="cuda")
    return {"case": c.name, **measure.compile_timing(td.logits, (tok, pos))}


def timeline(c: Case, build_dir: Path, weights, simulate: bool) -> dict[str, Any]:  # noqa: ANN001
    """One step of the timeline variant: its per-instruction records (for `plan --timeline`)."""
    if simulate:
        return {"case": c.name, "simulated": True, "note": "no GPU: no records"}
    from megakernel.measure import timeline as tl
    from megakernel.serve.kernel_backend import Megakernel

    cfg = c.config()
    mk = Megakernel(cfg, weights.get(cfg), batch=c.batch, tokens=1, max_seq_len=1024 + 64,
                    build_dir=variant_dir(build_dir, "timeline"))
    mk.prefill([[1] * 1024 for _ in range(c.batch)])
    return {"case": c.name, **tl.run_timeline(mk)}
