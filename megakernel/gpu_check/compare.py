"""How gpu-check judges a kernel's outputs: every bound comes from the reference's own error.

docs/TESTING.md, Numerics: a bf16 result x is right when max |x - fp32| <= 2 max |ref_bf16 - fp32|
+ noise, with noise = 2 max |(t + 0.3) - 0.3 - t| over the fp32 truth t (fp32 rounding at its
scale). The band is the tolerance; nothing here is derived from the kernel's own error, so a kernel
that returns zeros, negated or shifted logits fails the band, and its tokens are compared where
the truth's top-2 margin is wider than twice the band (no error the band allows can reorder them
there).

FP8 weights change the references, not the rules: an FP8 case's truth is the reference with its
weights dequantized exactly (code * scale in fp32) and its bf16 mirror keeps those weights in fp32
(docs/FP8.md, Numerics), so the band is that mirror's error against the FP8 truth, as for bf16.
The bf16 model's logits are not the FP8 model's: a kernel that computes the unquantized model
fails the band (tests/kernel/test_kernel_gpucheck_fp8.py).
"""

from __future__ import annotations

from typing import Any

import torch

NEAR_TIE_FRACTION = 0.05  # at most this share of compared tokens may be near ties that flipped
# the kernel's recurrent state against the executor's: fp32 through both, summation order apart
STATE_RTOL = 1e-3
MIN_PREFIX = 16  # free-running generations must agree this long unless a near tie comes first


def noise(truth: torch.Tensor) -> float:
    """Rounding-noise term of the band: 2 max |(t + 0.3 - 0.3) - t| (fp32)."""
    t = truth.float()
    return 2.0 * float(((t + 0.3) - 0.3 - t).abs().max())


def band(x: torch.Tensor, ref16: torch.Tensor, ref32: torch.Tensor) -> dict[str, Any]:
    """x against the fp32 truth within the band the bf16 reference sets; non-finite x fails."""
    t = ref32.float()
    xf, r = x.float().to(t.device), ref16.float().to(t.device)
    finite = bool(torch.isfinite(xf).all())
    err = float((xf - t).abs().max()) if finite else float("inf")
    allowed = 2.0 * float((r - t).abs().max()) + noise(t)
    return {"err": err, "allowed": allowed, "ok": finite and err <= allowed}


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] gap between the largest and the second largest (fp32)."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, the lowest index on ties (as the kernel resolves them)."""
    return torch.argmax(logits, dim=-1)


def row_allowance(ref16: torch.Tensor, ref32: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R]: the band per row (2 max |ref16 - fp32| + noise of that row)."""
    t = ref32.float()
    e = (ref16.float().to(t.device) - t).abs().amax(dim=-1)
    return 2.0 * e + noise(t)


def greedy_check(kernel_logits: torch.Tensor, kernel_tokens: torch.Tensor, ref16: torch.Tensor,
                 ref32: torch.Tensor) -> dict[str, Any]:
    """Teacher-forced greedy comparison of one step: [R, V] logits, [R] kernel tokens.

    - the kernel's token is the greedy token of its own logits (lowest index on ties): a wrong
      argmax reduction fails here whatever the logits;
    - it equals the fp32 truth's greedy token wherever the truth's top-2 margin exceeds twice the
      row's band ("clear" mismatches are defects); below that a mismatch is a near tie, counted
      next to the bf16 reference's own flips against the truth (`ref_near_ties`).
    """
    k = kernel_logits.float()
    t = ref32.float().to(k.device)
    tok = kernel_tokens.to(k.device).long()
    own = greedy(k)
    want = greedy(t)
    margin = top2_margin(t)
    bound = 2.0 * row_allowance(ref16.to(k.device), t)
    bad = tok != want
    clear = bad & (margin > bound)
    ref_flips = int((greedy(ref16.float().to(k.device)) != want).sum())
    return {"clear": int(clear.sum()), "near_ties": int((bad & ~clear).sum()),
            "ref_near_ties": ref_flips,
            "not_own_argmax": int((tok != own).sum()), "mismatch": bool(bad.any()),
            "min_margin": float(margin.min()), "max_bound": float(bound.max())}


def common_prefix(kernel_tokens: list[int], ref_tokens: list[int], ref_margins: list[float],
                  bound: float) -> dict[str, Any]:
    """Free-running greedy comparison of one sequence.

    Steps are compared until the first one whose reference top-2 margin is <= `bound` (a near
    tie by the reference's own error: both generations may legitimately part there). `ok`: no
    difference in the compared steps, and the compared prefix is at least MIN_PREFIX long (or all
    steps) unless a near tie came first.
    """
    n = min(len(kernel_tokens), len(ref_tokens), len(ref_margins))
    compared, tie = n, False
    for t in range(n):
        if ref_margins[t] <= bound:
            compared, tie = t, True  # the near-tie step itself may differ: not compared
            break
    first = next((t for t in range(n) if kernel_tokens[t] != ref_tokens[t]), None)
    diverged = first is not None and first < compared
    long_enough = compared >= min(n, MIN_PREFIX) or tie
    return {"compared": compared, "first_difference": first, "near_tie_stop": tie,
            "ok": not diverged and long_enough and len(kernel_tokens) == len(ref_tokens)}


def kv_band(kernel_kv: torch.Tensor, ref16_kv: torch.Tensor, ref32_kv: torch.Tensor,
            lengths: list[int]) -> dict[str, Any]:
    """The KV cache [layers, B, Hkv, S, D] within the band over every written position."""

    def written(kv: torch.Tensor) -> torch.Tensor:
        return torch.cat([kv[:, b, :, :n].float().reshape(-1).cpu()
                          for b, n in enumerate(lengths)])

    return band(written(kernel_kv), written(ref16_kv), written(ref32_kv))


def same_program(a: torch.Tensor, b: torch.Tensor, ulps: float = 2.0) -> dict[str, Any]:
    """Two runs of one program (kernel and CPU executor) round at the same points but sum in
    different orders, so a rounding point may flip one bf16 ulp, and a flipped input moves every
    output of the next matvec by up to an ulp of its terms' scale, not of the output's own
    magnitude (an output near zero is a cancellation). So each row (the last dim: a sequence's
    logits, a head's key or value vector) must agree within `ulps` bf16 ulps of the row's
    largest magnitude. `ulps` in the result: the worst row's difference in those units."""
    x, y = a.float().cpu(), b.float().cpu()
    finite = bool(torch.isfinite(x).all() and torch.isfinite(y).all())
    if x.numel() == 0:
        return {"max_diff": 0.0, "ulps": 0.0, "over": 0, "ok": finite}
    scale = torch.maximum(x.abs(), y.abs()).amax(dim=-1, keepdim=True)
    unit = 2.0 ** -8 * scale + 1e-30
    over = (x - y).abs() > ulps * unit
    return {"max_diff": float((x - y).abs().max()) if finite else float("inf"),
            "ulps": float(((x - y).abs() / unit).max()) if finite else float("inf"),
            "over": int(over.sum()), "ok": finite and not bool(over.any())}


def state_parity(a: torch.Tensor, b: torch.Tensor, rtol: float = STATE_RTOL) -> dict[str, Any]:
    """The recurrent state arena of two runs of one program (kernel and CPU executor): fp32 all
    the way, the same inputs up to the matvecs' summation order, so every element within `rtol`
    of the arena's largest magnitude (a wrong index or a skipped update is off by O(1))."""
    x, y = a.float().cpu(), b.float().cpu()
    if x.shape != y.shape:
        return {"max_diff": float("inf"), "scale": 0.0, "ok": False}
    if x.numel() == 0:
        return {"max_diff": 0.0, "scale": 0.0, "ok": True}
    finite = bool(torch.isfinite(x).all() and torch.isfinite(y).all())
    scale = float(y.abs().max())
    diff = float((x - y).abs().max()) if finite else float("inf")
    return {"max_diff": diff, "scale": scale, "ok": finite and diff <= rtol * max(scale, 1e-30)}


def near_ties_ok(near_ties: int, ref_near_ties: int, compared: int) -> bool:
    """Near ties that flipped stay rare: at most as many as twice the bf16 reference's own flips
    against the fp32 truth, or NEAR_TIE_FRACTION of the compared tokens, or one."""
    return near_ties <= max(1, 2 * ref_near_ties, int(NEAR_TIE_FRACTION * compared))


def step_verdict(logits: torch.Tensor, tokens: torch.Tensor, ref16: torch.Tensor,
                 ref32: torch.Tensor) -> dict[str, Any]:
    """One step's verdict: [R, V] logits and [R] tokens against the references. `ok` requires
    finite logits, every token written, the band, no clear mismatch and every token its own
    logits' greedy token."""
    b = band(logits, ref16, ref32)
    g = greedy_check(logits, tokens, ref16, ref32)
    written = bool(torch.isfinite(logits).all()) and not bool((tokens < 0).any())
    return {"band": b, "greedy": g, "written": written,
            "ok": written and b["ok"] and g["clear"] == 0 and g["not_own_argmax"] == 0}
