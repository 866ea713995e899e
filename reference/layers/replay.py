"""ReplaySSM: recurrent layers that read a committed state plus a ring of cached inputs.

Instead of reading *and writing* the recurrent state every token, a layer keeps
  - a committed state S_c (written only at a fold),
  - a ring of the per-token inputs since S_c: Mamba2 (x, B, dt); GDN / KDA (k, u, g) with
    u = beta (v - S^T k) the delta-rule write (cached instead of v, so replay has no serial
    dependency on the state),
  - the committed conv window (the K-1 newest committed pre-conv inputs).
A step with T tokens computes all T outputs from S_c and the ring, and appends T proposed entries
after the n committed ones. `commit(a)` then keeps the first a + 1 (the verified token plus a
accepted drafts): the ring cursor advances by a + 1, rejected entries are simply left to be
overwritten, and the conv window shifts by a + 1. No per-draft state snapshot exists. When the
cursor reaches the window L, the n committed entries are folded into S_c and the ring restarts.
Folding at commit (acceptance known) keeps the ring at L - 1 + T_max entries.

Equations (docs/HYBRIDS.md, ReplaySSM), per head, with log-decays summed over segments (`segsum`):
  Mamba2, Lam(t, j) = A * sum dt over (j, t], entries j in (c, t]:
    y_t = e^{Lam(t, c)} S_c C_t + sum_j dt_j e^{Lam(t, j)} (B_j . C_t) x_j + D x_t
    fold: S = e^{Lam(n, c)} S_c + sum_j x_j (dt_j e^{Lam(n, j)} B_j)^T
  Delta rule (GDN: scalar decay broadcast over d_k; KDA: channel decay), G(t, j) = sum g on (j, t]:
    u_t = beta_t (v_t - S_c^T (e^{G(t,c)} k_t) - sum_{j<t} ((e^{G(t,j)} k_j) . k_t) u_j)
    o_t = S_c^T (e^{G(t,c)} q_t) + sum_{j<=t} ((e^{G(t,j)} k_j) . q_t) u_j
    fold: S = diag(e^{G(n,c)}) S_c + sum_j (e^{G(n,j)} k_j) u_j^T
  Draft tokens of one step depend on each other only through u (GDN/KDA): they are solved in order
  (forward substitution of the UT system (I + A) U = RHS); Mamba2 drafts are independent.

The recurrent updates in `gdn.delta_rule_step` and `mamba2.ssd_step` are written in the same
"decay on read" form, so with L = 1 replay reproduces them bit for bit in fp32.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import ReferenceLayer, check_tensor
from .common import ReferenceError, segsum, shift_window, short_conv

DEFAULT_WINDOW = 16


# ---- math: delta rule ---------------------------------------------------------------------------
def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1)


def _read(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """S^T x for S [..., dk, dv] and x [..., dk] -> [..., dv]."""
    return (state * x[..., :, None]).sum(-2)


def delta_rule_replay(
    state: torch.Tensor,  # [H, dk, dv] committed state of one sequence
    ring: dict[str, torch.Tensor],  # k [n, H, dk], u [n, H, dv], g [n, H, dk]
    q: torch.Tensor,  # [T, H, dk] (l2-normalised and scaled)
    k: torch.Tensor,  # [T, H, dk] (l2-normalised)
    v: torch.Tensor,  # [T, H, dv]
    beta: torch.Tensor,  # [T, H]
    g: torch.Tensor,  # [T, H, dk] log-decays (<= 0)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Outputs o [T, H, dv] of T new tokens and their ring entries {k, u, g}."""
    n, t_new = ring["k"].shape[0], q.shape[0]
    keys = torch.cat((ring["k"], k), dim=0)  # [n+T, H, dk]
    g_all = torch.cat((torch.zeros_like(g[:1]), ring["g"], g), dim=0)  # [1+n+T, H, dk]
    seg = segsum(g_all)  # [1+n+T, 1+n+T, H, dk]; index 0 is the committed state
    us = list(ring["u"].unbind(0))
    outs = []
    for i in range(t_new):
        t = n + i
        a_c = seg[t + 1, 0].exp()  # [H, dk] decay from the committed state
        w = seg[t + 1, 1 : t + 2].exp() * keys[: t + 1]  # [t+1, H, dk] decayed keys, j <= t
        pre = _read(state, a_c * k[i]) + _weighted(_dot(w[:t], k[i][None]), us)
        u = beta[i][:, None] * (v[i] - pre)  # [H, dv]
        us.append(u)
        outs.append(_read(state, a_c * q[i]) + _weighted(_dot(w, q[i][None]), us))
    u_new = torch.stack(us[n:], dim=0)
    return torch.stack(outs, dim=0), {"k": k, "u": u_new, "g": g}


def _weighted(coef: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor | float:
    """sum_j coef[j, h] * values[j][h, :]; 0.0 for no terms."""
    if not values or coef.shape[0] == 0:
        return 0.0
    vals = torch.stack(values[: coef.shape[0]], dim=0)  # [m, H, dv]
    return (coef[..., None] * vals).sum(0)


def delta_rule_fold(state: torch.Tensor, ring: dict[str, torch.Tensor]) -> torch.Tensor:
    """State [H, dk, dv] after folding the n ring entries {k, u, g} into `state`."""
    k, u, g = ring["k"], ring["u"], ring["g"]
    g_all = torch.cat((torch.zeros_like(g[:1]), g), dim=0)
    seg = segsum(g_all)[-1]  # [1+n, H, dk]: decay from each entry (0 = committed) to the end
    kd = seg[1:].exp() * k  # [n, H, dk]
    return seg[0].exp()[..., None] * state + (kd[..., :, None] * u[..., None, :]).sum(0)


# ---- math: Mamba2 SSD ---------------------------------------------------------------------------
def ssd_replay(
    state: torch.Tensor,  # [H, P, N]
    ring: dict[str, torch.Tensor],  # x [n, H, P], B [n, H, N], dt [n, H]
    x: torch.Tensor,  # [T, H, P]
    b: torch.Tensor,  # [T, H, N] (groups expanded to heads)
    c: torch.Tensor,  # [T, H, N]
    dt: torch.Tensor,  # [T, H] (after softplus)
    a: torch.Tensor,  # [H] A = -exp(A_log)
    d: torch.Tensor,  # [H] skip
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Outputs y [T, H, P] of T new tokens and their ring entries {x, B, dt}."""
    n, t_new = ring["x"].shape[0], x.shape[0]
    xs = torch.cat((ring["x"], x), dim=0)  # [n+T, H, P]
    bs = torch.cat((ring["B"], b), dim=0)
    dts = torch.cat((ring["dt"], dt), dim=0)  # [n+T, H]
    lam = torch.cat((torch.zeros_like(dt[:1]), a * dts), dim=0)  # [1+n+T, H]
    seg = segsum(lam)  # [1+n+T, 1+n+T, H]
    outs = []
    for i in range(t_new):
        t = n + i
        a_c = seg[t + 1, 0].exp()  # [H]
        w = dts[: t + 1] * seg[t + 1, 1 : t + 2].exp()  # [t+1, H]
        coef = w * _dot(bs[: t + 1], c[i][None])  # [t+1, H]
        y = a_c[:, None] * _dot(state, c[i][:, None, :]) + (coef[..., None] * xs[: t + 1]).sum(0)
        outs.append(y + d[:, None] * x[i])
    return torch.stack(outs, dim=0), {"x": x, "B": b, "dt": dt}


def ssd_fold(state: torch.Tensor, ring: dict[str, torch.Tensor], a: torch.Tensor) -> torch.Tensor:
    """State [H, P, N] after folding the n ring entries {x, B, dt}."""
    x, b, dt = ring["x"], ring["B"], ring["dt"]
    lam = torch.cat((torch.zeros_like(dt[:1]), a * dt), dim=0)
    seg = segsum(lam)[-1]  # [1+n, H]
    wb = (dt * seg[1:].exp())[..., None] * b  # [n, H, N]
    return seg[0].exp()[:, None, None] * state + (x[..., :, None] * wb[..., None, :]).sum(0)


# ---- the layer protocol and the per-layer cache --------------------------------------------------
class RecurrentMixer(ReferenceLayer, ABC):
    """A recurrent layer as the model runs it: projections, short conv, a state update that can
    run recurrently or by replay, and the output projection. Its per-layer cache is an
    `SSMLayerCache` (fp32 in both modes)."""

    state = "recurrent"
    conv_dim: int
    conv_kernel: int

    def new_cache(self, batch: int, max_seq_len: int, ring_capacity: int,
                  device: torch.device) -> SSMLayerCache:
        return new_layer_cache(self, batch, ring_capacity, device)

    def check_cache(self, cache: Any, batch: int, max_seq_len: int, ring_capacity: int,
                    device: torch.device) -> None:
        if not isinstance(cache, SSMLayerCache):
            raise ReferenceError(f"expected a recurrent layer cache (SSMLayerCache), got "
                                 f"{type(cache).__name__}")
        f32, why = torch.float32, "recurrent state is fp32 in every mode"
        check_tensor("conv window", cache.conv, "[B, C, K-1]",
                     (batch, self.conv_dim, self.conv_kernel - 1), f32, device, why)
        check_tensor("state", cache.state, "[B, *state]", (batch, *self.state_shape()), f32,
                     device, why)
        want = self.ring_shapes() if ring_capacity else {}
        if set(cache.ring) != set(want):
            raise ReferenceError(f"ring entries {sorted(cache.ring)} do not match the model's "
                                 f"{sorted(want)} (ring capacity {ring_capacity})")
        for name, shape in want.items():
            check_tensor(f"ring {name}", cache.ring[name], "[B, capacity, ...]",
                         (batch, ring_capacity, *shape), f32, device, why)
        if ring_capacity:
            check_tensor("ring count", cache.count, "[B]", (batch,), torch.int64, device, why)

    def forward(self, xn: torch.Tensor, cache: SSMLayerCache, lengths: torch.Tensor,
                replay: bool = False, prefill: bool = False) -> torch.Tensor:
        return run_layer(self, cache, xn, replay, prefill)

    @abstractmethod
    def state_shape(self) -> tuple[int, ...]: ...

    @abstractmethod
    def ring_shapes(self) -> dict[str, tuple[int, ...]]: ...

    @abstractmethod
    def project(self, xn: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Normed input [B, T, D] -> (pre-conv input [B, T, C] fp32, other projections)."""

    @abstractmethod
    def conv_params(self) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    @abstractmethod
    def inputs(self, conv: torch.Tensor, aux: dict[str, torch.Tensor], prefill: bool
               ) -> dict[str, torch.Tensor]:
        """Pre-activation conv output [B, T, C] -> per-token SSM inputs, each [B, T, ...]."""

    @abstractmethod
    def step(self, state: torch.Tensor, inp: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token, recurrent: state [B, ...], inputs [B, ...] -> (y [B, ...], new state)."""

    @abstractmethod
    def replay(self, state: torch.Tensor, ring: dict[str, torch.Tensor],
               inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One sequence: committed state, n ring entries, T new tokens -> (y [T, ...], entries)."""

    @abstractmethod
    def fold(self, state: torch.Tensor, ring: dict[str, torch.Tensor]) -> torch.Tensor:
        """One sequence: the committed state after folding n ring entries."""

    @abstractmethod
    def output(self, y: torch.Tensor, aux: dict[str, torch.Tensor]) -> torch.Tensor:
        """Core output y [B, T, ...] -> the mixer's output [B, T, D] (added to the residual)."""


@dataclass
class SSMLayerCache:
    """State of one recurrent layer for a batch of B sequences (all fp32).

    conv:    [B, C, K-1]        committed conv window, oldest input first
    state:   [B, *state_shape]  the recurrent state (recurrent mode: updated every token;
                                ReplaySSM: the committed state S_c, written only at a fold)
    ring:    name -> [B, capacity, *shape]  ReplaySSM input ring (empty in recurrent mode);
             entries 0 .. count[b]-1 are committed, the next ones proposed by the last step
    count:   [B] int64          committed ring entries per sequence
    pending: [B, T, C] or None  pre-conv inputs of the tokens proposed by the last step
    """

    conv: torch.Tensor
    state: torch.Tensor
    ring: dict[str, torch.Tensor] = field(default_factory=dict)
    count: torch.Tensor | None = None
    pending: torch.Tensor | None = None

    def row(self, b: int) -> SSMLayerCache:
        """A batch-1 view of sequence b; writes through it land in this cache."""
        return SSMLayerCache(
            self.conv[b : b + 1], self.state[b : b + 1],
            {k: v[b : b + 1] for k, v in self.ring.items()},
            None if self.count is None else self.count[b : b + 1],
            None if self.pending is None else self.pending[b : b + 1],
        )


def new_layer_cache(mixer: RecurrentMixer, batch: int, capacity: int, device: torch.device | str
                    ) -> SSMLayerCache:
    """Zero state and window; a NaN-filled ring of `capacity` entries (0: recurrent mode)."""
    f32 = torch.float32
    ring = {}
    if capacity:
        ring = {k: torch.full((batch, capacity, *s), float("nan"), dtype=f32, device=device)
                for k, s in mixer.ring_shapes().items()}
    return SSMLayerCache(
        conv=torch.zeros(batch, mixer.conv_dim, mixer.conv_kernel - 1, dtype=f32, device=device),
        state=torch.zeros(batch, *mixer.state_shape(), dtype=f32, device=device),
        ring=ring,
        count=torch.zeros(batch, dtype=torch.int64, device=device) if capacity else None,
    )


def run_layer(mixer: RecurrentMixer, cache: SSMLayerCache, xn: torch.Tensor, replay: bool,
              prefill: bool = False) -> torch.Tensor:
    """Run T tokens [B, T, D] through a recurrent layer.

    Recurrent mode: token by token; state and conv window advance by T.
    Replay mode: all T outputs from the committed state plus the ring; the T new entries are
    written after the committed ones and the pre-conv inputs kept as `pending` until `commit`.
    """
    xc, aux = mixer.project(xn)  # [B, T, C]
    weight, bias = mixer.conv_params()
    inp = mixer.inputs(short_conv(cache.conv, xc, weight, bias), aux, prefill)
    t_new = xc.shape[1]
    if not replay:
        ys = []
        state = cache.state
        for t in range(t_new):
            y, state = mixer.step(state, {k: v[:, t] for k, v in inp.items()})
            ys.append(y)
        cache.state.copy_(state)
        cache.conv.copy_(shift_window(cache.conv, xc))
        return mixer.output(torch.stack(ys, dim=1), aux)
    assert cache.count is not None
    capacity = next(iter(cache.ring.values())).shape[1]
    ys = []
    for b in range(xc.shape[0]):
        n = int(cache.count[b])
        if n + t_new > capacity:
            raise ReferenceError(
                f"ReplaySSM ring overflow: {n} committed + {t_new} new entries exceed the ring "
                f"capacity {capacity}; create the cache with a larger max_step_tokens"
            )
        ring = {k: v[b, :n] for k, v in cache.ring.items()}
        y, entries = mixer.replay(cache.state[b], ring, {k: v[b] for k, v in inp.items()})
        for k, v in entries.items():
            cache.ring[k][b, n : n + t_new] = v
        ys.append(y)
    cache.pending = xc.detach().clone()
    return mixer.output(torch.stack(ys, dim=0), aux)


def commit_layer(mixer: RecurrentMixer, cache: SSMLayerCache, keep: torch.Tensor, window: int
                 ) -> None:
    """Keep the first keep[b] proposed entries of each sequence; fold once `window` is reached."""
    assert cache.pending is not None and cache.count is not None
    for b in range(cache.pending.shape[0]):
        m = int(keep[b])
        cache.conv[b : b + 1] = shift_window(cache.conv[b : b + 1], cache.pending[b : b + 1, :m])
        cache.count[b] += m
        n = int(cache.count[b])
        if n >= window:
            ring = {k: v[b, :n] for k, v in cache.ring.items()}
            cache.state[b] = mixer.fold(cache.state[b], ring)
            for v in cache.ring.values():
                v[b].fill_(float("nan"))  # folded entries must never be read again
            cache.count[b] = 0
    cache.pending = None


def effective_state(mixer: RecurrentMixer, cache: SSMLayerCache) -> torch.Tensor:
    """The state the recurrent update would hold now: S_c with the committed ring entries folded
    in (a copy; the cache is not changed). In recurrent mode, the state itself."""
    out = cache.state.clone()
    if cache.count is None:
        return out
    for b in range(out.shape[0]):
        n = int(cache.count[b])
        if n:
            out[b] = mixer.fold(cache.state[b], {k: v[b, :n] for k, v in cache.ring.items()})
    return out
