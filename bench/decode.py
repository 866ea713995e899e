"""Decode-step benchmark on a GPU: the megakernel vs torch baselines, against copy bandwidth.

    python bench/decode.py --model llama-3.2-1b --batch 1 --context 1024 \
        [--build-dir out/gpu-builds] [--out out/bench]

Measured in one run (CUDA events; random bf16 weights):
- copy: device-to-device copy bandwidth (bytes read + written), the yardstick;
- kernel: `decode_step` captured in a CUDA graph, replayed (the program feeds its own tokens back);
- torch eager: a static-cache bf16 decode step written with plain torch ops;
- torch.compile: the same function, compiled with CUDA graphs (mode="reduce-overhead").
Reports ms/step, tokens/s, bytes/step (weights + KV read + KV written, from the cost model) and
the achieved fraction of the copy bandwidth, plus the cost model's predicted step time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, iters: int, warmup: int = 3, groups: int = 7) -> float:
    """Median seconds per call: CUDA events around `groups` groups of `iters` calls each."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(groups):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3 / iters)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    return 2 * nbytes / timed(lambda: b.copy_(a), 20)


# ---- torch baseline: static KV cache, bf16 weights, batch-first ---------------------------------
class TorchDecode:
    """One decode step (T = 1) for the dense families (Llama, Qwen3, Qwen2) in plain torch ops,
    static cache (graph-safe)."""

    def __init__(self, cfg, w: dict[str, torch.Tensor], batch: int, s_max: int):  # noqa: ANN001
        self.cfg, self.b = cfg, batch
        dev = "cuda"
        self.w = {k: v.to(dev, torch.bfloat16) for k, v in w.items()}
        L, hkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self.k = torch.zeros(L, batch, hkv, s_max, d, dtype=torch.bfloat16, device=dev)
        self.v = torch.zeros_like(self.k)
        inv = torch.tensor(cfg.rope.inv_freq(d), dtype=torch.float64)
        ang = torch.arange(s_max, dtype=torch.float64)[:, None] * inv
        self.cos = torch.cat((ang.cos(), ang.cos()), -1).float().to(dev)
        self.sin = torch.cat((ang.sin(), ang.sin()), -1).float().to(dev)
        self.mask_pos = torch.arange(s_max, device=dev)

    def norm(self, x, w):  # noqa: ANN001, ANN201
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
                * w.float()).to(torch.bfloat16)

    def rope(self, x, pos):  # noqa: ANN001, ANN201
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x.chunk(2, -1)
        return x * c + torch.cat((-x2, x1), -1) * s

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tok [B] int64, pos [B] int64 (cache position of the new token) -> next tokens [B]."""
        cfg, w = self.cfg, self.w
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = w["model.embed_tokens.weight"][tok].float()  # [B, H]
        bidx = torch.arange(self.b, device=tok.device)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x = self.norm(h, w[p + "input_layernorm.weight"])
            q = F.linear(x, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
            k = F.linear(x, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
            v = F.linear(x, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
            q, k = q.float().view(self.b, hq, d), k.float().view(self.b, hkv, d)
            v = v.view(self.b, hkv, d)
            if cfg.qk_norm:
                q = self.norm(q, w[p + "self_attn.q_norm.weight"]).float()
                k = self.norm(k, w[p + "self_attn.k_norm.weight"]).float()
            q, k = self.rope(q, pos).to(torch.bfloat16), self.rope(k, pos).to(torch.bfloat16)
            self.k[i, bidx, :, pos] = k
            self.v[i, bidx, :, pos] = v
            mask = self.mask_pos[None, :] <= pos[:, None]  # [B, S]
            o = F.scaled_dot_product_attention(
                q[:, :, None, :], self.k[i], self.v[i], attn_mask=mask[:, None, None, :],
                enable_gqa=True)  # [B, Hq, 1, D]
            h = h + F.linear(o.reshape(self.b, hq * d), w[p + "self_attn.o_proj.weight"]).float()
            x = self.norm(h, w[p + "post_attention_layernorm.weight"])
            g = F.linear(x, w[p + "mlp.gate_proj.weight"]).float()
            u = F.linear(x, w[p + "mlp.up_proj.weight"]).float()
            a = (F.silu(g) * u).to(torch.bfloat16)
            h = h + F.linear(a, w[p + "mlp.down_proj.weight"]).float()
        x = self.norm(h, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return torch.argmax(F.linear(x, head).float(), dim=-1)


BATCHES = (1, 2, 4, 8, 16, 32, 64)


def bench_batch(cfg, w: dict[str, torch.Tensor], batch: int, args: argparse.Namespace,  # noqa: ANN001
                bw: float) -> dict:
    """One batch size: the kernel (CUDA-graph replays) and the torch baselines, same bytes."""
    from megakernel.torch_op import Megakernel

    s_max = args.context + args.iters * 8 + 64
    res: dict = {"batch": batch}
    mk = Megakernel(cfg, w, batch=batch, max_seq_len=s_max, build_dir=args.build_dir)
    mk.prefill([[1 + (b * 7919 + i) % (cfg.vocab_size - 1) for i in range(args.context)]
                for b in range(batch)])
    mk.step(torch.ones(batch, 1, dtype=torch.int64, device=mk.device))
    cost = mk.prog.cost
    kargs = (mk.program, mk.counters, mk.weights, mk.f32, mk.bf16, mk.i32, mk.k_cache,
             mk.v_cache, mk.kernel_id, mk.offsets, False)
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

    base = TorchDecode(cfg, w, batch, s_max)
    tok = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), args.context, dtype=torch.int64, device="cuda")
    with torch.no_grad():
        t_eager = timed(lambda: base.step(tok, pos), max(5, args.iters // 10), groups=3)
        res["torch_eager"] = {"ms": t_eager * 1e3, "tok_s_user": 1 / t_eager,
                              "tok_s": batch / t_eager, "bw_fraction": nbytes / t_eager / bw}
        if not args.no_compile:
            t0 = time.perf_counter()
            step = torch.compile(base.step, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):
                step(tok, pos)
            res["compile_s"] = time.perf_counter() - t0
            t_comp = timed(lambda: step(tok, pos), args.iters)
            res["torch_compile"] = {"ms": t_comp * 1e3, "tok_s_user": 1 / t_comp,
                                    "tok_s": batch / t_comp, "bw_fraction": nbytes / t_comp / bw}
            res["speedup_vs_compile"] = t_comp / t_kernel
    return res  # the baseline's caches are freed with this frame


def markdown(res: dict) -> str:
    lines = [f"{res['device']}: {res['model']}, context {res['context']}, copy bandwidth "
             f"{res['copy_GBps']:.0f} GB/s (measured in this run)", "",
             "| B | bytes/step | predicted ms | kernel ms | kernel tok/s/user | kernel % copy BW "
             "| eager ms | compile ms | speedup vs compile |", "|" + "---|" * 9]
    for r in res["runs"]:
        k, e, c = r["kernel"], r.get("torch_eager", {}), r.get("torch_compile", {})
        lines.append(f"| {r['batch']} | {r['bytes_per_step'] / 1e9:.3f} GB | "
                     f"{r['predicted_ms']:.3f} | {k['ms']:.3f} | {k['tok_s_user']:.0f} | "
                     f"{100 * k['bw_fraction']:.1f}% | {e.get('ms', float('nan')):.3f} | "
                     f"{c.get('ms', float('nan')):.3f} | "
                     f"{r.get('speedup_vs_compile', float('nan')):.2f}x |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    """tokens/s per user and % of copy bandwidth against B (skipped without matplotlib)."""
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
    for a, y in ((a1, "tokens/s per user"), (a2, "% of measured copy bandwidth")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch B")
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"{res['model']} decode step on {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    from megakernel.models import resolve
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
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: bench/decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = resolve(args.model)
    w = random_weights(cfg, seed=0)
    bw = copy_bandwidth()
    res: dict = {"model": cfg.name, "context": args.context,
                 "device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "runs": []}
    for b in (int(x) for x in args.batches.split(",") if x.strip()):
        try:
            res["runs"].append(bench_batch(cfg, w, b, args, bw))
        except Exception as e:  # a missing build for one B must not lose the others
            print(f"B={b}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
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
    return 0 if all(math.isfinite(r["kernel"]["ms"]) for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
