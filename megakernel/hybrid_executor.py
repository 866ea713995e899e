"""CPU executor of hybrid programs (Qwen3.5, Nemotron-H, Kimi Linear; recurrent or ReplaySSM).

A subclass of `megakernel.executor.Executor`: the same random SM interleavings, epoch counters,
NaN poisoning, vector-clock race detection and exactly-once write counts apply; this module adds
the persistent fp32 `state` arena (conv windows, states, ReplaySSM rings; tracked like the KV
cache) and the semantics of the hybrid opcodes (hybrid_isa.py). Arithmetic follows
reference/hybrid in "bf16" mode op for op: bf16 rounding only at the points listed in
hybrid_isa.py; conv, gates, decays, states, rings and conv windows fp32.

Exactly once per step: h 1 + (residual adds); proj, ssm_out once per recurrent layer; q, attn
(and gate) once per attention layer (MLA: attn and the latent cache slots); act once per dense
MLP; moe_ids, moe_w and every (token, slot) row of act_moe and moe_y (the shared expert's slot
included) once per MoE layer; logits, tokens_out once; every conv-window element of every
recurrent layer once; states once (recurrent) or at a fold only (ReplaySSM); the T new ring
entries and the ring counts once; KV slots lengths[b] .. lengths[b]+T-1 once per attention layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel.executor import DEFAULT_SMS, Executor, ExecutorError, executor_gpu
from megakernel.hybrid.config import HybridConfig
from megakernel.program import hybrid_isa, isa
from megakernel.program.hybrid_compiler import (
    F32_CONSTANTS,
    HybridProgram,
    compile_hybrid,
    rope_tables,
)
from megakernel.program.hybrid_isa import HOp
from megakernel.program.hybrid_pack import SUPPORTED_FAMILIES, HybridPacked, pack_hybrid
from megakernel.program.isa import Op

LATENT_NORM_EPS = 1e-6  # MLA's q_a / kv_a norms (HF builds them without the config's eps)

__all__ = ["HybridExecutor", "generate", "SUPPORTED_FAMILIES"]



class HybridExecutor(Executor):
    """Holds a hybrid program's buffers (arenas, state arena, KV cache) and runs steps."""

    f32_constants = tuple(F32_CONSTANTS)  # the hybrid plan's constant fp32 regions

    def __init__(self, prog: HybridProgram, packed: HybridPacked, check: bool = True) -> None:
        b = prog.buffers
        self.state = torch.zeros(b.state_numel, dtype=torch.float32)
        super().__init__(prog, packed, check)
        params = self._region("f32", "ssm_params")
        for layer, row in b.ssm_index.items():
            params[row].copy_(packed.params[layer].reshape(-1))
        routers = self._region("f32", "router")
        for layer, row in b.moe_index.items():
            routers[row].copy_(packed.router[layer])
        self.eps = self.cfg.rms_norm_eps

    @staticmethod
    def _v_shape(b) -> tuple[int, ...]:  # noqa: ANN001 (the buffer plan)
        return b.v_shape or b.kv_shape  # MLA: no V cache of its own

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.cfg, self.prog.max_seq_len)  # the hybrid config's

    def _tracked(self, b) -> dict[str, int]:  # noqa: ANN001 (the buffer plan)
        return {"f32": b.f32_numel, "bf16": b.bf16_numel, "i32": b.i32_numel,
                "state": b.state_numel, "k": self.k.numel(), "v": self.v.numel()}

    # ---- hooks of the base executor --------------------------------------------------------------
    decode_record = staticmethod(hybrid_isa.decode)
    describe_record = staticmethod(hybrid_isa.describe)

    def _arena(self, name: str) -> torch.Tensor:
        return {"f32": self.f32, "bf16": self.bf16, "i32": self.i32, "state": self.state}[name]

    def _buf(self, buf: str) -> tuple[torch.Tensor, int]:
        if buf in ("k", "v"):
            return getattr(self, buf).view(-1), 0
        return self._arena(buf), 0

    def _exec(self, d: dict, epoch: int) -> None:
        op = d["OPCODE"]
        getattr(self, f"_op_{op.name.lower()}")(d, epoch)
        if d["SIGNAL_CID"] != isa.NO_COUNTER:
            self._release(d["SIGNAL_CID"])

    def _norm_input(self, d: dict) -> torch.Tensor:
        """As the base, with the (1 + w) weight for hybrid matvecs (header NORM_KIND = 1)."""
        if d["NORM_OFF"] < 0 or not isinstance(d["OPCODE"], HOp):
            return super()._norm_input(d)
        n, k = self.prog.rows, d["K"]
        x = self.read("f32", d["IN_OFF"], (n, k)).float()
        w = self.weights[d["NORM_OFF"] : d["NORM_OFF"] + k].float()
        if self.prog.header["NORM_KIND"] == hybrid_isa.NORM_1P:
            w = 1.0 + w
        y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * w
        return y.to(torch.bfloat16).float()

    # ---- cache -----------------------------------------------------------------------------------
    def load_cache(self, cache) -> None:  # noqa: ANN001 (reference.hybrid.model.HybridCache)
        """Copy a reference cache: KV of attention layers, GDN conv windows, (committed)
        states, ReplaySSM rings and counts, lengths."""
        b = self.prog.buffers
        if cache.replay_window != self.prog.replay_window:
            raise ExecutorError(f"the cache is for replay_window {cache.replay_window}, the "
                                f"program runs replay_window {self.prog.replay_window}")
        if cache.pending is not None:
            raise ExecutorError("the cache has a verified step that is not committed")
        if cache.batch != self.prog.batch:
            raise ExecutorError(f"cache batch {cache.batch} != program batch {self.prog.batch}")
        if cache.max_seq_len > self.prog.max_seq_len:
            raise ExecutorError(f"cache of {cache.max_seq_len} positions does not fit the "
                                f"program's {self.prog.max_seq_len}")
        for layer, slot in b.kv_slot.items():
            c = cache.layers[layer]
            if hasattr(c, "k_rope"):  # MLA latent cache c [B, S, r], k_rope [B, S, dr]
                s = c.c.shape[1]
                self.k[slot, :, 0, :s] = c.c.to(torch.bfloat16)
                self.v[slot, :, 0, :s] = c.k_rope.to(torch.bfloat16)
                continue
            s = c.k.shape[2]
            self.k[slot, :, :, :s] = c.k.to(torch.bfloat16)
            self.v[slot, :, :, :s] = c.v.to(torch.bfloat16)
        for layer in b.conv:
            c = cache.layers[layer]
            self._state_region(b.conv[layer]).copy_(c.conv)
            self._state_region(b.state[layer]).copy_(c.state)
            if b.ring_cap:
                n = int(c.count.max())
                if n + self.prog.tokens > b.ring_cap:
                    raise ExecutorError(f"layer {layer}: {n} ring entries + {self.prog.tokens} "
                                        f"do not fit the program's ring of {b.ring_cap}")
                for name, r in b.ring[layer].items():
                    self._state_region(r)[:, :n] = c.ring[name][:, :n]
                cnt = self._region("i32", "ring_count")[b.ssm_index[layer]]  # [B, units]
                cnt.copy_(c.count[:, None].expand_as(cnt).to(torch.int32))
        self.lengths.copy_(cache.lengths.to(torch.int32))

    def _state_region(self, r) -> torch.Tensor:  # noqa: ANN001
        return self.state[r.offset : r.offset + r.numel].view(r.shape)

    def recurrent_state(self, layer: int) -> torch.Tensor:
        """[B, Hv, dk, dv] state of GDN layer `layer`."""
        return self._state_region(self.prog.buffers.state[layer])

    # ---- hybrid opcodes --------------------------------------------------------------------------
    def _op_h_gateup(self, d: dict, epoch: int) -> None:
        self._op_gateup(d, epoch)

    def _op_h_lmhead(self, d: dict, epoch: int) -> None:
        self._op_lmhead(d, epoch)

    def _op_h_up_relu2(self, d: dict, epoch: int) -> None:
        acc = self._matvec(d)  # [N, NROWS]
        r0 = d["ROW0"]
        self.write("bf16", d["OUT_OFF"], (self.prog.rows, self.cfg.intermediate_size),
                   (slice(None), slice(r0, r0 + d["NROWS"])), torch.relu(acc).square())

    def _op_h_gdn_proj(self, d: dict, epoch: int) -> None:
        acc = self._matvec(d)  # [N, NROWS] fp32
        r0 = d["ROW0"]
        self.write("f32", d["OUT_OFF"], (self.prog.rows, d["OUT_W"]),
                   (slice(None), slice(r0, r0 + d["NROWS"])), acc)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE on the first R dims of x [N, D] at positions pos [N]."""
        hdr = self.prog.header
        r = hdr["ROTARY_DIM"]
        if r == 0:
            return x
        half, s = r // 2, self.prog.max_seq_len
        cos_h = self.f32[hdr["F32_ROPE_COS_OFF"] :][: s * half].view(s, half)
        sin_h = self.f32[hdr["F32_ROPE_SIN_OFF"] :][: s * half].view(s, half)
        cos = torch.cat((cos_h[pos], cos_h[pos]), dim=-1)  # [N, R]
        sin = torch.cat((sin_h[pos], sin_h[pos]), dim=-1)
        rot, rest = x[:, :r], x[:, r:]
        rotated = torch.cat((-rot[:, half:], rot[:, :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)

    def _op_h_qkv(self, d: dict, epoch: int) -> None:
        a, p = self.cfg.attention, self.prog
        n, t_, dh = p.rows, p.tokens, a.head_dim
        g = a.num_heads // a.num_kv_heads
        ng = g if hdr_gate(p) else 0  # gate head slots per group
        acc = self._matvec(d).view(n, -1, dh)  # [N, head slots, D]
        lengths = self.read("i32", p.buffers.i32["lengths"].offset, (p.batch,), scratch=False)
        pos = (lengths.long()[:, None] + torch.arange(t_)).reshape(-1)  # [N]
        kv, slot, hdr = p.buffers.kv_shape, d["KV_SLOT"], p.header
        one_p = hdr["NORM_KIND"] == hybrid_isa.NORM_1P
        for j in range(acc.shape[1]):
            grp, jj = divmod(d["ROW0"] // dh + j, g + ng + 2)
            x = acc[:, j]  # [N, D]
            if jj < g or jj == g + ng:  # q or k: ((1 + w)) RMSNorm, partial RoPE
                if d["QK_NORM_OFF"] >= 0:
                    wo = d["QK_NORM_OFF"] + (0 if jj < g else dh)
                    w = self.weights[wo : wo + dh].float()
                    w = 1.0 + w if one_p else w
                    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w
                x = self._rope(x, pos)
            if jj < g:
                self.write("bf16", d["OUT_OFF"], (n, a.num_heads, dh), (slice(None), grp * g + jj),
                           x)
            elif jj < g + ng:
                self.write("f32", hdr["F32_GATE_OFF"], (n, a.num_heads, dh),
                           (slice(None), grp * g + jj - g), x)
            else:
                buf = "k" if jj == g + ng else "v"
                for row in range(n):
                    self.write(buf, 0, kv, (slot, row // t_, grp, int(pos[row])), x[row])

    def _op_h_attn(self, d: dict, epoch: int) -> None:
        a, p = self.cfg.attention, self.prog
        n, t_, dh, hq = p.rows, p.tokens, a.head_dim, a.num_heads
        g = hq // a.num_kv_heads
        b, grp, slot = d["B_IDX"], d["KV_HEAD"], d["KV_SLOT"]
        length = int(self.read("i32", d["LEN_OFF"], (p.batch,), b, scratch=False))
        rows, heads = slice(b * t_, (b + 1) * t_), slice(grp * g, (grp + 1) * g)
        q = self.read("bf16", d["Q_OFF"], (n, hq, dh), (rows, heads)).float()  # [T, G, D]
        kv = p.buffers.kv_shape
        old, new = slice(0, length), slice(length, length + t_)
        kk = torch.cat((self.read("k", 0, kv, (slot, b, grp, old), scratch=False),
                        self.read("k", 0, kv, (slot, b, grp, new)))).float()  # [S, D]
        vv = torch.cat((self.read("v", 0, kv, (slot, b, grp, old), scratch=False),
                        self.read("v", 0, kv, (slot, b, grp, new)))).float()
        scores = torch.einsum("tgd,sd->gts", q, kk) * dh**-0.5  # [G, T, S]
        visible = torch.arange(length + t_)[None, :] <= (length + torch.arange(t_))[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        o = torch.einsum("gts,sd->tgd", probs, vv)  # [T, G, D]
        if d["GATE_OFF"] >= 0:
            o = o * torch.sigmoid(self.read("f32", d["GATE_OFF"], (n, hq, dh), (rows, heads)))
        self.write("bf16", d["OUT_OFF"], (n, hq, dh), (rows, heads), o)

    def _gdn_inputs(self, d: dict) -> dict:
        """Conv (window in, window out) and the per-token inputs of one (sequence, key head):
        q, k [T, dk], v [T, R, dv], beta, g [T, R] (log-decay), z [T, R dv]."""
        c, p = self.cfg.gdn, self.prog
        n, t_, bsz = p.rows, p.tokens, p.batch
        hk, hv, dk, dv, kw = c.num_k_heads, c.num_v_heads, c.k_head_dim, c.v_head_dim, c.conv_kernel
        rep, cd, kd, vd = hv // hk, c.conv_dim, c.key_dim, c.value_dim
        pw = p.header["SSM_PROJ_W"]
        b, kh = d["B_IDX"], d["K_HEAD"]
        h0 = kh * rep
        rows = slice(b * t_, (b + 1) * t_)
        # channel ranges of this key head in [q | k | v]
        segs = (slice(kh * dk, (kh + 1) * dk), slice(kd + kh * dk, kd + (kh + 1) * dk),
                slice(2 * kd + h0 * dv, 2 * kd + (h0 + rep) * dv))
        conv_shape = (bsz, cd, kw - 1)
        cw = self.weights[d["CONV_W"] : d["CONV_W"] + cd * kw].view(cd, kw).float()
        acts = []
        for sg in segs:
            x = self.read("f32", d["PROJ_OFF"], (n, pw), (rows, sg))  # [T, c]
            win = self.read("state", d["STATE_OFF"], conv_shape, (b, sg), scratch=False)
            u = torch.cat((win, x.transpose(0, 1)), dim=-1)  # [c, K-1+T]
            conv = (u.unfold(-1, kw, 1) * cw[sg][:, None, :]).sum(-1).transpose(0, 1)  # [T, c]
            self.write("state", d["STATE_OFF"], conv_shape, (b, sg), u[:, -(kw - 1):])
            acts.append(F.silu(conv))
        zc, bc = cd + h0 * dv, cd + vd + h0
        bb = self.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(bc, bc + rep)))  # [T, R]
        aa = self.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(bc + hv, bc + hv + rep)))
        prm = self.f32[d["PARAM_OFF"] : d["PARAM_OFF"] + 2 * hv].view(2, hv)[:, h0 : h0 + rep]
        return dict(
            q=_l2norm(acts[0]) * dk**-0.5, k=_l2norm(acts[1]), v=acts[2].reshape(t_, rep, dv),
            beta=torch.sigmoid(bb),
            g=-prm[0].exp() * F.softplus(aa + prm[1], beta=1.0, threshold=20.0),
            z=self.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(zc, zc + rep * dv))),
            rows=rows, heads=slice(h0, h0 + rep), rep=rep,
            st=(d["STATE_OFF"] + bsz * cd * (kw - 1), (bsz, hv, dk, dv)))

    def _gdn_output(self, d: dict, inp: dict, y: torch.Tensor) -> None:
        """bf16(RMSNorm(y) * w * silu(z)) per value head -> gdn_out; y [T, R, dv]."""
        c, p = self.cfg.gdn, self.prog
        dv, rep, h = c.v_head_dim, inp["rep"], inp["heads"]
        nw = self.weights[d["NORM_W"] : d["NORM_W"] + dv].float()
        o = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * nw
        o = o * F.silu(inp["z"].reshape(p.tokens, rep, dv))
        self.write("bf16", d["OUT_OFF"], (p.rows, c.value_dim),
                   (inp["rows"], slice(h.start * dv, h.stop * dv)), o.reshape(p.tokens, rep * dv))

    def _op_h_gdn_core(self, d: dict, epoch: int) -> None:
        inp = self._gdn_inputs(d)
        rep, dk = inp["rep"], inp["q"].shape[-1]
        st_off, st_shape = inp["st"]
        idx = (d["B_IDX"], inp["heads"])
        state = self.read("state", st_off, st_shape, idx, scratch=False)  # [R, dk, dv]
        y, state = _delta_steps(state, inp["q"][:, None].expand(-1, rep, dk),
                                inp["k"][:, None].expand(-1, rep, dk), inp["v"], inp["beta"],
                                inp["g"][..., None].expand(-1, rep, dk))
        self.write("state", st_off, st_shape, idx, state)
        self._gdn_output(d, inp, y)

    def _op_h_gdn_replay(self, d: dict, epoch: int) -> None:
        c = self.cfg.gdn
        inp = self._gdn_inputs(d)
        rep, dk = inp["rep"], c.k_head_dim
        kh, heads = d["K_HEAD"], inp["heads"]
        # ring k per key head [dk], u per value head [dv], g per value head (scalar)
        ring = {"k": (c.num_k_heads, dk, kh), "u": (c.num_v_heads, c.v_head_dim, heads),
                "g": (c.num_v_heads, None, heads)}
        new = {"k": inp["k"], "g": inp["g"]}
        y = self._delta_replay(d, inp, ring, new, kh, c.num_k_heads,
                               lambda e: e["k"][:, None].expand(-1, rep, dk),
                               lambda e: e["g"][..., None].expand(*e["g"].shape, dk),
                               inp["q"][:, None].expand(-1, rep, dk))
        self._gdn_output(d, inp, y)

    def _delta_replay(self, d: dict, inp: dict, ring: dict, new: dict, unit: int, units: int,
                      keys_of, decay_of, q: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """ReplaySSM delta rule of one unit (GDN key head / KDA head): ring IO, outputs, the
        appended entries and the fold. ring: name -> (heads dim, entry dim or None, index);
        keys_of / decay_of expand stored k / g to [.., R, dk]. Returns y [T, R, dv]."""
        p = self.prog
        t_, bsz, cap = p.tokens, p.batch, p.buffers.ring_cap
        b = d["B_IDX"]
        st_off, st_shape = inp["st"]
        n = int(self.read("i32", d["COUNT_OFF"], (bsz, units), (b, unit), scratch=False))
        if n + t_ > cap:
            raise ExecutorError(f"{self.cur_desc}: ring overflow, {n} + {t_} entries > {cap}")
        off, shapes = st_off + _numel(st_shape), {}
        for name, (hd, ed, _) in ring.items():  # ring blocks follow the state, in order
            shapes[name] = (off, (bsz, cap, hd) + ((ed,) if ed else ()))
            off += _numel(shapes[name][1])

        def rd(name: str, rows: slice) -> torch.Tensor:
            o, shp = shapes[name]
            return self.read("state", o, shp, (b, rows, ring[name][2]), scratch=False)

        old = slice(0, n)
        stored = {name: rd(name, old) for name in ring}
        kx = torch.cat((keys_of(stored), keys_of(new)))  # [n+T, R, dk]
        g_all = torch.cat((torch.zeros_like(decay_of(new)[:1]), decay_of(stored),
                           decay_of(new)))  # [1+n+T, R, dk]
        state = self.read("state", st_off, st_shape, (b, inp["heads"]), scratch=False)
        fold = n + t_ >= d["WINDOW"]
        y, us, state = _delta_replay_math(state, kx, list(stored["u"].unbind(0)), g_all, q,
                                          inp["v"], inp["beta"], fold)
        rows = slice(n, n + t_)
        entries = dict(new, u=torch.stack(us[n:], dim=0))
        for name in ring:
            o, shp = shapes[name]
            self.write("state", o, shp, (b, rows, ring[name][2]), entries[name])
        if fold:  # every entry folded into the committed state; the ring restarts
            self.write("state", st_off, st_shape, (b, inp["heads"]), state)
        self.write("i32", d["COUNT_OFF"], (bsz, units), (b, slice(unit, unit + 1)),
                   torch.tensor([0 if fold else n + t_], dtype=torch.int32))
        return y

    # ---- Kimi: KDA, MLA, MoE -----------------------------------------------------------------
    def _kda_inputs(self, d: dict) -> dict:
        c, p = self.cfg.kda, self.prog
        n, t_, bsz = p.rows, p.tokens, p.batch
        hh, dd, kw, hd = c.num_heads, c.head_dim, c.conv_kernel, c.qkv_dim
        pw = p.header["SSM_PROJ_W"]
        b, h = d["B_IDX"], d["HEAD"]
        rows = slice(b * t_, (b + 1) * t_)
        segs = [slice(o + h * dd, o + (h + 1) * dd) for o in (0, hd, 2 * hd)]  # q, k, v
        conv_shape = (bsz, c.conv_dim, kw - 1)
        w0 = d["CONV_W"]
        cw = self.weights[w0 : w0 + c.conv_dim * kw].view(c.conv_dim, kw).float()
        fb = self.weights[w0 + c.conv_dim * kw :][: hd * dd].view(hd, dd)[h * dd : (h + 1) * dd]
        gb = self.weights[w0 + c.conv_dim * kw + hd * dd :][: hd * dd].view(hd, dd)
        gb = gb[h * dd : (h + 1) * dd]
        acts = []
        for sg in segs:
            x = self.read("f32", d["PROJ_OFF"], (n, pw), (rows, sg))  # [T, d]
            win = self.read("state", d["STATE_OFF"], conv_shape, (b, sg), scratch=False)
            u = torch.cat((win, x.transpose(0, 1)), dim=-1)
            conv = (u.unfold(-1, kw, 1) * cw[sg][:, None, :]).sum(-1).transpose(0, 1)
            self.write("state", d["STATE_OFF"], conv_shape, (b, sg), u[:, -(kw - 1):])
            acts.append(F.silu(conv))
        base = 3 * hd

        def col(c0: int, w: int) -> torch.Tensor:
            return self.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(c0, c0 + w)))

        fa, bb, ga = col(base, dd), col(base + dd + h, 1), col(base + dd + hh, dd)
        prm = self.f32[d["PARAM_OFF"] : d["PARAM_OFF"] + hh + hd]
        f = F.linear(fa.to(torch.bfloat16).float(), fb.float())  # [T, d]
        g = -prm[h].exp() * F.softplus(f + prm[hh + h * dd : hh + (h + 1) * dd], beta=1.0,
                                       threshold=20.0)
        return dict(q=_l2norm_div(acts[0]) * dd**-0.5, k=_l2norm_div(acts[1]),
                    v=acts[2][:, None], beta=torch.sigmoid(bb), g=g[:, None],
                    gate=F.linear(ga.to(torch.bfloat16).float(), gb.float()), rows=rows,
                    heads=slice(h, h + 1), rep=1,
                    st=(d["STATE_OFF"] + bsz * c.conv_dim * (kw - 1), (bsz, hh, dd, dd)))

    def _kda_output(self, d: dict, inp: dict, y: torch.Tensor) -> None:
        c, p = self.cfg.kda, self.prog
        dd, h = c.head_dim, d["HEAD"]
        y = y[:, 0]  # [T, d]
        nw = self.weights[d["NORM_W"] : d["NORM_W"] + dd].float()
        o = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * nw
        o = o * torch.sigmoid(inp["gate"])
        self.write("bf16", d["OUT_OFF"], (p.rows, c.qkv_dim),
                   (inp["rows"], slice(h * dd, (h + 1) * dd)), o)

    def _op_h_kda_core(self, d: dict, epoch: int) -> None:
        inp = self._kda_inputs(d)
        st_off, st_shape = inp["st"]
        idx = (d["B_IDX"], inp["heads"])
        state = self.read("state", st_off, st_shape, idx, scratch=False)  # [1, d, d]
        y, state = _delta_steps(state, inp["q"][:, None], inp["k"][:, None], inp["v"],
                                inp["beta"], inp["g"])
        self.write("state", st_off, st_shape, idx, state)
        self._kda_output(d, inp, y)

    def _op_h_kda_replay(self, d: dict, epoch: int) -> None:
        c = self.cfg.kda
        inp = self._kda_inputs(d)
        hs = inp["heads"]
        ring = {"k": (c.num_heads, c.head_dim, hs), "u": (c.num_heads, c.head_dim, hs),
                "g": (c.num_heads, c.head_dim, hs)}
        new = {"k": inp["k"][:, None], "g": inp["g"]}
        y = self._delta_replay(d, inp, ring, new, d["HEAD"], c.num_heads, lambda e: e["k"],
                               lambda e: e["g"], inp["q"][:, None])
        self._kda_output(d, inp, y)

    def _op_h_mla(self, d: dict, epoch: int) -> None:
        m, p = self.cfg.mla, self.prog
        n, t_ = p.rows, p.tokens
        hh, dqk, dn, dv, r, dr = (m.num_heads, m.qk_head_dim, m.qk_nope_head_dim, m.v_head_dim,
                                  m.kv_lora_rank, m.qk_rope_head_dim)
        pw, b, h, slot = p.header["SSM_PROJ_W"], d["B_IDX"], d["HEAD"], d["KV_SLOT"]
        rows = slice(b * t_, (b + 1) * t_)
        length = int(self.read("i32", d["LEN_OFF"], (p.batch,), b, scratch=False))
        q = self.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(h * dqk, (h + 1) * dqk)))
        q = q.to(torch.bfloat16).float()  # [T, dn + dr]
        lat = self.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(hh * dqk, hh * dqk + r + dr)))
        k_rope = lat[:, r:].to(torch.bfloat16)
        nw = self.weights[d["NORM_W"] : d["NORM_W"] + r].float()
        c = lat[:, :r]
        c = (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + LATENT_NORM_EPS) * nw)
        c = c.to(torch.bfloat16)
        kc, vc = p.buffers.kv_shape, p.buffers.v_shape
        new, old = slice(length, length + t_), slice(0, length)
        if h == 0:  # every head computes the same latent; head 0 stores it
            self.write("k", 0, kc, (slot, b, 0, new), c)
            self.write("v", 0, vc, (slot, b, 0, new), k_rope)
        # cached positions, then this step's (as stored: bf16)
        c_all = torch.cat((self.read("k", 0, kc, (slot, b, 0, old), scratch=False), c)).float()
        kr = torch.cat((self.read("v", 0, vc, (slot, b, 0, old), scratch=False),
                        k_rope)).float()  # [S, dr]
        w0 = d["KVB_W"] + h * (dn + dv) * r
        kv = F.linear(c_all, self.weights[w0 : w0 + (dn + dv) * r].view(-1, r).float())
        keys = torch.cat((kv[:, :dn], kr), dim=-1)  # [S, dn + dr]
        scores = (q @ keys.T) * dqk**-0.5  # [T, S]
        visible = torch.arange(length + t_)[None, :] <= (length + torch.arange(t_))[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        self.write("bf16", d["OUT_OFF"], (n, hh * dv), (rows, slice(h * dv, (h + 1) * dv)),
                   probs @ kv[:, dn:])

    def _op_h_router(self, d: dict, epoch: int) -> None:
        e, p = self.cfg.moe, self.prog
        n, hid, ne = p.rows, d["K"], e.num_experts
        x = self._norm_input(d)  # [N, H] bf16-rounded
        ro = d["ROUTER_OFF"]
        wr = self.f32[ro : ro + ne * hid].view(ne, hid)
        bias = self.f32[ro + ne * hid : ro + ne * hid + ne]
        scores = torch.sigmoid(F.linear(x, wr))  # [N, E]
        choice = scores + bias
        per = ne // e.n_group
        grp = choice.reshape(n, e.n_group, per).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(grp, dtype=torch.bool).scatter_(
            1, grp.topk(e.topk_group, dim=-1).indices, True)
        keep = keep[:, :, None].expand(n, e.n_group, per).reshape(n, ne)
        ids = choice.masked_fill(~keep, float("-inf")).topk(e.top_k, dim=-1).indices
        wts = scores.gather(1, ids)
        if e.norm_topk_prob:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        self.write("i32", d["IDS_OFF"], (n, e.top_k), slice(None), ids.to(torch.int32))
        self.write("f32", d["WTS_OFF"], (n, e.top_k), slice(None),
                   wts * e.routed_scaling_factor)

    def _expert_rows(self, d: dict) -> list[tuple[int, int]]:
        """(token, slot) pairs routed to the record's expert (the shared one: every token)."""
        e, n = self.cfg.moe, self.prog.rows
        if d["EXPERT"] == e.num_experts:
            return [(i, e.top_k) for i in range(n)]
        ids = self.read("i32", d["IDS_OFF"], (n, e.top_k))
        return [tuple(x) for x in (ids == d["EXPERT"]).nonzero().tolist()]

    def _op_h_expert_gateup(self, d: dict, epoch: int) -> None:
        e, n = self.cfg.moe, self.prog.rows
        pairs = self._expert_rows(d)
        if not pairs:  # no token picked this expert: nothing to stream
            return
        x = self._norm_input(d)[[t for t, _ in pairs]]  # [m, H]
        w = self.weights[d["W"] : d["W"] + d["NROWS"] * d["K"]].view(d["NROWS"], d["K"])
        blk = F.linear(x, w.float()).view(len(pairs), -1, 2, isa.GATEUP_BLOCK)
        act = (F.silu(blk[:, :, 0]) * blk[:, :, 1]).reshape(len(pairs), -1)
        c0 = d["ROW0"] // 2
        shape = (n, e.top_k + e.num_shared_experts, e.intermediate_size)
        for i, (t, s_) in enumerate(pairs):
            self.write("bf16", d["OUT_OFF"], shape, (t, s_, slice(c0, c0 + d["NROWS"] // 2)),
                       act[i])

    def _op_h_expert_down(self, d: dict, epoch: int) -> None:
        e, n, hid = self.cfg.moe, self.prog.rows, self.cfg.hidden_size
        pairs = self._expert_rows(d)
        if not pairs:
            return
        slots = e.top_k + e.num_shared_experts
        x = torch.stack([self.read("bf16", d["IN_OFF"], (n, slots, d["K"]), (t, s_))
                         for t, s_ in pairs]).float()  # [m, I_e]
        w = self.weights[d["W"] : d["W"] + d["NROWS"] * d["K"]].view(d["NROWS"], d["K"])
        y = F.linear(x, w.float())
        r0 = d["ROW0"]
        for i, (t, s_) in enumerate(pairs):
            self.write("f32", d["OUT_OFF"], (n, slots, hid), (t, s_, slice(r0, r0 + d["NROWS"])),
                       y[i])

    def _op_h_moe_combine(self, d: dict, epoch: int) -> None:
        e, n, hid = self.cfg.moe, self.prog.rows, self.cfg.hidden_size
        slots = e.top_k + e.num_shared_experts
        cols = slice(d["ROW0"], d["ROW0"] + d["NROWS"])
        ids = self.read("i32", d["IDS_OFF"], (n, e.top_k))
        wts = self.read("f32", d["WTS_OFF"], (n, e.top_k))
        for t in range(n):
            out = torch.zeros(d["NROWS"])
            for s_ in sorted(range(e.top_k), key=lambda j: int(ids[t, j])):  # ascending expert
                y = self.read("f32", d["Y_OFF"], (n, slots, hid), (t, s_, cols))
                out = out + y * wts[t, s_]
            if e.num_shared_experts:
                out = out + self.read("f32", d["Y_OFF"], (n, slots, hid), (t, e.top_k, cols))
            cur = self.read("f32", d["OUT_OFF"], (n, hid), (t, cols))
            self.write("f32", d["OUT_OFF"], (n, hid), (t, cols), cur + out)

    def _mamba_inputs(self, d: dict) -> dict:
        """Conv (+ bias; window in, window out) and the per-token inputs of one (sequence,
        group): x [T, R, P], B, C [T, N], dt [T, R] (after softplus), z [T, R P]."""
        m, p = self.cfg.mamba2, self.prog
        n, t_, bsz = p.rows, p.tokens, p.batch
        hh, hp, ns, ng, kw = m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel
        rep, di, cd = hh // ng, m.d_inner, m.conv_dim
        pw = p.header["SSM_PROJ_W"]
        b, j = d["B_IDX"], d["GROUP"]
        h0 = j * rep
        rows = slice(b * t_, (b + 1) * t_)
        # conv channel ranges of this group in [x | B | C]
        segs = (slice(h0 * hp, (h0 + rep) * hp), slice(di + j * ns, di + (j + 1) * ns),
                slice(di + ng * ns + j * ns, di + ng * ns + (j + 1) * ns))
        conv_shape = (bsz, cd, kw - 1)
        cw = self.weights[d["CONV_W"] : d["CONV_W"] + cd * kw].view(cd, kw).float()
        cb = self.weights[d["CONV_W"] + cd * kw : d["CONV_W"] + cd * (kw + 1)].float()
        acts = []
        for sg in segs:
            x = self.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(di + sg.start,
                                                                      di + sg.stop)))
            win = self.read("state", d["STATE_OFF"], conv_shape, (b, sg), scratch=False)
            u = torch.cat((win, x.transpose(0, 1)), dim=-1)  # [c, K-1+T]
            conv = (u.unfold(-1, kw, 1) * cw[sg][:, None, :]).sum(-1) + cb[sg][:, None]
            self.write("state", d["STATE_OFF"], conv_shape, (b, sg), u[:, -(kw - 1):])
            acts.append(F.silu(conv.transpose(0, 1)))  # [T, c]
        dc = di + cd + h0
        dt = self.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(dc, dc + rep)))  # [T, R]
        prm = self.f32[d["PARAM_OFF"] : d["PARAM_OFF"] + 3 * hh].view(3, hh)[:, h0 : h0 + rep]
        return dict(
            x=acts[0].reshape(t_, rep, hp), B=acts[1], C=acts[2],
            dt=F.softplus(dt + prm[2], beta=1.0, threshold=20.0), a=-prm[0].exp(), D=prm[1],
            z=self.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(h0 * hp, (h0 + rep) * hp))),
            rows=rows, heads=slice(h0, h0 + rep), rep=rep,
            st=(d["STATE_OFF"] + bsz * cd * (kw - 1), (bsz, hh, hp, ns)))

    def _mamba_output(self, d: dict, inp: dict, y: torch.Tensor) -> None:
        """bf16(w * RMSNorm over the group of (y * silu(z))) -> ssm_out; y [T, R, P]."""
        m, p = self.cfg.mamba2, self.prog
        h, t_ = inp["heads"], p.tokens
        c0, c1 = h.start * m.head_dim, h.stop * m.head_dim
        g = y.reshape(t_, c1 - c0) * F.silu(inp["z"])
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        g = g * self.weights[d["NORM_W"] + c0 : d["NORM_W"] + c1].float()
        self.write("bf16", d["OUT_OFF"], (p.rows, m.d_inner), (inp["rows"], slice(c0, c1)), g)

    def _op_h_mamba_core(self, d: dict, epoch: int) -> None:
        inp = self._mamba_inputs(d)
        x, bb, cc, dt, a, dd = inp["x"], inp["B"], inp["C"], inp["dt"], inp["a"], inp["D"]
        rep = inp["rep"]
        st_off, st_shape = inp["st"]
        idx = (d["B_IDX"], inp["heads"])
        state = self.read("state", st_off, st_shape, idx, scratch=False)  # [R, P, N]
        ys = []
        for t in range(x.shape[0]):
            b_t, c_t = bb[t].expand(rep, -1), cc[t].expand(rep, -1)  # [R, N]
            da = (a * dt[t]).exp()  # [R]
            y = (da[..., None] * (state * c_t[..., None, :]).sum(-1)
                 + (dt[t] * (b_t * c_t).sum(-1))[..., None] * x[t])
            ys.append(y + dd[:, None] * x[t])
            state = (da[..., None, None] * state
                     + x[t][..., :, None] * (dt[t][..., None] * b_t)[..., None, :])
        self.write("state", st_off, st_shape, idx, state)
        self._mamba_output(d, inp, torch.stack(ys, dim=0))

    def _op_h_mamba_replay(self, d: dict, epoch: int) -> None:
        m, p = self.cfg.mamba2, self.prog
        inp = self._mamba_inputs(d)
        x, bb, cc, dt, a, dd = inp["x"], inp["B"], inp["C"], inp["dt"], inp["a"], inp["D"]
        rep, t_, ns = inp["rep"], p.tokens, m.state_size
        b, j, heads = d["B_IDX"], d["GROUP"], inp["heads"]
        st_off, st_shape = inp["st"]
        bsz, cap = p.batch, p.buffers.ring_cap
        cnt = (bsz, m.n_groups)
        n = int(self.read("i32", d["COUNT_OFF"], cnt, (b, j), scratch=False))
        if n + t_ > cap:
            raise ExecutorError(f"{self.cur_desc}: ring overflow, {n} + {t_} entries > {cap}")
        r_x = st_off + _numel(st_shape)  # ring x [B, CAP, H, P], B [B, CAP, G, N], dt [B, CAP, H]
        r_b = r_x + bsz * cap * m.num_heads * m.head_dim
        r_d = r_b + bsz * cap * m.n_groups * ns
        sx, sb, sd = ((bsz, cap, m.num_heads, m.head_dim), (bsz, cap, m.n_groups, ns),
                      (bsz, cap, m.num_heads))
        old = slice(0, n)
        xs = torch.cat((self.read("state", r_x, sx, (b, old, heads), scratch=False), x))
        bs = torch.cat((self.read("state", r_b, sb, (b, old, j), scratch=False), bb))  # [n+T, N]
        bs = bs[:, None, :].expand(-1, rep, ns)  # [n+T, R, N]
        dts = torch.cat((self.read("state", r_d, sd, (b, old, heads), scratch=False), dt))
        seg = _segsum(torch.cat((torch.zeros(1, rep), a * dts)))  # [1+n+T, 1+n+T, R]
        state = self.read("state", st_off, st_shape, (b, heads), scratch=False)  # [R, P, N]
        outs = []
        for i in range(t_):
            t = n + i
            c_i = cc[i].expand(rep, ns)
            a_c = seg[t + 1, 0].exp()  # [R]
            w = dts[: t + 1] * seg[t + 1, 1 : t + 2].exp()  # [t+1, R]
            coef = w * (bs[: t + 1] * c_i[None]).sum(-1)
            y = (a_c[:, None] * (state * c_i[:, None, :]).sum(-1)
                 + (coef[..., None] * xs[: t + 1]).sum(0))
            outs.append(y + dd[:, None] * x[i])
        new = slice(n, n + t_)
        self.write("state", r_x, sx, (b, new, heads), x)
        self.write("state", r_b, sb, (b, new, j), bb)
        self.write("state", r_d, sd, (b, new, heads), dt)
        total = n + t_
        if total >= d["WINDOW"]:  # fold every entry into the committed state
            end = seg[-1]  # [1+n+T, R]
            wb = (dts * end[1:].exp())[..., None] * bs  # [n+T, R, N]
            state = (end[0].exp()[:, None, None] * state
                     + (xs[..., :, None] * wb[..., None, :]).sum(0))
            self.write("state", st_off, st_shape, (b, heads), state)
            total = 0
        self.write("i32", d["COUNT_OFF"], cnt, (b, slice(j, j + 1)),
                   torch.tensor([total], dtype=torch.int32))
        self._mamba_output(d, inp, torch.stack(outs, dim=0))

    # ---- exactly-once check ----------------------------------------------------------------------
    def step(self, tokens: torch.Tensor | None = None, seed: int = 0) -> torch.Tensor:
        self._ring_before = self._region("i32", "ring_count").clone()
        return super().step(tokens, seed)

    def _check_counts(self, lengths: list[int]) -> None:

        p, b = self.prog, self.prog.buffers
        types = self.cfg.layer_types
        n_rec, n_attn = len(self.cfg.recurrent_layers()), types.count("attention")
        n_mla = types.count("mla")
        nemo = self.cfg.family == "nemotron_h"
        n_res = len(types) if nemo else 2 * len(types)  # residual adds
        ffn = [self.cfg.ffn_type(i) for i in range(len(types))]
        n_mlp = types.count("mlp") if nemo else ffn.count("mlp")
        n_moe = ffn.count("moe")
        argmax = next(i for i in p.instrs if i.op == Op.ARGMAX)
        flags, n_tiles = argmax.operands["FLAGS"], argmax.operands["N_TILES"]
        expect = {k: torch.zeros_like(t.count) for k, t in self.tracks.items()}

        def put(arena: str, name: str, times: int, idx=()) -> None:  # noqa: ANN001
            r = getattr(b, arena)[name]
            expect[arena][r.offset : r.offset + r.numel].view(r.shape)[idx] = times

        put("f32", "h", 1 + n_res)
        put("f32", "proj", n_rec + n_mla)
        put("f32", "gate", n_attn if hdr_gate(p) else 0)
        put("f32", "logits", 1)
        put("f32", "part_argmax", 1, slice(0, n_tiles))
        put("bf16", "q", n_attn)
        put("bf16", "attn", n_attn + n_mla)
        put("bf16", "ssm_out", n_rec)
        put("bf16", "act", n_mlp)
        put("i32", "tokens_out", 1)
        if n_moe:  # routed slots once per MoE layer, the shared slot too
            put("i32", "moe_ids", n_moe)
            put("f32", "moe_w", n_moe)
            put("f32", "moe_y", n_moe)
            put("bf16", "act_moe", n_moe)
        if flags & isa.FLAG_ADVANCE:
            put("i32", "lengths", 1)
        if flags & isa.FLAG_FEEDBACK:
            put("i32", "tokens_in", 1)
        if b.ring_cap:  # ReplaySSM: windows, new ring entries, counts; states only at a fold
            put("i32", "ring_count", 1, slice(0, n_rec))
            st = expect["state"]
            for layer, gi in b.ssm_index.items():
                st[b.conv[layer].offset : b.conv[layer].offset + b.conv[layer].numel] = 1
                for bi in range(p.batch):
                    n0 = int(self._ring_before[gi, bi, 0])
                    if n0 + p.tokens >= p.replay_window:
                        r = b.state[layer]
                        st[r.offset : r.offset + r.numel].view(r.shape)[bi] = 1
                    for r in b.ring[layer].values():
                        st[r.offset : r.offset + r.numel].view(r.shape)[bi, n0 : n0 + p.tokens] = 1
        else:
            expect["state"].fill_(1)
        if n_attn + n_mla:
            for kv in ("k", "v"):
                e = expect[kv].view(getattr(self, kv).shape)
                for bi, n0 in enumerate(lengths):
                    e[:, bi, :, n0 : n0 + p.tokens] = 1
        self._compare_write_counts(expect)


def hdr_gate(prog: HybridProgram) -> bool:
    return bool(prog.header["OUTPUT_GATE"])


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


def _read(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """S^T x for S [..., dk, dv], x [..., dk] -> [..., dv]."""
    return (state * x[..., :, None]).sum(-2)


def _weighted(coef: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor | float:
    """sum_j coef[j, h] * values[j][h, :] (0.0 for no terms)."""
    if not values or coef.shape[0] == 0:
        return 0.0
    return (coef[..., None] * torch.stack(values[: coef.shape[0]], dim=0)).sum(0)


def _segsum(g: torch.Tensor) -> torch.Tensor:
    """out[t, j] = sum of g[j+1 .. t] for j <= t, -inf above; g [n, ...] -> [n, n, ...].
    Summed over the segment itself (no difference of long prefix sums)."""
    n = g.shape[0]
    x = g[:, None].expand(n, n, *g.shape[1:])
    shape = (n, n) + (1,) * (g.dim() - 1)
    strict = torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1).reshape(shape)
    out = torch.where(strict, x, torch.zeros(())).cumsum(dim=0)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool)).reshape(shape)
    return torch.where(causal, out, torch.full((), float("-inf")))


def _delta_steps(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 beta: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent delta rule over T tokens ("decay on read" form of reference/hybrid):
    state [R, dk, dv]; q, k, g [T, R, dk]; v [T, R, dv]; beta [T, R] -> (y [T, R, dv], state)."""
    ys = []
    for t in range(q.shape[0]):
        dec = g[t].exp()
        pre = _read(state, dec * k[t])
        u = beta[t][:, None] * (v[t] - pre)
        ys.append(_read(state, dec * q[t]) + (k[t] * q[t]).sum(-1)[..., None] * u)
        state = dec[..., None] * state + k[t][..., :, None] * u[..., None, :]
    return torch.stack(ys, dim=0), state


def _delta_replay_math(state: torch.Tensor, kx: torch.Tensor, us: list[torch.Tensor],
                       g_all: torch.Tensor, q: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                       fold: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """ReplaySSM delta rule: committed state [R, dk, dv], keys kx [n+T, R, dk] (ring then new),
    the n ring u's, log-decays g_all [1+n+T, R, dk] (0 first: the committed state), new q
    [T, R, dk], v [T, R, dv], beta [T, R] -> (y [T, R, dv], all n+T u's, state folded or not)."""
    n, t_new = len(us), q.shape[0]
    seg = _segsum(g_all)  # [1+n+T, 1+n+T, R, dk]
    us = list(us)
    outs = []
    for i in range(t_new):
        t = n + i
        a_c = seg[t + 1, 0].exp()
        w = seg[t + 1, 1 : t + 2].exp() * kx[: t + 1]  # [t+1, R, dk]
        ki = kx[t]
        pre = _read(state, a_c * ki) + _weighted((w[:t] * ki[None]).sum(-1), us)
        us.append(beta[i][:, None] * (v[i] - pre))
        outs.append(_read(state, a_c * q[i]) + _weighted((w * q[i][None]).sum(-1), us))
    if fold:
        end = seg[-1]  # [1+n+T, R, dk]: decay from each entry to the end
        kd = end[1:].exp() * kx
        state = end[0].exp()[..., None] * state + (kd[..., :, None]
                                                   * torch.stack(us)[..., None, :]).sum(0)
    return torch.stack(outs, dim=0), us, state


def _l2norm_div(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Kimi's l2norm: x / sqrt(sum(x^2) + eps) over the last dim."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3.5's l2norm: x * rsqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ---- generation (the "cpu-executor" backend for hybrid models) ---------------------------------
def generate(
    spec_or_cfg: str | HybridConfig,
    prompts: list[list[int]],
    steps: int,
    replay_window: int | None = None,
    seed: int = 0,
    weights: dict[str, torch.Tensor] | None = None,
    num_sms: int = DEFAULT_SMS,
    check: bool = True,
) -> list[list[int]]:
    """Greedy new tokens per prompt, decode steps run by the hybrid program on the executor.

    spec_or_cfg: a hybrid preset name or checkpoint directory (weights loaded, random presets
    drawn from `seed`), or a config with `weights`. replay_window: None for the recurrent GDN
    update, L for ReplaySSM folding every L tokens. The prompt is prefilled by the reference in
    "bf16" mode; every decode step is one program step that feeds its own tokens back.
    """
    from megakernel.hybrid.weights import load_model
    from reference.hybrid import build_model

    if isinstance(spec_or_cfg, str):
        cfg, weights = load_model(spec_or_cfg, seed=seed, dtype=torch.bfloat16)
    else:
        cfg = spec_or_cfg
        if weights is None:
            raise ExecutorError("a config needs its weights")
    if cfg.family not in SUPPORTED_FAMILIES:
        raise ExecutorError(f"the cpu-executor backend does not serve {cfg.family} hybrid "
                            f"models yet (supported: {', '.join(SUPPORTED_FAMILIES)})")
    if steps < 0:
        raise ExecutorError(f"steps must be >= 0, got {steps}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ExecutorError("every prompt needs at least one token")
    if steps == 0:
        return [[] for _ in prompts]
    max_seq_len = max(len(p) for p in prompts) + steps
    ref = build_model(cfg, weights, mode="bf16", replay_window=replay_window)
    cache = ref.new_cache(len(prompts), max_seq_len)
    first = ref.prefill(cache, prompts).argmax(dim=-1)  # [B], lowest index wins ties
    out = [first]
    if steps > 1:
        prog = compile_hybrid(cfg, len(prompts), executor_gpu(num_sms), tokens=1,
                              max_seq_len=max_seq_len, replay_window=replay_window)
        ex = HybridExecutor(prog, pack_hybrid(cfg, weights), check=check)
        ex.load_cache(cache)
        tok = ex.step(first[:, None], seed=seed)
        out.append(tok[:, 0])
        for i in range(steps - 2):
            out.append(ex.step(None, seed=seed + 1 + i)[:, 0])
    return torch.stack(out, dim=1).tolist()
