"""Index arithmetic of the gated delta rule's device handler (GDN_CORE; kernel/device/gdn.py), no
DSL.

One record runs one (sequence b, key head kh) with its R = Hv / Hk value heads, on one CTA:

1. conv: each of the unit's ch = 2 dk + R dv channels (q, k of kh; v of its value heads) reads
   its fp32 window (K - 1 values) and the T new inputs (proj columns), writes silu(conv) of the T
   tokens to shared memory and its new window back: the window is read once and written once.
2. gates and norms in shared memory: beta, g per (token, value head); q, k l2-normalised per token
   (q times dk^-1/2), k.q per token.
3. state: the value heads' states S [dk, dv] go through registers in column tiles of CW = min(32,
   dv) columns, lane = column (128-byte rows per warp), warp w = rows [w RPW, (w + 1) RPW) of dk
   (RPW = dk / NW values per thread). A column of S evolves on its own given k, q, so a tile stays
   in registers for all T tokens: per token the warps' partial S^T k and S^T q meet in shared
   memory (two buffers, one barrier a token), every thread forms u and o of its column and updates
   its values. Each state element is read once and written once per step.
4. output: per (token, value head) one warp: RMSNorm over dv, times w and silu(z), to bf16.

GDN_REPLAY (ReplaySSM, ring capacity CAP = L - 1 + T, L = KernelSpec.replay_window) runs the same
conv, gates, norms and output; with n = ring_count[b, kh] committed entries (n < L) and the T new
ones at positions n .. n + T - 1 (entry e: k_e [dk] of the key head, u_e [R, dv], g_e [R]; the
decay from entry e to position t is e^{sum of g over entries (e, t]}, summed over the segment as
reference/layers/common.segsum):

  r1. ring: the committed entries' k and g come to shared memory (keys [CAP][dk], gs [R][CAP]:
      n (dk + R) values, read once); the T new k (normalised) and g join them at n .. n + T - 1
      and are appended to the ring (written once).
  r2. dots[t][0 | 1][e] = k_e . k_t | k_e . q_t for every entry e < n + T: one warp per entry,
      all T tokens' k and q against it.
  r3. the committed state S_c through registers in the column tiles of step 3 (read once): the
      partial S_c^T k_t, S_c^T q_t of all T tokens go to shared memory at once (S_c does not
      change: one barrier a tile, not a token). A column of u and o depends on that column of
      S_c only, so warp 0 (lane = column) solves the tokens in order: it brings the committed
      u_e[col] from the ring to the tile's `ut` [CAP][CW] (read once), forms u_t = beta (v - e^G
      S_c^T k - sum_{e<t} decay dots u_e) and o_t = e^G S_c^T q + sum_{e<=t} decay dots u_e, and
      appends u_t to `ut` and to the ring (written once). When n + T >= L every warp then folds
      its rows, S <- e^{G} S_c + sum_e decay(e) k_e u_e^T over all n + T entries, and writes the
      tile once; otherwise S_c is not written. The count becomes 0 (fold) or n + T.

Traffic per record and step: the window read and written once, S_c read once and written only at
a fold (one step in ceil(L / T)), the n committed entries read once, T entries written: what
layers/recurrent.py charges (stages() `pre`, `st_store`; step_bytes).

Plain arithmetic on ints here and in the host emulation (tests/kernel/test_kernel_gdn_emulation.py),
on Int32/Int64 in the kernel: the same functions index both.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakernel.isa.records import ROW_ALIGN

LANES = 32
L2NORM_EPS = 1e-6  # Qwen3.5's l2norm: x * rsqrt(sum(x^2) + 1e-6)
SOFTPLUS_LINEAR = 20.0  # softplus(x) = x above this (torch's threshold)


@dataclass(frozen=True)
class GDNShape:
    """A build's GDN constants: spec.constants("gdn") = (Hk, Hv, dk, dv, K), batch, tokens,
    warps, and the ReplaySSM ring capacity (0: the recurrent update)."""

    hk: int
    hv: int
    dk: int
    dv: int
    conv_k: int
    batch: int
    tokens: int
    num_warps: int
    cap: int = 0  # ring entries per (sequence, layer): L - 1 + T (KernelSpec.ring_cap)

    @classmethod
    def of(cls, gdn: tuple[int, ...], batch: int, tokens: int, num_warps: int,
           cap: int = 0) -> GDNShape:
        return cls(*gdn, batch, tokens, num_warps, cap)

    @classmethod
    def for_spec(cls, spec) -> GDNShape:  # noqa: ANN001 (KernelSpec)
        """The shape of a build (its kind's KernelSpec constants)."""
        return cls.of(spec.constants("gdn"), spec.batch, spec.tokens, spec.num_warps, spec.ring_cap)

    # ---- sizes ---------------------------------------------------------------------------------
    rep = property(lambda self: self.hv // self.hk)  # R: value heads per key head (per record)
    key_dim = property(lambda self: self.hk * self.dk)
    value_dim = property(lambda self: self.hv * self.dv)  # ssm_out columns
    conv_dim = property(lambda self: 2 * self.key_dim + self.value_dim)  # C: [q | k | v]
    ch = property(lambda self: 2 * self.dk + self.rep * self.dv)  # conv channels of one record
    win = property(lambda self: self.conv_k - 1)  # window values per channel

    @property
    def proj_width(self) -> int:
        """P: columns of proj [N, P] (the layer kind's packed projection, zero-padded rows)."""
        rows = self.conv_dim + self.value_dim + 2 * self.hv
        return -(-rows // ROW_ALIGN) * ROW_ALIGN

    cw = property(lambda self: min(LANES, self.dv))  # state columns per tile (lanes used)
    tiles = property(lambda self: -(-self.dv // self.cw))  # column tiles per value head
    rpw = property(lambda self: self.dk // self.num_warps)  # state rows per warp (per thread)
    replay_window = property(lambda self: self.cap - self.tokens + 1 if self.cap else 0)  # L
    # partial buffers: two alternate per token (recurrent); replay has one per token
    part_bufs = property(lambda self: self.tokens if self.cap else 2)

    def round_trips(self) -> int:
        """Dependent global round trips of one core record on its longest warp, counted from
        the loop nest above (the cost model's per-record latency term): the conv (1), the gates
        and norms (1), one per column tile of the R value heads' states (its loads, then its T
        tokens in registers), and the output: per (token, value head) a warp takes, the
        RMSNorm's loads, z, the weight and the store (4). ReplaySSM adds the ring (1) and warp
        0's solve of each tile, one trip per ring entry (CAP) at most."""
        trips = 2 + self.rep * self.tiles + 4 * -(-self.tokens * self.rep // self.num_warps)
        if self.cap:
            trips += 1 + self.rep * self.tiles * self.cap
        return trips

    # ---- shared memory (fp32 words from the start of the scratch span) --------------------------
    def smem(self) -> dict[str, int]:
        """name -> word offset, and "words" the total: x [T][ch] (conv outputs: q | k | v),
        beta [T][R], g [T][R], kq [T], part [bufs][NW][2][CW] (per-warp S^T k, S^T q), o [T][R][dv];
        with a ring (cap > 0) also keys [CAP][dk], gs [R][CAP], dots [T][2][CAP], ut [CAP][CW]
        (steps r1-r3 above)."""
        t, r, cap = self.tokens, self.rep, self.cap
        out, off = {}, 0
        ring = (("keys", cap * self.dk), ("gs", r * cap), ("dots", t * 2 * cap),
                ("ut", cap * self.cw))
        for name, n in (("x", t * self.ch), ("beta", t * r), ("g", t * r), ("kq", t),
                        ("part", self.part_bufs * self.num_warps * 2 * self.cw),
                        ("o", t * r * self.dv), *(ring if cap else ())):
            out[name] = off
            off += -(-n // 4) * 4  # 16-byte aligned
        out["words"] = off
        return out

    # ---- indices -------------------------------------------------------------------------------
    def channel(self, c, kh, minimum=min):
        """Conv channel (proj column, window row) of the record's channel c of key head kh:
        q [0, dk) -> kh dk + c; k [dk, 2 dk) -> Hk dk + kh dk + c - dk; v -> 2 Hk dk + kh R dv +
        c - 2 dk. Branch-free (`minimum` = cutlass.min in the kernel)."""
        dk = self.dk
        part = minimum(c // dk, 2)  # 0: q, 1: k, 2: v
        is_v = part // 2
        stride = dk + is_v * (self.rep * self.dv - dk)  # channels of one key head in the part
        return part * self.key_dim + c - part * dk + kh * stride

    def window(self, b, chan, j):
        """Element (b, chan, j) of the conv window [B, C, K-1] (from the record's STATE)."""
        return (b * self.conv_dim + chan) * self.win + j

    def state(self, b, h, i, j):
        """Element (b, h, i, j) of the state [B, Hv, dk, dv] (from STATE: after the window)."""
        conv = self.batch * self.conv_dim * self.win
        return conv + ((b * self.hv + h) * self.dk + i) * self.dv + j

    # ---- the ReplaySSM ring (after the state: k [B, CAP, Hk, dk], u [B, CAP, Hv, dv], g [B, CAP,
    # Hv]) and its count
    def ring_k(self, b, e, kh, i):
        """Element (b, entry e, key head kh, i) of the ring's k."""
        base = self.state(self.batch, 0, 0, 0)
        return base + ((b * self.cap + e) * self.hk + kh) * self.dk + i

    def ring_u(self, b, e, h, j):
        """Element (b, entry e, value head h, j) of the ring's u."""
        base = self.state(self.batch, 0, 0, 0) + self.batch * self.cap * self.key_dim
        return base + ((b * self.cap + e) * self.hv + h) * self.dv + j

    def ring_g(self, b, e, h):
        """Element (b, entry e, value head h) of the ring's g."""
        base = (self.state(self.batch, 0, 0, 0)
                + self.batch * self.cap * (self.key_dim + self.value_dim))
        return base + (b * self.cap + e) * self.hv + h

    g_entry = property(lambda self: self.hv)  # ring g values of one entry (all heads)

    def ring_end(self):
        """Element after the ring (k, u, g): where a speculative step's `pending` starts."""
        return (self.state(self.batch, 0, 0, 0)
                + self.batch * self.cap * (self.key_dim + self.value_dim + self.g_entry))

    def pending(self, b, chan, t):
        """Element (b, chan, t) of a speculative step's pending conv inputs [B, C, T] (after the
        ring, layers/recurrent.py state())."""
        return self.ring_end() + (b * self.conv_dim + chan) * self.tokens + t

    def count(self, b, kh):
        """ring_count[b, kh] of the layer (from the record's COUNT_OFF)."""
        return b * self.hk + kh

    def dot(self, t, which, e):
        """Word of dots [T][2][CAP]: k_e . k_t (which 0) or k_e . q_t (1)."""
        return (t * 2 + which) * self.cap + e

    def key(self, e, i):
        """Word of keys [CAP][dk]: element i of entry e's k."""
        return e * self.dk + i

    def gs(self, r, e):
        """Word of gs [R][CAP]: entry e's g of the record's value head r."""
        return r * self.cap + e

    def ut(self, e, lane):
        """Word of ut [CAP][CW]: entry e's u of the tile's column `lane`."""
        return e * self.cw + lane

    def proj(self, b, t, col):
        """Element of proj [N, P] (from PROJ_OFF): row b T + t, column col."""
        return (b * self.tokens + t) * self.proj_width + col

    def z_col(self, h, j):
        return self.conv_dim + h * self.dv + j

    def beta_col(self, h):
        return self.conv_dim + self.value_dim + h

    def a_col(self, h):
        return self.conv_dim + self.value_dim + self.hv + h

    def out(self, b, t, h, j):
        """Element of ssm_out [N, Hv dv] (from OUT_OFF)."""
        return (b * self.tokens + t) * self.value_dim + h * self.dv + j

    def tile_column(self, it, lane):
        """(value head of the record r, column j) of lane `lane` in state tile `it` of the record
        (tiles value head by value head); j >= dv or lane >= CW: idle."""
        r = it // self.tiles
        return r, (it - r * self.tiles) * self.cw + lane

    def part(self, buf, warp, which, lane):
        """Word of part [2][NW][2][CW]: warp's partial S^T k (which 0) or S^T q (1), buffer buf."""
        return ((buf * self.num_warps + warp) * 2 + which) * self.cw + lane


def check_gdn(g: GDNShape) -> str:
    """Why the handler cannot run these shapes ('' when it can)."""
    if g.dk % g.num_warps:
        return f"GDN key head dim {g.dk} must be a multiple of the {g.num_warps} warps"
    if g.dv > LANES and g.dv % LANES:
        return f"GDN value head dim {g.dv} must be <= {LANES} or a multiple of it"
    if 2 * g.tokens > g.num_warps:
        return f"GDN l2 norms need a warp per (token, q/k): {g.tokens} tokens > {g.num_warps // 2}"
    return ""
