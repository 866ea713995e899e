"""A numpy emulation of the MoE expert handlers (EXPERT_GATEUP / EXPERT_DOWN on the matvec
handler, MOE_COMBINE; kernel/device/moe.py), walked with the kernel's own index helpers
(kernel/host/moe_index.py), against the CPU executor's ops record by record.

kimi-linear-tiny (8 experts, top 3, one shared expert) at B, T in {1, 4}; the router's choice is
replaced by chosen expert ids (rows sharing experts, ids not in increasing order within a row,
tied weights, experts no row picks and, from N = 4 rows on, unbound work-list slots), the work
list built from them with layers/moe.work_list. Around every expert record the executor runs, the
emulation:
- binds the record (moe_index.binding) and checks the slab against the one the executor reads
  (its W moved to the slot's expert, nothing read for an unbound slot);
- builds the loader's tile plan (spec.matvec_tiles over moe_index.passes) and the consumers'
  (run_piped's loop nest over the live pair rows): they must agree, cover the executor's slab once
  per pass, and be empty for an unbound slot;
- runs the consumers' passes (pair rows -> activation / expert slot rows, moe_index) and compares
  the whole act_moe / moe_y region with the executor's: routed rows written, no other row touched.
MOE_COMBINE: the selection walk in increasing expert id, then the shared expert, fp32 in that
order, bit-identical to the executor's h.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megakernel.executor.ops.moe as ex_moe
from megakernel.executor import Executor
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host import moe_index as mi
from megakernel.kernel.host.limits import tile_rows
from megakernel.kernel.host.plans import matvec_tiles
from megakernel.layers.moe import work_list
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from megakernel.program.pack import pack_weights

F = np.float32
NAME = "kimi-linear-tiny"


def _choose(n: int, e, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, top_k], ids [N, top_k]): ids from a pool that leaves experts unpicked (all
    of them at N = 1), in no particular order within a row; slots 0 and 1 tied in weight."""
    pool = torch.tensor([6, 1, 4, 7]) if n > 1 else torch.arange(e.num_experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[: e.top_k]]
                       for _ in range(n)])
    wts = torch.rand(n, e.top_k, generator=g) + 0.1
    wts[:, 1] = wts[:, 0]
    return wts, ids


class Emulation:
    """Checks every expert and combine record as the executor runs it (module docstring)."""

    def __init__(self, ex: Executor, spec) -> None:  # noqa: ANN001 (KernelSpec)
        self.ex, self.spec = ex, spec
        self.e = next(b.cfg for b in ex.cfg.blocks if b.kind == "moe")
        self.n, self.h = ex.prog.rows, ex.cfg.hidden_size
        self.slots = self.e.top_k + 1
        self.stride = mi.x_stride(self.e.intermediate_size, self.h)
        self.reads: list[tuple[int, int, int]] = []  # the executor's expert slabs (W, NROWS, K)
        self.checked = {"EXPERT_GATEUP": 0, "EXPERT_DOWN": 0, "MOE_COMBINE": 0, "unbound": 0}
        slab = ex.slab

        def logged(d: dict) -> torch.Tensor:
            if d["OPCODE"].name.startswith("EXPERT"):
                self.reads.append((d["W"], d["NROWS"], d["K"]))
            return slab(d)

        ex.slab = logged
        ex.ops = dict(ex.ops)  # the op table is shared: wrap this executor's copy
        for name in ("EXPERT_GATEUP", "EXPERT_DOWN", "MOE_COMBINE"):
            ex.ops[name] = self.wrap(name, ex.ops[name])

    def wrap(self, name: str, fn):  # noqa: ANN001, ANN202
        def run(ex: Executor, d: dict, epoch: int):  # noqa: ANN202
            before = {a: getattr(ex, a).clone() for a in ("f32", "bf16", "i32")}
            self.reads.clear()
            out = fn(ex, d, epoch)
            (self.combine if name == "MOE_COMBINE" else self.expert)(name, d, before)
            self.checked[name] += 1
            return out
        return run

    # ---- expert records ------------------------------------------------------------------------
    def expert(self, name: str, d: dict, before: dict) -> None:
        ex, n, e, s = self.ex, self.n, self.e, self.spec
        work = before["i32"][d["WORK_OFF"] : d["WORK_OFF"] + e.work_slots(n) * (2 + n)]
        work = work.view(-1, 2 + n).tolist()
        w, pairs = mi.binding(d["SLOT"], work, d["W"], self.stride, n)
        live = len(pairs)
        nrows, k = d["NROWS"], d["K"]
        # the slab read: the executor's bound slab, none for an unbound slot
        assert self.reads == ([(w, nrows, k)] if live else []), (name, d["SLOT"], self.reads)
        self.checked["unbound"] += live == 0
        # loader and consumers stream / read the same tiles of the bound slab
        loader = [(w, *t) for t in matvec_tiles(nrows, k, mi.passes(live, s.no), s.k_chunk,
                                                 s.num_warps)]
        assert loader == self.consumer_tiles(w, nrows, k, live)
        per_pass: dict[int, int] = {}
        for t in loader:
            per_pass[t[1]] = per_pass.get(t[1], 0) + t[3] * t[5]
        assert per_pass == {p: nrows * k for p in range(mi.passes(live, s.no))}
        # the consumers' passes over the pair rows
        rows = [mi.shared_rows(i, e.top_k, self.slots) if d["SLOT"] == mi.SHARED
                else mi.pair_rows(p, e.top_k, self.slots) for i, p in enumerate(pairs)]
        slab = ex.weights[w : w + nrows * k].view(nrows, k).float().numpy()
        gate = name == "EXPERT_GATEUP"
        width = e.intermediate_size if gate else self.h
        buf = "bf16" if gate else "f32"
        region = (d["OUT_OFF"], d["OUT_OFF"] + n * self.slots * width)
        want = before[buf][region[0] : region[1]].float().numpy().reshape(-1, width).copy()
        for n0 in range(0, live, s.no):
            x = np.stack([self.stage(d, before, *rows[i], gate) for i in
                          range(n0, min(live, n0 + s.no))])  # [rows, K] bf16 as fp32
            acc = (x @ slab.T).astype(F)  # [rows, NROWS]
            for i, (_an, q) in enumerate(rows[n0 : n0 + s.no]):
                if gate:
                    blk = acc[i].reshape(-1, 2, 16)
                    g, u = blk[:, 0].reshape(-1), blk[:, 1].reshape(-1)
                    y = g / (F(1) + np.exp(-g)) * u
                    c0 = d["ROW0"] // 2
                    want[q, c0 : c0 + nrows // 2] = torch.tensor(y).bfloat16().float().numpy()
                else:
                    want[q, d["ROW0"] : d["ROW0"] + nrows] = acc[i]
        got = getattr(ex, buf)[region[0] : region[1]].float().numpy().reshape(-1, width)
        tol = dict(rtol=2 ** -7, atol=1e-3) if gate else dict(rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got, want, equal_nan=True, **tol, err_msg=f"{name} {d}")

    def stage(self, d: dict, before: dict, an: int, q: int, gate: bool) -> np.ndarray:
        """The staged input row of pair (activation row an, expert slot row q): bf16
        RMSNorm(h[an]) * w (gate/up) or act_moe[q] (down)."""
        k = d["K"]
        if not gate:
            return before["bf16"][d["IN_OFF"] + q * k : d["IN_OFF"] + (q + 1) * k].float().numpy()
        h = before["f32"][d["IN_OFF"] + an * k : d["IN_OFF"] + (an + 1) * k].double()
        rstd = 1.0 / torch.sqrt(h.pow(2).mean() + self.ex.eps)
        y = h * rstd * self.ex.norm_weight(d["NORM_OFF"], k).double()
        return y.bfloat16().float().numpy()

    def consumer_tiles(self, w: int, nrows: int, k: int, live: int) -> list[tuple]:
        """Matvec.run_piped's loop nest: passes of NO live rows > ROW_CHUNK > K-chunk > tile."""
        s, out = self.spec, []
        tr = tile_rows(min(s.k_chunk, k), s.num_warps)
        for n0 in range(0, live, s.no):
            for rc0 in range(0, nrows, s.row_chunk):
                nr = min(s.row_chunk, nrows - rc0)
                for kc0 in range(0, k, s.k_chunk):
                    for t0 in range(0, nr, tr):
                        out.append((w, n0 // s.no, rc0 + t0, min(tr, nr - t0), kc0,
                                    min(s.k_chunk, k - kc0)))
        return out

    # ---- MOE_COMBINE ---------------------------------------------------------------------------
    def combine(self, name: str, d: dict, before: dict) -> None:
        n, e, h = self.n, self.e, self.h
        f32 = before["f32"].numpy()
        ids = before["i32"][d["IDS_OFF"] : d["IDS_OFF"] + n * e.top_k].view(n, e.top_k).tolist()
        wts = f32[d["WTS_OFF"] : d["WTS_OFF"] + n * e.top_k].reshape(n, e.top_k)
        y = f32[d["Y_OFF"] : d["Y_OFF"] + n * self.slots * h].reshape(n, self.slots, h)
        cols = slice(d["ROW0"], d["ROW0"] + d["NROWS"])
        want = f32[d["OUT_OFF"] : d["OUT_OFF"] + n * h].reshape(n, h).copy()
        for t in range(n):
            acc = np.zeros(d["NROWS"], dtype=F)
            prev = mi.WALK_START[0]
            for _ in range(e.top_k):  # the device's selection walk
                best, pick = mi.WALK_START[1], 0
                for s in range(e.top_k):
                    if mi.takes(ids[t][s], prev, best):
                        best, pick = ids[t][s], s
                prev = best
                acc = acc + y[t, pick, cols] * wts[t, pick]
            acc = acc + y[t, e.top_k, cols]
            want[t, cols] = want[t, cols] + acc
        got = self.ex.f32[d["OUT_OFF"] : d["OUT_OFF"] + n * h].numpy().reshape(n, h)
        np.testing.assert_array_equal(got, want, err_msg=f"{name} {d}")


@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (4, 1), (1, 4), (4, 4)])
def test_expert_handlers_match_the_executor(batch: int, tokens: int, monkeypatch) -> None:
    cfg = preset(NAME)
    g = torch.Generator().manual_seed(100 * batch + tokens)
    e = next(b.cfg for b in cfg.blocks if b.kind == "moe")
    chosen = []

    def route(*_a):  # noqa: ANN002, ANN202
        chosen.append(_choose(batch * tokens, e, g))
        return chosen[-1]

    monkeypatch.setattr(ex_moe, "route", route)
    prog = compile_program(cfg, batch, gpu("h100").with_sms(8), tokens=tokens,
                           max_seq_len=2 * tokens)
    ex = Executor(prog, pack_weights(cfg, random_weights(cfg, seed=batch + tokens)))
    emu = Emulation(ex, make_spec(cfg, batch, tokens, "sm_90a"))
    ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=g))
    layers = sum(b.kind == "moe" for b in cfg.blocks)
    assert len(chosen) == layers
    n = batch * tokens
    assert torch.equal(ex.region("i32", "moe_work").view(-1, 2 + n),
                       work_list(chosen[-1][1], e.num_experts))
    assert min(emu.checked[k] for k in ("MOE_COMBINE", "EXPERT_GATEUP", "EXPERT_DOWN")) > 0
    # N > 1: the pool leaves work-list slots unbound, and the test saw them
    assert (emu.checked["unbound"] > 0) == (n > 1)


def test_combine_order_is_increasing_expert_id() -> None:
    assert mi.combine_order([6, 1, 4]) == [1, 2, 0]
    assert mi.combine_order([0, 7, 3]) == [0, 2, 1]
