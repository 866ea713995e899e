"""GDN_CORE / GDN_REPLAY: the gated delta rule of one (sequence, key head) on one CTA
(layers/gdn.py), recurrent or by ReplaySSM (a build runs one of the two: KernelSpec.replay_window).

conv over the fp32 window -> gates and l2 norms in shared memory -> the value heads' states
through registers in column tiles (read once, written once, all T tokens applied in between) ->
gated RMSNorm -> bf16 ssm_out. GDN_REPLAY shares the conv, gates, norms and output and replaces
the state phase by the ring (committed k, g and the new entries in shared memory), the dots of
the entries' keys with the tokens' k and q, and the committed state's column tiles (read once,
written only at a fold). The phases, the thread mapping and every index are in gdn_index.py
(plain arithmetic, emulated on the host by the tests). Shared memory: a span of
`GDNShape.smem()["words"]` fp32 from the start of the carve-up (KernelSpec.recurrent_smem_bytes),
over the consumers' per-record regions. All math in fp32, as the executor's (the reference's).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel import isa
from megakernel.isa import Op
from megakernel.kernel.config.fields import FieldError, shared_word, word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.handler import Handler, Step
from megakernel.kernel.device.memory import join64, ld, prefetch_l2, st
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.gdn_index import L2NORM_EPS, LANES, SOFTPLUS_LINEAR


def silu(x: Float32) -> Float32:
    return x / (Float32(1.0) + cute.math.exp(-x))


def sigmoid(x: Float32) -> Float32:
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


@cute.jit
def softplus(x: Float32) -> Float32:
    """log(1 + e^x), x itself above SOFTPLUS_LINEAR (torch's threshold)."""
    sp = x
    if x <= Float32(SOFTPLUS_LINEAR):
        sp = cute.math.log1p(cute.math.exp(x))
    return sp


class GatedDeltaRule(Handler):
    """GDN_CORE / GDN_REPLAY. A subclass sets the opcodes, the record's unit field, its shape and
    CHANNEL (a per-channel decay [dk] per token instead of a scalar per value head:
    kernel/device/kda.py); the state loops branch on CHANNEL at trace time, so a GDN build compiles
    what it did."""

    CORE, REPLAY, UNIT, CHANNEL = Op.GDN_CORE, Op.GDN_REPLAY, "K_HEAD", False  # the unit field

    @staticmethod
    def shape_of(spec: KernelSpec):  # noqa: ANN205 (gdn_index.GDNShape)
        return spec.shape("gdn")

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.g = self.shape_of(spec)
        self.named = spec.num_threads if spec.pipelined else 0  # consumer barrier (pipeline.py)
        self.NT, self.NW, self.T = spec.num_threads, spec.num_warps, spec.tokens
        self.eps = spec.eps
        self.sm = self.g.smem()  # word offsets in the scratch span
        self.replay = spec.replay_window > 0  # GDN_REPLAY (ReplaySSM) instead of GDN_CORE
        # a speculative step: the T conv inputs go to `pending`, the ring entries are appended
        # but count, window and state wait for the COMMIT record (kernel/device/commit.py)
        self.drafts = spec.drafts > 0
        self.op = self.REPLAY if self.replay else self.CORE
        # records are read by GDN_CORE's words (the unit K_HEAD, COUNT_OFF by GDN_REPLAY's): the
        # subclass's ops must hold their operands there (FieldError if they ever differ)
        unit = {self.UNIT: "K_HEAD"}
        for name in isa.spec(self.REPLAY).names:
            mine = word(self.REPLAY, name)
            if mine != word(Op.GDN_REPLAY, unit.get(name, name)) or (
                    name != "COUNT_OFF" and mine != word(self.CORE, name)):
                raise FieldError(f"{isa.spec(self.REPLAY).name} operand {name} is not at "
                                 f"GDN's word")
        for name in isa.spec(Op.GDN_CORE).names:
            shared_word((Op.GDN_CORE, Op.GDN_REPLAY), name)

    @cute.jit
    def prefetch(self, op: Int32, s: Step):
        self.prefetch_state(s.rec, s.state, s.tidx)

    @cute.jit
    def run(self, op: Int32, s: Step):
        self.core(s.rec, s.weights, s.f32, s.bf16, s.i32, s.state, s.sScratch, s.tidx, s.warp,
                  s.lane)

    @cute.jit
    def core(self, rec: cute.Tensor, pW: cute.Pointer, pF: cute.Pointer, pB: cute.Pointer,
             pI: cute.Pointer, pS: cute.Pointer, sS: cute.Tensor, tidx: Int32, warp: Int32,
             lane: Int32):
        b, kh = rec[word(Op.GDN_CORE, "B_IDX")], rec[word(Op.GDN_CORE, "K_HEAD")]
        proj, prm = rec[word(Op.GDN_CORE, "PROJ_OFF")], rec[word(Op.GDN_CORE, "PARAM_OFF")]
        # the layer's block
        st0 = join64(rec[word(Op.GDN_CORE, "STATE_LO")], rec[word(Op.GDN_CORE, "STATE_HI")])
        cta_sync(self.named)  # the scratch span is free: the previous record is done with it
        conv_w, norm_w = rec[word(Op.GDN_CORE, "CONV_W")], rec[word(Op.GDN_CORE, "NORM_W")]
        self.conv(b, kh, proj, Int64(conv_w), st0, pW, pF, pS, sS, tidx)
        self.gates(b, kh, proj, prm, Int64(conv_w), pW, pF, sS, tidx, warp, lane)
        cta_sync(self.named)
        self.l2_norms(sS, warp, lane)
        cta_sync(self.named)
        if cutlass.const_expr(self.replay):
            n = ld(pI, rec[word(Op.GDN_REPLAY, "COUNT_OFF")] + self.g.count(b, kh))  # (< L)
            self.ring(b, kh, n, n + self.T, st0, pS, sS, tidx)
            cta_sync(self.named)
            self.dots(n, sS, warp, lane)
            cta_sync(self.named)
            fold = n + self.T >= self.g.replay_window
            self.replay_states(b, kh, n, fold, st0, pS, sS, warp, lane)
            if cutlass.const_expr(not self.drafts):  # (speculative: COMMIT counts and folds)
                if tidx == 0:  # read by this record only, at the next step
                    new = n + self.T
                    if fold:
                        new = Int32(0)
                    st(pI, rec[word(Op.GDN_REPLAY, "COUNT_OFF")] + self.g.count(b, kh), new)
        else:
            self.kq(sS, warp, lane)
            cta_sync(self.named)
            self.states(b, kh, st0, pS, sS, warp, lane)
        cta_sync(self.named)
        self.output(b, kh, proj, Int64(norm_w), rec[word(Op.GDN_CORE, "OUT_OFF")], pW, pF, pB,
                    sS, warp, lane)

    # ---- phase 1: the short causal conv ------------------------------------------------------
    @cute.jit
    def conv(self, b: Int32, kh: Int32, proj: Int32, conv_w: Int64, st0: Int64,
             pW: cute.Pointer, pF: cute.Pointer, pS: cute.Pointer, sS: cute.Tensor, tidx: Int32):
        """x[t][c] = silu(sum_j taps[chan, j] u[t + j]), u = [window | T new inputs]; the last
        K - 1 of u become the window (a speculative step: the T inputs go to `pending`, the
        window stays). A thread per channel."""
        g, T, W = self.g, self.T, self.g.win
        x0 = self.sm["x"]
        for c in cutlass.range(tidx, g.ch, self.NT, unroll=1):
            chan = g.channel(c, kh, cutlass.min)
            u = cute.make_rmem_tensor((W + T,), Float32)
            for j in cutlass.range_constexpr(W):
                u[j] = ld(pS, st0 + Int64(g.window(b, chan, j)))
            for t in cutlass.range_constexpr(T):
                u[W + t] = ld(pF, proj + g.proj(b, t, chan))
            taps = conv_w + Int64(chan * g.conv_k)
            for t in cutlass.range_constexpr(T):
                acc = Float32(0.0)
                for j in cutlass.range_constexpr(g.conv_k):
                    acc = acc + u[t + j] * ld(pW, taps + j).to(Float32)
                sS[x0 + t * g.ch + c] = silu(acc)
            if cutlass.const_expr(self.drafts):
                for t in cutlass.range_constexpr(T):
                    st(pS, st0 + Int64(g.pending(b, chan, t)), u[W + t])
            else:
                for j in cutlass.range_constexpr(W):
                    st(pS, st0 + Int64(g.window(b, chan, j)), u[T + j])

    # ---- phase 2: gates, norms, k.q ----------------------------------------------------------
    @cute.jit
    def gates(self, b: Int32, kh: Int32, proj: Int32, prm: Int32, conv_w: Int64,
              pW: cute.Pointer, pF: cute.Pointer, sS: cute.Tensor, tidx: Int32, warp: Int32,
              lane: Int32):
        """beta[t][r] = sigmoid(b), g[t][r] = -exp(A_log) softplus(a + dt_bias) of value head
        h = kh R + r (params row: A_log [Hv], dt_bias [Hv])."""
        g = self.g
        for idx in cutlass.range(tidx, self.T * g.rep, self.NT, unroll=1):
            t = idx // g.rep
            h = kh * g.rep + idx - t * g.rep
            bb = ld(pF, proj + g.proj(b, t, g.beta_col(h)))
            aa = ld(pF, proj + g.proj(b, t, g.a_col(h))) + ld(pF, prm + g.hv + h)
            sS[self.sm["beta"] + idx] = sigmoid(bb)
            sS[self.sm["g"] + idx] = -cute.math.exp(ld(pF, prm + h)) * softplus(aa)

    @cute.jit
    def l2_norms(self, sS: cute.Tensor, warp: Int32, lane: Int32):
        """q, k of each token scaled by rsqrt(sum^2 + 1e-6) in place (q also by dk^-1/2): one
        warp per (token, q or k)."""
        g = self.g
        for p in cutlass.range(warp, 2 * self.T, self.NW, unroll=1):
            t = p // 2
            base = self.sm["x"] + t * g.ch + (p - 2 * t) * g.dk
            ss = Float32(0.0)
            for i in cutlass.range(lane, g.dk, LANES, unroll=1):
                ss = ss + sS[base + i] * sS[base + i]
            ss = cute.arch.warp_reduction_sum(ss)
            scale = Float32(1.0) / cute.math.sqrt(ss + Float32(L2NORM_EPS))
            if p - 2 * t == 0:
                scale = scale * Float32(g.dk ** -0.5)
            for i in cutlass.range(lane, g.dk, LANES, unroll=1):
                sS[base + i] = sS[base + i] * scale

    @cute.jit
    def kq(self, sS: cute.Tensor, warp: Int32, lane: Int32):
        """kq[t] = k . q of token t (both normalised): one warp per token."""
        g = self.g
        for t in cutlass.range(warp, self.T, self.NW, unroll=1):
            base = self.sm["x"] + t * g.ch
            d = Float32(0.0)
            for i in cutlass.range(lane, g.dk, LANES, unroll=1):
                d = d + sS[base + g.dk + i] * sS[base + i]
            d = cute.arch.warp_reduction_sum(d)
            if lane == 0:
                sS[self.sm["kq"] + t] = d

    # ---- phase 3: the states through registers -----------------------------------------------
    @cute.jit
    def states(self, b: Int32, kh: Int32, st0: Int64, pS: cute.Pointer, sS: cute.Tensor,
               warp: Int32, lane: Int32):
        """Per column tile: S [rows of this warp, column of this lane] in registers for the T
        tokens: u = beta (v - e^g S^T k), o = e^g S^T q + (k.q) u, S <- e^g S + k u^T."""
        g, T, RPW = self.g, self.T, self.g.rpw
        sm = self.sm
        live = lane < g.cw  # lanes past a narrow head (dv < 32) run on lane CW - 1's column
        col = cutlass.min(lane, Int32(g.cw - 1))
        buf = Int32(0)
        s_reg = cute.make_rmem_tensor((RPW,), Float32)
        for it in cutlass.range(g.rep * g.tiles, unroll=1):
            r, j = g.tile_column(it, col)
            h = kh * g.rep + r
            for rr in cutlass.range_constexpr(RPW):
                s_reg[rr] = ld(pS, st0 + Int64(g.state(b, h, warp * RPW + rr, j)))
            for t in cutlass.range_constexpr(T):
                xt = sm["x"] + t * g.ch
                if cutlass.const_expr(self.CHANNEL):  # diag(e^g) on this thread's rows first
                    for rr in cutlass.range_constexpr(RPW):
                        s_reg[rr] = s_reg[rr] * cute.math.exp(
                            sS[sm["g"] + g.decay(t, warp * RPW + rr)])
                pk = Float32(0.0)
                pq = Float32(0.0)
                for rr in cutlass.range_constexpr(RPW):
                    pk = pk + s_reg[rr] * sS[xt + g.dk + warp * RPW + rr]
                    pq = pq + s_reg[rr] * sS[xt + warp * RPW + rr]
                sS[sm["part"] + g.part(buf, warp, 0, col)] = pk
                sS[sm["part"] + g.part(buf, warp, 1, col)] = pq
                cta_sync(self.named)  # every warp's partials of this token
                tk = Float32(0.0)
                tq = Float32(0.0)
                for w in cutlass.range_constexpr(self.NW):
                    tk = tk + sS[sm["part"] + g.part(buf, w, 0, col)]
                    tq = tq + sS[sm["part"] + g.part(buf, w, 1, col)]
                a = Float32(1.0)  # the scalar decay (CHANNEL: applied to the rows above)
                if cutlass.const_expr(not self.CHANNEL):
                    a = cute.math.exp(sS[sm["g"] + t * g.rep + r])
                u = sS[sm["beta"] + t * g.rep + r] * (sS[xt + 2 * g.dk + r * g.dv + j] - a * tk)
                if warp == 0:
                    if live:
                        sS[sm["o"] + (t * g.rep + r) * g.dv + j] = a * tq + sS[sm["kq"] + t] * u
                for rr in cutlass.range_constexpr(RPW):
                    s_reg[rr] = a * s_reg[rr] + sS[xt + g.dk + warp * RPW + rr] * u
                buf = 1 - buf  # the next token's partials go to the other buffer
            if live:
                for rr in cutlass.range_constexpr(RPW):
                    st(pS, st0 + Int64(g.state(b, h, warp * RPW + rr, j)), s_reg[rr])

    # ---- ReplaySSM (GDN_REPLAY): r1-r3 of gdn_index.py ----------------------------------------
    @cute.jit
    def ring(self, b: Int32, kh: Int32, n: Int32, ne: Int32, st0: Int64, pS: cute.Pointer,
             sS: cute.Tensor, tidx: Int32):
        """r1: keys [e] and gs [r][e] for the ne entries (n + T; a COMMIT's fold: n = ne): the
        n committed ones from the ring (read once), the new normalised k and g from shared
        memory (appended to the ring)."""
        g, sm = self.g, self.sm
        for idx in cutlass.range(tidx, ne * g.dk, self.NT, unroll=1):
            e = idx // g.dk
            i = idx - e * g.dk
            at = st0 + Int64(g.ring_k(b, e, kh, i))
            v = Float32(0.0)
            if e < n:
                v = ld(pS, at)
            else:
                v = sS[sm["x"] + (e - n) * g.ch + g.dk + i]
                st(pS, at, v)
            sS[sm["keys"] + g.key(e, i)] = v
        self.ring_gates(b, kh, n, ne, st0, pS, sS, tidx)

    @cute.jit
    def ring_gates(self, b: Int32, kh: Int32, n: Int32, ne: Int32, st0: Int64, pS: cute.Pointer,
                   sS: cute.Tensor, tidx: Int32):
        """r1's gs [R][CAP] of the ne entries: the n committed g from the ring, the new ones
        appended to it."""
        g, sm = self.g, self.sm
        for idx in cutlass.range(tidx, ne * g.rep, self.NT, unroll=1):
            e = idx // g.rep
            r = idx - e * g.rep
            at = st0 + Int64(g.ring_g(b, e, kh * g.rep + r))
            v = Float32(0.0)
            if e < n:
                v = ld(pS, at)
            else:
                v = sS[sm["g"] + (e - n) * g.rep + r]
                st(pS, at, v)
            sS[sm["gs"] + g.gs(r, e)] = v

    @cute.jit
    def dots(self, n: Int32, sS: cute.Tensor, warp: Int32, lane: Int32):
        """r2: dots[t][0 | 1][e] = k_e . k_t | k_e . q_t for every entry e < n + T: one warp per
        (entry, token, k or q), one reduction at a time (register pressure)."""
        g, sm, per = self.g, self.sm, 2 * self.T
        for p in cutlass.range(warp, (n + self.T) * per, self.NW, unroll=1):
            e = p // per
            t = (p - e * per) // 2
            which = p - e * per - 2 * t
            base = sm["x"] + t * g.ch + (1 - which) * g.dk  # k of token t, or its q
            d = Float32(0.0)
            for i in cutlass.range(lane, g.dk, LANES, unroll=1):
                d = d + sS[sm["keys"] + g.key(e, i)] * sS[base + i]
            d = cute.arch.warp_reduction_sum(d)
            if lane == 0:
                sS[sm["dots"] + g.dot(t, which, e)] = d

    @cute.jit
    def replay_states(self, b: Int32, kh: Int32, n: Int32, fold, st0: Int64, pS: cute.Pointer,
                      sS: cute.Tensor, warp: Int32, lane: Int32):
        """r3: per column tile, S_c [rows of this warp, column of this lane] in registers; the
        partial S_c^T k, S_c^T q of all T tokens; warp 0 solves u and o of its column; at a fold
        every warp folds its rows over the n + T entries and writes them."""
        g, T, RPW, sm = self.g, self.T, self.g.rpw, self.sm
        live = lane < g.cw  # lanes past a narrow head (dv < 32) run on lane CW - 1's column
        col = cutlass.min(lane, Int32(g.cw - 1))
        s_reg = cute.make_rmem_tensor((RPW,), Float32)
        for it in cutlass.range(g.rep * g.tiles, unroll=1):
            r, j = g.tile_column(it, col)
            h = kh * g.rep + r
            for rr in cutlass.range_constexpr(RPW):
                s_reg[rr] = ld(pS, st0 + Int64(g.state(b, h, warp * RPW + rr, j)))
            for t in cutlass.range_constexpr(T):
                kt, qt = self.read_vectors(t)
                pk = Float32(0.0)
                pq = Float32(0.0)
                for rr in cutlass.range_constexpr(RPW):
                    pk = pk + s_reg[rr] * sS[kt + warp * RPW + rr]
                    pq = pq + s_reg[rr] * sS[qt + warp * RPW + rr]
                sS[sm["part"] + g.part(t, warp, 0, col)] = pk
                sS[sm["part"] + g.part(t, warp, 1, col)] = pq
            cta_sync(self.named)  # every warp's partials of every token
            if warp == 0:
                self.solve(b, h, r, j, col, live, n, st0, pS, sS)
            cta_sync(self.named)  # ut complete
            if cutlass.const_expr(not self.drafts):  # (speculative: COMMIT folds)
                if fold:
                    self.fold_tile(r, col, n + T, sS, warp, s_reg)
                    if live:
                        for rr in cutlass.range_constexpr(RPW):
                            st(pS, st0 + Int64(g.state(b, h, warp * RPW + rr, j)), s_reg[rr])

    @cute.jit
    def fold_tile(self, r: Int32, col: Int32, ne: Int32, sS: cute.Tensor, warp: Int32,
                  s_reg: cute.Tensor):
        """The fold of a column tile (this warp's rows of column col of value head r, S_c in
        s_reg) over the ne entries: S <- e^{G} S_c + sum_e decay(e) k_e u_e^T, the entries'
        keys and gs (CHANNEL: kf and tot) and the tile's ut in shared memory. GDN_REPLAY's
        fold and GDN_COMMIT's (kernel/device/commit.py) both run it."""
        g, RPW, sm = self.g, self.g.rpw, self.sm
        if cutlass.const_expr(self.CHANNEL):  # decays in tot and kf (kda_index.py)
            for rr in cutlass.range_constexpr(RPW):
                s_reg[rr] = sS[sm["tot"] + warp * RPW + rr] * s_reg[rr]
            for e in cutlass.range(ne, unroll=1):
                c = sS[sm["ut"] + g.ut(e, col)]
                for rr in cutlass.range_constexpr(RPW):
                    s_reg[rr] = s_reg[rr] + sS[sm["kf"] + g.gs_c(e, warp * RPW + rr)] * c
        else:
            tot = Float32(0.0)  # log-decay over every entry: the committed state's
            for e in cutlass.range(ne, unroll=1):
                tot = tot + sS[sm["gs"] + g.gs(r, e)]
            a = cute.math.exp(tot)
            for rr in cutlass.range_constexpr(RPW):
                s_reg[rr] = a * s_reg[rr]
            seg = Float32(0.0)  # log-decay over the entries after e
            for jj in cutlass.range(ne, unroll=1):
                e = ne - 1 - jj
                c = cute.math.exp(seg) * sS[sm["ut"] + g.ut(e, col)]
                for rr in cutlass.range_constexpr(RPW):
                    s_reg[rr] = s_reg[rr] + sS[sm["keys"] + g.key(e, warp * RPW + rr)] * c
                seg = seg + sS[sm["gs"] + g.gs(r, e)]

    @cute.jit
    def solve(self, b: Int32, h: Int32, r: Int32, j: Int32, col: Int32, live, n: Int32,
              st0: Int64, pS: cute.Pointer, sS: cute.Tensor):
        """Warp 0, lane = column j of value head h: the committed u_e[j] into ut; per token (in
        order, position p = n + t) u = beta (v - e^G S_c^T k - sum_{e<p} e^{G(p,e)} (k_e . k)
        u_e) and o = e^G S_c^T q + sum_{e<=p} e^{G(p,e)} (k_e . q) u_e; u into ut and the ring."""
        g, sm = self.g, self.sm
        for e in cutlass.range(n, unroll=1):
            sS[sm["ut"] + g.ut(e, col)] = ld(pS, st0 + Int64(g.ring_u(b, e, h, j)))
        for t in cutlass.range_constexpr(self.T):
            tk = Float32(0.0)
            tq = Float32(0.0)
            for w in cutlass.range_constexpr(self.NW):
                tk = tk + sS[sm["part"] + g.part(t, w, 0, col)]
                tq = tq + sS[sm["part"] + g.part(t, w, 1, col)]
            p = n + t
            seg = Float32(0.0)  # log-decay over the entries (e, p]
            au = Float32(0.0)
            ao = Float32(0.0)
            for jj in cutlass.range(p, unroll=1):
                e = p - 1 - jj
                c = sS[sm["ut"] + g.ut(e, col)]
                if cutlass.const_expr(not self.CHANNEL):  # CHANNEL: the dots carry the decays
                    seg = seg + sS[sm["gs"] + g.gs(r, e + 1)]
                    c = cute.math.exp(seg) * c
                au = au + c * sS[sm["dots"] + g.dot(t, 0, e)]
                ao = ao + c * sS[sm["dots"] + g.dot(t, 1, e)]
            a = Float32(1.0)  # CHANNEL: kc carries the committed state's decay
            if cutlass.const_expr(not self.CHANNEL):
                a = cute.math.exp(seg + sS[sm["gs"] + g.gs(r, 0)])  # from the committed state
            xt = sm["x"] + t * g.ch
            u = sS[sm["beta"] + t * g.rep + r] * (sS[xt + 2 * g.dk + r * g.dv + j] - (a * tk + au))
            sS[sm["ut"] + g.ut(p, col)] = u  # idle lanes store their twin's value
            if live:
                sS[sm["o"] + (t * g.rep + r) * g.dv + j] = (
                    a * tq + ao + sS[sm["dots"] + g.dot(t, 1, p)] * u)
                st(pS, st0 + Int64(g.ring_u(b, p, h, j)), u)

    # ---- phase 4: gated RMSNorm -> bf16 --------------------------------------------------------
    @cute.jit
    def output(self, b: Int32, kh: Int32, proj: Int32, norm_w: Int64, out: Int32,
               pW: cute.Pointer, pF: cute.Pointer, pB: cute.Pointer, sS: cute.Tensor,
               warp: Int32, lane: Int32):
        """ssm_out[b T + t, h dv + j] = bf16(o * rsqrt(mean(o^2) + eps) * w[j] * silu(z)): one
        warp per (token, value head)."""
        g = self.g
        for p in cutlass.range(warp, self.T * g.rep, self.NW, unroll=1):
            t = p // g.rep
            h = kh * g.rep + p - t * g.rep
            base = self.sm["o"] + p * g.dv
            ss = Float32(0.0)
            for j in cutlass.range(lane, g.dv, LANES, unroll=1):
                ss = ss + sS[base + j] * sS[base + j]
            ss = cute.arch.warp_reduction_sum(ss)
            rstd = Float32(1.0) / cute.math.sqrt(ss / Float32(g.dv) + Float32(self.eps))
            for j in cutlass.range(lane, g.dv, LANES, unroll=1):
                y = sS[base + j] * rstd * ld(pW, norm_w + j).to(Float32)
                y = y * self.out_gate(b, t, h, j, proj, pF, sS)
                st(pB, out + g.out(b, t, h, j), y.to(BFloat16))

    def out_gate(self, b: Int32, t: Int32, h: Int32, j: Int32, proj: Int32, pF: cute.Pointer,
                 sS: cute.Tensor) -> Float32:
        """The output gate of o[t][h][j]: silu(z)."""
        return silu(ld(pF, proj + self.g.proj(b, t, self.g.z_col(h, j))))

    def read_vectors(self, t: int) -> tuple[int, int]:
        """Words of the k_t and q_t the committed state is read with (r3): the normalised k, q."""
        xt = self.sm["x"] + t * self.g.ch
        return xt + self.g.dk, xt

    # ---- L2 prefetch of the states (before the dependency wait) ------------------------------
    @cute.jit
    def prefetch_state(self, rec: cute.Tensor, pS: cute.Pointer, tidx: Int32):
        """The record's R value heads' states are contiguous and predate this step: ask L2 for
        them while the CTA waits for the projection."""
        g = self.g
        st0 = join64(rec[word(Op.GDN_CORE, "STATE_LO")], rec[word(Op.GDN_CORE, "STATE_HI")])
        b, kh = rec[word(Op.GDN_CORE, "B_IDX")], rec[word(Op.GDN_CORE, "K_HEAD")]
        first = st0 + Int64(g.state(b, kh * g.rep, 0, 0))
        prefetch_l2(pS, first, g.rep * g.dk * g.dv * 4, tidx)
