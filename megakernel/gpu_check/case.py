"""One gpu-check case: the kernel (or, simulated, the CPU executor behind the same op) against the
torch reference in bf16 and fp32 on the same device, teacher-forced with the kernel's own tokens.

Per step: scratch and outputs poisoned first (NaN, tokens -1), nothing left unwritten after; the
logits within the band (compare.band) and the greedy tokens checked (compare.greedy_check). After
the steps: the KV cache within the band on every written position, four steps replayed from a
snapshot bit-identical, and (executor_steps > 0) the first steps equal to the CPU executor's run of
the same program from the same cache (logits and new KV entries up to shared-rounding flips);
(paged cases) the paged build's steps next to these (paged_case.py).

An FP8 case (Case.fp8) runs the preset quantized on load: the kernel's build of that format, and
the references of the FP8 model (its weights dequantized exactly: the truth, and the bf16 mirror
that sets the band), so every verdict above holds unchanged; the executor runs the same FP8
program.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from megakernel.gpu_check import compare
from megakernel.gpu_check.cases import Case
from megakernel.gpu_check.paged_case import PagedRun

SIMULATED_STEPS = 3  # steps of a simulated case (the executor is slow; the machinery is the point)
SIMULATED_LAYERS = 2  # a simulated real preset keeps its shapes but only this many layers
SNAPSHOT = ("f32", "bf16", "i32", "k_cache", "v_cache", "state")  # what a step reads and writes


def config(case: Case | str, simulate: bool):  # noqa: ANN201 (ModelConfig)
    """A case's model (a Case: the preset in its weight format, Case.config; a name: the bf16
    preset), cut to SIMULATED_LAYERS layers when simulated (every real shape, vocab included,
    stays: the executor of a whole 1B model would take minutes a step); a hybrid preset keeps the
    layers up to the first of each of its kinds."""
    import dataclasses

    from megakernel.models import preset

    cfg = case.config() if isinstance(case, Case) else preset(case)
    model = case.model if isinstance(case, Case) else case
    if not simulate or model.endswith(("-tiny", "-mid")) or cfg.num_layers <= SIMULATED_LAYERS:
        return cfg
    types = getattr(cfg, "layer_types", None)
    if types is None:  # a dense stack
        return dataclasses.replace(cfg, num_layers=SIMULATED_LAYERS)
    # a hybrid stack: the shortest prefix with every kind of layer it has (and at least 2)
    n = max(SIMULATED_LAYERS, max(types.index(k) for k in set(types)) + 1)
    return cfg.replace(layer_types=tuple(types[:n]))


class Weights:
    """Random weights made once per model, weight format and seed: in this process, and on disk
    for the next process (`cache_dir`), since generating a real preset's takes longer than
    loading them. An FP8 model's are its bf16 model's (the same seed) quantized on load
    (models.fp8.QuantizedWeights): e4m3 codes and their `_scale` grids, on the CPU."""

    def __init__(self, cache_dir: Path | None = None, device: str | torch.device = "cpu"):
        self.cache_dir = cache_dir
        self.device = torch.device(device)  # where FP8 quantizing runs (the results: CPU)
        self.mem: dict[tuple, dict[str, torch.Tensor]] = {}

    def get(self, cfg, seed: int = 0) -> dict[str, torch.Tensor]:  # noqa: ANN001
        from megakernel.models.weights import random_weights

        fmt = weight_format(cfg)
        key = (cfg.name, cfg.num_layers, seed, fmt)
        if key not in self.mem:
            tag = "" if fmt == "bf16" else f"-{fmt}"
            f = (self.cache_dir / f"{cfg.name}-{cfg.num_layers}-{seed}{tag}.pt" if self.cache_dir
                 else None)
            if f is not None and f.is_file():
                w = torch.load(f, weights_only=True)
            elif cfg.quant is None:
                self.mem = {}  # one model at a time: real presets are GBs
                w = random_weights(cfg, seed=seed)
            else:  # the bf16 model (cached too) quantized
                w = quantized(cfg, self.get(cfg.replace(quant=None), seed), self.device)
            self.mem = {key: w}
            if f is not None and not f.is_file():
                torch.save(w, f)
        return self.mem[key]


def weight_format(cfg) -> str:  # noqa: ANN001
    """A config's weight format label, as Case.weights spells it ("bf16", "fp8", "fp8-block")."""
    from megakernel.gpu_check.cases import weights_label

    return weights_label(cfg.quant.granularity if cfg.quant is not None else "")


class _OnDevice(Mapping):
    """`base` with the names in `names` read onto `device` (where they are quantized)."""

    def __init__(self, base: Mapping[str, torch.Tensor], names: set[str], device: torch.device):
        self.base, self.names, self.device = base, names, device

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.base[name]
        return t.to(self.device) if name in self.names else t

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def quantized(cfg, base: Mapping[str, torch.Tensor],  # noqa: ANN001
              device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """`base` (a bf16 model) in `cfg.quant`'s FP8 form, materialized on the CPU: each quantized
    matrix quantized on `device` (a real preset's on the GPU: seconds, not a minute)."""
    from megakernel.models.fp8 import QuantizedWeights, quantized_names

    q = QuantizedWeights(cfg, _OnDevice(base, set(quantized_names(cfg)), torch.device(device)))
    return {n: q[n].cpu() for n in q}


def _to_cpu(obj):  # noqa: ANN001, ANN202
    """A deep copy of a reference cache with every tensor on the CPU."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=False)


def run_case(c: Case, build_dir: Path | None, weights: Weights, simulate: bool = False,
             seed: int = 0, emulate: bool = False) -> dict[str, Any]:
    """One case: `simulate` runs on the CPU (the CPU executor serves the launches, or with
    `emulate` the case's build on the PTX emulator)."""
    from megakernel.reference.model import ReferenceModel
    from megakernel.serve.kernel_backend import Megakernel

    t0 = time.perf_counter()
    cfg = config(c, simulate)
    dev = torch.device("cpu") if simulate else torch.device("cuda", torch.cuda.current_device())
    steps = min(c.steps, SIMULATED_STEPS) if simulate else c.steps
    w = weights.get(cfg, seed)
    if cfg.quant is not None and not simulate:  # the references dequantize where they run
        w = {n: t.to(dev) for n, t in w.items()}
    g = torch.Generator().manual_seed(seed + 7)
    lens = [int(x) for x in torch.randint(2, 24, (c.batch,), generator=g)]
    prompts = [[int(t) for t in torch.randint(0, cfg.vocab_size, (n,), generator=g)]
               for n in lens]
    s_max = max(lens) + steps * c.tokens + 8
    window = c.replay_window or None
    mk = Megakernel(cfg, w, batch=c.batch, tokens=c.tokens, max_seq_len=s_max,
                    build_dir=build_dir, device=dev, n_splits=c.n_splits, replay_window=window,
                    emulate=emulate)
    ref16 = ReferenceModel(cfg, w, mode="bf16", device=dev, replay_window=window)
    ref32 = ReferenceModel(cfg, w, mode="fp32", device=dev, replay_window=window)
    cache16, cache32 = ref16.new_cache(c.batch, s_max), ref32.new_cache(c.batch, s_max)
    first = mk.prefill(prompts)
    ref16.prefill(cache16, prompts)
    ref32.prefill(cache32, prompts)
    ex = _executor(mk, cache16) if c.executor_steps else None
    paged = PagedRun(c, mk, _to_cpu(cache16), build_dir, simulate, emulate) if c.paged else None
    mk.prog.buffers.poison_scratch(mk.f32, mk.bf16)  # before the first kernel step
    res: dict[str, Any] = dict(
        case=c.name, model=c.model, layers=cfg.num_layers, batch=c.batch, tokens=c.tokens,
        n_splits=mk.prog.n_splits, weights=c.weights, fp8_matrices=fp8_matrices(mk.prog),
        prompt_lengths=lens, steps=0, band_failures=0, max_err_kernel=0.0, max_allowed=0.0,
        token_mismatches=0, near_tie_mismatches=0, ref_near_ties=0, not_own_argmax=0,
        unwritten=0,
        first_failure_step=None, simulated=simulate, emulated=emulate)
    if mk.manifest is not None:
        from megakernel.kernel.config.spec import KernelSpec

        built = KernelSpec.from_dict(mk.manifest.spec)
        res.update(gemv="mma" if built.mma else "fma", smem_stages=built.smem_stages)
    ex_res: dict[str, Any] = {"executor_max_logit_diff": 0.0, "executor_logit_over": 0,
                              "executor_kv_over": 0, "executor_token_mismatches": 0,
                              "executor_state_max_diff": 0.0, "executor_state_ok": True}
    snap = None
    last = first
    tok = first[:, None].repeat(1, c.tokens)
    for step in range(steps):
        if c.tokens > 1 and step > 0:  # a verify-style step: last token + random drafts
            draft = torch.randint(0, cfg.vocab_size, (c.batch, c.tokens - 1), generator=g)
            tok = torch.cat((last[:, None].cpu(), draft), dim=1)
        tok = tok.to(dev)
        if step == min(8, steps - 1):
            snap = _snapshot(mk)
        mk.logits.fill_(float("nan"))
        mk._region("i32", "tokens_out").fill_(-1)
        n0 = list(mk.lengths)
        out_tok, logits = mk.step(tok, return_logits=True)
        l16, l32 = ref16.decode(cache16, tok), ref32.decode(cache32, tok)
        logits = logits.view(c.batch * c.tokens, -1)
        l16, l32 = l16.reshape(logits.shape), l32.reshape(logits.shape)
        v = compare.step_verdict(logits, out_tok.view(-1), l16, l32)
        b, gc = v["band"], v["greedy"]
        res["unwritten"] += not v["written"]
        res["max_err_kernel"] = max(res["max_err_kernel"], b["err"])
        res["max_allowed"] = max(res["max_allowed"], b["allowed"])
        res["band_failures"] += not b["ok"]
        res["token_mismatches"] += gc["clear"]
        res["near_tie_mismatches"] += gc["near_ties"]
        res["ref_near_ties"] += gc["ref_near_ties"]
        res["not_own_argmax"] += gc["not_own_argmax"]
        if not v["ok"] and res["first_failure_step"] is None:
            res["first_failure_step"] = step
        if ex is not None and step < c.executor_steps:
            _against_executor(ex, mk, tok, logits, out_tok, l16, l32, ex_res)
        if paged is not None:
            paged.step(tok, n0, logits, l16, l32)
        last = out_tok.view(c.batch, c.tokens)[:, -1].long()
        tok = last[:, None]
        res["steps"] += 1
    if not simulate:
        torch.cuda.synchronize()
    kv16, kv32 = cache16.kv_slots(), cache32.kv_slots()
    lengths = [int(n) for n in cache16.lengths.tolist()]
    kb = [compare.kv_band(mine, r16, r32, lengths)
          for mine, r16, r32 in zip((mk.k_cache, mk.v_cache), kv16, kv32, strict=True)]
    worst = max(kb, key=lambda x: x["err"] / max(x["allowed"], 1e-30))  # K or V
    res["kv"] = {"k": kb[0], "v": kb[1]}
    res["kv_max_err"], res["kv_allowed"] = worst["err"], worst["allowed"]
    res["kv_ok"] = all(x["ok"] for x in kb)
    if snap is not None:
        res["deterministic"] = _replay_is_identical(mk, snap, cfg.vocab_size, c,
                                                    1 if simulate else 4)
    if ex is not None:
        res.update(ex_res)
        res["executor_ok"] = (ex_res["executor_logit_over"] == 0
                              and ex_res["executor_kv_over"] == 0
                              and ex_res["executor_token_mismatches"] == 0
                              and ex_res["executor_state_ok"])
    if paged is not None:
        res.update(paged.verdict())
    compared = res["steps"] * c.batch * c.tokens
    res["near_ties_ok"] = compare.near_ties_ok(res["near_tie_mismatches"],
                                               res["ref_near_ties"], compared)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    res["ok"] = (res["steps"] == steps and res["unwritten"] == 0 and res["band_failures"] == 0
                 and res["token_mismatches"] == 0 and res["not_own_argmax"] == 0
                 and res["near_ties_ok"] and res["kv_ok"] and res.get("deterministic", True)
                 and res.get("executor_ok", True) and res.get("paged_ok", True))
    return res


def fp8_matrices(prog) -> int:  # noqa: ANN001 (program.compiler.Program)
    """How many of the program's packed matrices are FP8 (0: a bf16 program): what the case ran,
    read from the program rather than from the case."""
    return sum(e.dtype == "fp8" for e in prog.layout.entries.values())


def _executor(mk, cache16):  # noqa: ANN001, ANN202
    """The CPU executor of the kernel's program from the reference's prefill cache (the one the
    kernel starts from)."""
    from megakernel.executor import Executor

    ex = Executor(mk.prog, mk.args.packed, check=True)
    ex.load_cache(_to_cpu(cache16))
    return ex


def _against_executor(ex, mk, tok, logits, out_tok, l16, l32, acc: dict) -> None:  # noqa: ANN001
    """One step of the executor with the kernel's inputs; kernel and executor round at the same
    points, so logits and the new KV entries agree up to a few bf16 ulps."""
    n0 = ex.lengths.tolist()
    ex.step(tok.cpu().view(mk.batch, mk.tokens))
    exl = ex.logits.reshape(logits.shape)
    s = compare.same_program(logits, exl)
    acc["executor_max_logit_diff"] = max(acc["executor_max_logit_diff"], s["max_diff"])
    acc["executor_logit_over"] += s["over"]
    gc = compare.greedy_check(exl, out_tok.view(-1).cpu(), l16.cpu(), l32.cpu())
    acc["executor_token_mismatches"] += gc["clear"]
    for mine, theirs in ((mk.k_cache, ex.k), (mk.v_cache, ex.v)):
        for b, n in enumerate(n0):
            new = slice(n, n + mk.tokens)
            acc["executor_kv_over"] += compare.same_program(
                mine[:, b, :, new].cpu(), theirs[:, b, :, new])["over"]
    # recurrent layers: conv windows, states, rings (the whole arena) after the same step
    st = compare.state_parity(mk.state, ex.state)
    acc["executor_state_max_diff"] = max(acc["executor_state_max_diff"], st["max_diff"])
    acc["executor_state_ok"] = acc["executor_state_ok"] and st["ok"]


def _snapshot(mk) -> dict:  # noqa: ANN001
    return {n: getattr(mk, n).clone() for n in SNAPSHOT} | {
        "lengths": list(mk.lengths)}


def _replay_is_identical(mk, snap: dict, vocab: int, c: Case, steps: int) -> bool:  # noqa: ANN001
    """Run `steps` steps from the snapshot twice (same tokens): logits must be bit-identical
    (the counters keep counting epochs: no reset between replays)."""
    outs = []
    for _ in range(2):
        for n in SNAPSHOT:
            getattr(mk, n).copy_(snap[n])
        mk.lengths = list(snap["lengths"])
        g = torch.Generator().manual_seed(123)
        seq = []
        for _ in range(steps):
            if max(mk.lengths) + c.tokens > mk.max_seq_len:
                break
            tok = torch.randint(0, vocab, (c.batch, c.tokens), generator=g)
            _, lg = mk.step(tok.to(mk.device), return_logits=True)
            seq.append(lg)
        outs.append(torch.stack(seq))
    return bool(torch.equal(outs[0], outs[1]))
