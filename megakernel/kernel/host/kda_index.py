"""Index arithmetic of the Kimi delta attention handler (KDA_CORE / KDA_REPLAY;
kernel/device/kda.py), no DSL.

KDA is GDN's gated delta rule with one value head per key head (R = 1, dk = dv = d) and a
channel-wise decay: a record runs one (sequence b, head h) on one CTA through the phases of
gdn_index.py, with these differences:

2. gates: beta[t] = sigmoid(b); the low-rank inputs bf16(f_a x), bf16(g_a x) [T][2][d] to shared
   memory, then one warp per (output channel i, f or g; lanes over the d inputs, the T tokens
   accumulated together so each f_b / g_b row is read once): g[t][i] = -exp(A_log[h])
   softplus(f_b[h d + i] . bf16(f_a) + dt_bias[h d + i]) and gate[t][i] = g_b[h d + i] .
   bf16(g_a).
3. state (recurrent): a thread's rows are first decayed by e^{g[t][row]}, then the GDN column
   step runs with unit scalar decay: u = beta (v - S^T k), o = S^T q + (k.q) u, S += k u^T.
4. output: RMSNorm(o) * w * sigmoid(gate) (GDN: silu(z)).

KDA_REPLAY (per-channel log-decays G_i(e, p] summed over the entries (e, p]): r1 as GDN's, the g
entries [d] per channel (gs [CAP][d]); r2 the dots carry their channel decays, dots[t][0|1][e] =
sum_i e^{G_i(e, p]} k_e[i] k_t[i] | q_t[i] (p = n + t), and the decayed vectors the state reads
go to shared memory: kc[t][0|1][i] = q_t[i] | k_t[i] times e^{G_i[0, p]} (from the committed
state), kf[e][i] = e^{G_i(e, n + T)} k_e[i] and tot[i] = e^{G_i[0, n + T)} (the fold). r3 is
GDN's with every scalar decay 1: S_c^T kc, dots times u, and at a fold S <- tot S_c + sum_e kf_e
u_e^T.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakernel.isa.records import ROW_ALIGN
from megakernel.kernel.host.gdn_index import GDNShape, check_gdn


@dataclass(frozen=True)
class KDAShape(GDNShape):
    """A build's KDA constants as a GDN shape with Hk = Hv = H, dk = dv = d (spec.constants("kda") =
    (H, d, K)): GDN's conv channels, window, state, ring k / u, count, tiles and output index
    KDA's buffers unchanged."""

    @classmethod
    def of(cls, kda: tuple[int, ...], batch: int, tokens: int, num_warps: int,
           cap: int = 0) -> KDAShape:
        h, d, k = kda
        return cls(h, h, d, d, k, batch, tokens, num_warps, cap)

    @classmethod
    def for_spec(cls, spec) -> KDAShape:  # noqa: ANN001 (KernelSpec)
        """The shape of a build (its kind's KernelSpec constants)."""
        return cls.of(spec.constants("kda"), spec.batch, spec.tokens, spec.num_warps, spec.ring_cap)

    d = property(lambda self: self.dk)

    @property
    def proj_width(self) -> int:
        """P: [q | k | v (H d each) | f_a (d) | b (H) | g_a (d)], zero rows to a multiple of 16."""
        rows = self.conv_dim + 2 * self.d + self.hv
        return -(-rows // ROW_ALIGN) * ROW_ALIGN

    # ---- shared memory -------------------------------------------------------------------------
    def smem(self) -> dict[str, int]:
        """name -> word offset, and "words": x [T][3 d], beta [T], g [T][d], kq [T], part
        [bufs][NW][2][CW], o [T][d], gate [T][d], lr [T][2][d] (bf16 f_a, g_a); with a ring also
        keys [CAP][d], gs [CAP][d], dots [T][2][CAP], ut [CAP][CW], kc [T][2][d], kf [CAP][d],
        tot [d]."""
        t, d, cap = self.tokens, self.d, self.cap
        ring = (("keys", cap * d), ("gs", cap * d), ("dots", t * 2 * cap), ("ut", cap * self.cw),
                ("kc", t * 2 * d), ("kf", cap * d), ("tot", d))
        out, off = {}, 0
        for name, n in (("x", t * self.ch), ("beta", t), ("g", t * d), ("kq", t),
                        ("part", self.part_bufs * self.num_warps * 2 * self.cw),
                        ("o", t * d), ("gate", t * d), ("lr", t * 2 * d),
                        *(ring if cap else ())):
            out[name] = off
            off += -(-n // 4) * 4  # 16-byte aligned
        out["words"] = off
        return out

    def decay(self, t, i):
        """Word of g [T][d] (and of gate [T][d], lr's rows): token t, channel i."""
        return t * self.d + i

    def low_rank(self, t, which, i):
        """Word of lr [T][2][d]: bf16(f_a x) (which 0) or bf16(g_a x) (1) of token t."""
        return (t * 2 + which) * self.d + i

    def gs_c(self, e, i):
        """Word of gs [CAP][d] (and of keys, kf): entry e, channel i."""
        return e * self.d + i

    def kc(self, t, which, i):
        """Word of kc [T][2][d]: q_t (which 0) or k_t (1) decayed from the committed state."""
        return (t * 2 + which) * self.d + i

    # ---- global memory -------------------------------------------------------------------------
    def beta_col(self, h):
        return self.conv_dim + self.d + h

    def low_rank_col(self, which, i):
        """proj column of f_a (which 0) or g_a (1), input i."""
        return self.conv_dim + which * (self.d + self.hv) + i

    def low_rank_w(self, which, h, i, c):
        """Element of f_b (which 0) or g_b (1) [H d, d] (from CONV_W, after the conv taps): row
        h d + i, column c."""
        return self.conv_dim * self.conv_k + ((which * self.hv + h) * self.d + i) * self.d + c

    def dt_bias(self, h, i):
        """Element of the params row (A_log [H] at h, then dt_bias [H d])."""
        return self.hv + h * self.d + i

    g_entry = property(lambda self: self.hv * self.d)  # ring g values of one entry: [H, d]

    def ring_g(self, b, e, h, i=0):
        """Element (b, entry e, head h, channel i) of the ring's g [B, CAP, H, d]."""
        base = (self.state(self.batch, 0, 0, 0)
                + self.batch * self.cap * (self.key_dim + self.value_dim))
        return base + ((b * self.cap + e) * self.hv + h) * self.d + i


def check_kda(k: KDAShape) -> str:
    """Why the handler cannot run these shapes ('' when it can)."""
    if k.d > 32 and k.d % 32:
        return f"KDA head_dim {k.d} must be <= 32 or a multiple of 32 (state column tiles)"
    return check_gdn(k).replace("GDN key head dim", "KDA head_dim").replace(
        "GDN value head dim", "KDA head_dim").replace("GDN", "KDA")
