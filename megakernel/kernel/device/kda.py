"""KDA_CORE / KDA_REPLAY: Kimi delta attention of one (sequence, head) on one CTA (layers/kda.py),
recurrent or by ReplaySSM.

GDN's handler (gdn.py) with one value head per key head and a channel-wise decay (CHANNEL): its
conv, l2 norms, k.q, state loops, ring and RMSNorm run unchanged on KDAShape's indices. Here only
what KDA adds: the gates (beta, the low-rank decay f_b bf16(f_a x) and gate g_b bf16(g_a x) of the
head's rows), the output gate sigmoid(gate), and ReplaySSM's channel-decayed dots and vectors
(kda_index.py). Shared memory: `KDAShape.smem()["words"]` fp32 from the start of the carve-up.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.config.fields import word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.gdn import GatedDeltaRule, sigmoid, softplus
from megakernel.kernel.device.handler import Step
from megakernel.kernel.device.memory import ld, prefetch_l2, st
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.gdn_index import LANES

GATE_ROWS = 4  # f_b / g_b rows a warp loads at once in the gates (their loads in flight)


class KimiDeltaAttention(GatedDeltaRule):
    CORE, REPLAY, UNIT, CHANNEL = Op.KDA_CORE, Op.KDA_REPLAY, "HEAD", True

    @staticmethod
    def shape_of(spec: KernelSpec):  # noqa: ANN205 (kda_index.KDAShape)
        return spec.shape("kda")

    # ---- phase 2: gates ----------------------------------------------------------------------
    @cute.jit
    def gates(self, b: Int32, h: Int32, proj: Int32, prm: Int32, conv_w: Int64,
              pW: cute.Pointer, pF: cute.Pointer, sS: cute.Tensor, tidx: Int32, warp: Int32,
              lane: Int32):
        """beta[t] = sigmoid(b); lr = bf16(f_a x), bf16(g_a x); then a warp per GATE_ROWS
        (channel i, f or g) rows at a time, the T tokens together (each f_b / g_b row read once,
        all the rows' loads issued before the first sum): g[t][i] = -exp(A_log[h])
        softplus(f_b[h d + i] . lr_f + dt_bias[h d + i]), gate[t][i] = g_b[h d + i] . lr_g."""
        g, sm, T = self.g, self.sm, self.T
        for idx in cutlass.range(tidx, T * 2 * g.d, self.NT, unroll=1):
            t = idx // (2 * g.d)
            which = (idx - t * 2 * g.d) // g.d
            i = idx - (t * 2 + which) * g.d
            x = ld(pF, proj + g.proj(b, t, g.low_rank_col(which, i)))
            sS[sm["lr"] + g.low_rank(t, which, i)] = x.to(BFloat16).to(Float32)
        for t in cutlass.range(tidx, T, self.NT, unroll=1):
            sS[sm["beta"] + t] = sigmoid(ld(pF, proj + g.proj(b, t, g.beta_col(h))))
        cta_sync(self.named)
        U, nc = GATE_ROWS, -(-g.d // LANES)  # rows a warp takes at once; a lane's columns
        scale = -cute.math.exp(ld(pF, prm + h))  # -exp(A_log[h])
        w = cute.make_rmem_tensor((U * nc,), Float32)
        bias = cute.make_rmem_tensor((U,), Float32)
        acc = cute.make_rmem_tensor((U * T,), Float32)
        for p0 in cutlass.range(warp * U, 2 * g.d, self.NW * U, unroll=1):
            for u in cutlass.range_constexpr(U):  # the U rows' loads in flight, then the sums
                p = p0 + u
                which = p // g.d
                i = p - which * g.d
                for c in cutlass.range_constexpr(nc):
                    w[u * nc + c] = Float32(0.0)
                    if (p < 2 * g.d) & (c * LANES + lane < g.d):
                        w[u * nc + c] = ld(pW, conv_w + Int64(g.low_rank_w(
                            which, h, i, c * LANES + lane))).to(Float32)
                bias[u] = Float32(0.0)
                if p < g.d:  # a decay row: its dt_bias
                    bias[u] = ld(pF, prm + g.dt_bias(h, i))
            for u in cutlass.range_constexpr(U):
                which = (p0 + u) // g.d
                for t in cutlass.range_constexpr(T):
                    acc[u * T + t] = Float32(0.0)
                for c in cutlass.range_constexpr(nc):
                    if c * LANES + lane < g.d:
                        for t in cutlass.range_constexpr(T):
                            acc[u * T + t] = acc[u * T + t] + w[u * nc + c] * sS[
                                sm["lr"] + g.low_rank(t, which, c * LANES + lane)]
            for u in cutlass.range_constexpr(U):
                p = p0 + u
                which = p // g.d
                i = p - which * g.d
                for t in cutlass.range_constexpr(T):
                    s = cute.arch.warp_reduction_sum(acc[u * T + t])
                    if (lane == 0) & (p < 2 * g.d):
                        if which == 0:
                            sp = softplus(s + bias[u])
                            sS[sm["g"] + g.decay(t, i)] = scale * sp
                        else:
                            sS[sm["gate"] + g.decay(t, i)] = s

    @cute.jit
    def prefetch(self, op: Int32, s: Step):
        """GDN's state prefetch, and the head's f_b and g_b rows (weights, read once a record)."""
        self.prefetch_state(s.rec, s.state, s.tidx)
        g = self.g
        conv_w = Int64(s.rec[word(Op.GDN_CORE, "CONV_W")])  # GDN's words (gdn.py)
        h = s.rec[word(Op.GDN_CORE, "K_HEAD")]
        for which in cutlass.range_constexpr(2):
            prefetch_l2(s.weights, conv_w + Int64(g.low_rank_w(which, h, 0, 0)),
                        g.d * g.d * 2, s.tidx)

    def out_gate(self, b: Int32, t: Int32, h: Int32, j: Int32, proj: Int32, pF: cute.Pointer,
                 sS: cute.Tensor) -> Float32:
        """The output gate of o[t][j]: sigmoid(gate[t][j])."""
        return sigmoid(sS[self.sm["gate"] + self.g.decay(t, j)])

    def read_vectors(self, t: int) -> tuple[int, int]:
        """r3 reads the committed state with kc: k_t, q_t decayed from the committed state."""
        return self.sm["kc"] + self.g.kc(t, 1, 0), self.sm["kc"] + self.g.kc(t, 0, 0)

    # ---- ReplaySSM (KDA_REPLAY) --------------------------------------------------------------
    @cute.jit
    def ring_gates(self, b: Int32, h: Int32, n: Int32, ne: Int32, st0: Int64, pS: cute.Pointer,
                   sS: cute.Tensor, tidx: Int32):
        """r1's gs [CAP][d] of the ne entries: the n committed g [d] from the ring, the new ones
        appended to it."""
        g, sm = self.g, self.sm
        for idx in cutlass.range(tidx, ne * g.d, self.NT, unroll=1):
            e = idx // g.d
            i = idx - e * g.d
            at = st0 + Int64(g.ring_g(b, e, h, i))
            v = Float32(0.0)
            if e < n:
                v = ld(pS, at)
            else:
                v = sS[sm["g"] + g.decay(e - n, i)]
                st(pS, at, v)
            sS[sm["gs"] + g.gs_c(e, i)] = v

    @cute.jit
    def dots(self, n: Int32, sS: cute.Tensor, warp: Int32, lane: Int32):
        """r2: dots[t][0 | 1][e] = sum_i e^{G_i(e, n + t]} k_e[i] (k_t | q_t)[i], a warp per
        (entry, token, k or q); and a thread per element: kf[e][i] = e^{G_i(e, n + T)} k_e[i],
        kc[t][0 | 1][i] = e^{G_i[0, n + t]} (q_t | k_t)[i], tot[i] = e^{G_i[0, n + T)}."""
        g, sm, T, per = self.g, self.sm, self.T, 2 * self.T
        for p in cutlass.range(warp, (n + T) * per, self.NW, unroll=1):
            e = p // per
            t = (p - e * per) // 2
            which = p - e * per - 2 * t
            base = sm["x"] + t * g.ch + (1 - which) * g.dk  # k of token t, or its q
            d = Float32(0.0)
            for i in cutlass.range(lane, g.dk, LANES, unroll=1):
                seg = Float32(0.0)
                for ee in cutlass.range(e + 1, n + t + 1, unroll=1):
                    seg = seg + sS[sm["gs"] + g.gs_c(ee, i)]
                d = d + cute.math.exp(seg) * sS[sm["keys"] + g.key(e, i)] * sS[base + i]
            d = cute.arch.warp_reduction_sum(d)
            if lane == 0:
                sS[sm["dots"] + g.dot(t, which, e)] = d
        tidx = warp * LANES + lane
        if cutlass.const_expr(not self.drafts):  # (speculative: COMMIT folds)
            self.fold_vectors(n + T, sS, tidx)
        for idx in cutlass.range(tidx, T * g.d, self.NT, unroll=1):
            t = idx // g.d
            i = idx - t * g.d
            seg = Float32(0.0)
            for ee in cutlass.range(n + t + 1, unroll=1):
                seg = seg + sS[sm["gs"] + g.gs_c(ee, i)]
            a = cute.math.exp(seg)
            xt = sm["x"] + t * g.ch
            sS[sm["kc"] + g.kc(t, 0, i)] = a * sS[xt + i]
            sS[sm["kc"] + g.kc(t, 1, i)] = a * sS[xt + g.dk + i]

    @cute.jit
    def fold_vectors(self, ne: Int32, sS: cute.Tensor, tidx: Int32):
        """The fold's decayed keys and total decay of the ne entries, a thread per element:
        kf[e][i] = e^{G_i(e, ne)} k_e[i], tot[i] = e^{G_i[0, ne)} (KDA_REPLAY's r2 and
        KDA_COMMIT's fold, kernel/device/commit.py)."""
        g, sm = self.g, self.sm
        for idx in cutlass.range(tidx, ne * g.d, self.NT, unroll=1):
            e = idx // g.d
            i = idx - e * g.d
            seg = Float32(0.0)
            for ee in cutlass.range(e + 1, ne, unroll=1):
                seg = seg + sS[sm["gs"] + g.gs_c(ee, i)]
            sS[sm["kf"] + g.gs_c(e, i)] = cute.math.exp(seg) * sS[sm["keys"] + g.key(e, i)]
        for i in cutlass.range(tidx, g.d, self.NT, unroll=1):
            seg = Float32(0.0)
            for ee in cutlass.range(ne, unroll=1):
                seg = seg + sS[sm["gs"] + g.gs_c(ee, i)]
            sS[sm["tot"] + i] = cute.math.exp(seg)
