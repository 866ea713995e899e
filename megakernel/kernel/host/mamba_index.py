"""Index arithmetic of the Mamba2 device handler (MAMBA_CORE; kernel/mamba2.py), no DSL.

One record runs one (sequence b, group j) with its R = H / G heads h = j R + r, on one CTA. A warp
issues in order, so every phase issues its global loads together before their first use (one
memory round trip, not one per loop trip):

1. conv: each of the unit's ch = R P + 2 N channels (x of its heads, then the group's B and C)
   reads its fp32 window (K - 1 values) and the T new inputs (proj columns after z), writes
   silu(conv + bias) of the T tokens to shared memory and its new window back: the window is read
   once and written once. A thread takes the channels tidx + NT i (conv_channel), conv_batch of
   them at once (their window, inputs, bias and taps loaded before the first sum). The gates
   (dt = softplus(dt + dt_bias), e^{dt A}, A = -exp(A_log), per (token, head)) load their inputs
   with the first conv batch and finish before its sums; the record's D and A per head go to
   shared memory with them. After a barrier one warp per token forms B . C.
2. state: the record's R heads' states S [P, N] are R P contiguous rows of N fp32 (head-major),
   held in registers in row tiles: LPR = min(32, N) lanes on a row (lane l has the columns
   l + LPR c, c < N / LPR: a warp load is 128 contiguous bytes), 32 / LPR rows per warp pass,
   RPT passes per thread (RPT * N / LPR <= REG_VALUES registers). Rows evolve on their own given
   x, B, C, dt, so a tile stays in registers for all T tokens: per token a row's S . C is a
   shuffle reduction over its LPR lanes (no barrier), y = e^{dt A} (S . C) + dt (B . C) x + D x
   goes to shared memory, then S <- e^{dt A} S + x (dt B). The next tile's loads are issued
   before this tile's arithmetic (two register tiles), so the tiles' round trips overlap the
   work (the last tile's trip reloads its own values, an L1 hit, rather than branch). Each state
   element is read once and written once per step, the bytes layers/recurrent.py charges.
3. output: every consumer thread takes the columns c = tidx + NT i of the group's R P (out_col;
   its z and norm weights loaded first): g = y silu(z); per token the sum of g^2 over the
   thread's columns in order, over the warp by a butterfly, then over the NW warps' partials in
   warp order (ss [T][NW] in shared memory, one barrier); g rsqrt(mean(g^2) + eps) w to bf16.

MAMBA_REPLAY (ReplaySSM, ring capacity CAP = L - 1 + T, L = KernelSpec.replay_window) runs the
same conv, gates and output; with n = ring_count[b, j] committed entries (n < L) and the T new
ones at n .. n + T - 1 (entry e: x_e [R P], B_e [N], dt_e [R]; Lam_h(t, e) = A_h sum dt_h over
entries (e, t], summed over the segment as reference/layers/common.segsum):

  r1. ring: the committed entries' B and dt come to shared memory (n (N + R) values, read once,
      RING_BATCH loads per thread in flight), the T new entries are appended to the ring (x, B,
      dt: written once); lam[e][r] = A dt.
  r2. dots[t][e] = B_e . C_t for e <= n + t: one warp per (t, e).
  r3. per (token, entry, head) coef[t][e][r] = dt_e e^{Lam(n+t, e)} dots[t][e] (0 after n + t),
      decay[t][r] = e^{Lam(n+t, c)} (from the committed state), and the fold weights
      wf[e][r] = dt_e e^{Lam(n+T-1, e)}: one thread each, the decays summed over the segment.
  r4. the committed state S_c in the row tiles of step 2, read once: lane l of a row holds
      x_e[row] of its entries e = l mod LPR + LPR i (entry(), loaded with the tile's state, a
      committed one from the ring, a new one from shared memory); per row the lanes of the row
      share y_t = decay (S_c . C_t) + sum_e coef[t][e] x_e[row] + D x_t, one segmented reduction
      per token. When n + T >= L the tile is folded, S <- decay[T-1] S_c + sum_e x_e[row]
      (wf[e] B_e), entries in order, x_e[row] shuffled from the lane that holds it
      (entry_lane), written once, and the count is 0; otherwise S_c is not written and the
      count is n + T.

Traffic per record and step: S_c read once and written only at a fold (one step in L / T), the n
committed entries read once (B and dt to shared memory, x by the state tiles), T entries
written, the window read and written once: what layers/recurrent.py charges (state_read,
ring_read, ring_written, state_written = state T / L).

Plain arithmetic on ints here and in the host emulation
(tests/kernel/test_kernel_mamba_emulation.py), on Int32/Int64 in the kernel: the same functions
index both.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakernel.isa.records import ROW_ALIGN

LANES = 32
REG_VALUES = 16  # state values a thread holds (RPT rows x N / LPR columns)
CONV_VALUES = 48  # conv inputs a thread holds in flight (conv_batch channels)
RING_BATCH = 8  # ring B values a thread loads at once (r1)


@dataclass(frozen=True)
class MambaShape:
    """A build's Mamba2 constants: spec.constants("mamba2") = (H, P, N, G, K), batch, tokens,
    warps, and
    the ReplaySSM ring capacity (0: the recurrent update)."""

    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_k: int
    batch: int
    tokens: int
    num_warps: int
    cap: int = 0  # ring entries per (sequence, layer): L - 1 + T (KernelSpec.ring_cap)

    @classmethod
    def of(cls, mamba: tuple[int, ...], batch: int, tokens: int, num_warps: int,
           cap: int = 0) -> MambaShape:
        return cls(*mamba, batch, tokens, num_warps, cap)

    @classmethod
    def for_spec(cls, spec) -> MambaShape:  # noqa: ANN001 (KernelSpec)
        """The shape of a build (its kind's KernelSpec constants)."""
        return cls.of(spec.constants("mamba2"), spec.batch, spec.tokens, spec.num_warps,
                      spec.ring_cap)

    # ---- sizes ---------------------------------------------------------------------------------
    rep = property(lambda self: self.heads // self.groups)  # R: heads per group (per record)
    d_inner = property(lambda self: self.heads * self.head_dim)  # ssm_out columns
    gn = property(lambda self: self.groups * self.state_size)
    conv_dim = property(lambda self: self.d_inner + 2 * self.gn)  # C: [x | B | C]
    rows = property(lambda self: self.rep * self.head_dim)  # R P: state rows (and y) of a record
    ch = property(lambda self: self.rows + 2 * self.state_size)  # conv channels of one record
    win = property(lambda self: self.conv_k - 1)  # window values per channel

    @property
    def proj_width(self) -> int:
        """Columns of proj [N, P'] ([z | xBC | dt], zero-padded to a multiple of 16)."""
        rows = self.d_inner + self.conv_dim + self.heads
        return -(-rows // ROW_ALIGN) * ROW_ALIGN

    lpr = property(lambda self: min(LANES, self.state_size))  # lanes on a state row
    cpl = property(lambda self: self.state_size // self.lpr)  # columns per lane
    rpp = property(lambda self: LANES // self.lpr)  # rows per warp pass

    @property
    def rpt(self) -> int:
        """Rows per thread in a tile: the largest power of two within REG_VALUES registers that
        divides the record's passes (rows / (warps * rpp))."""
        passes = max(1, self.rows // (self.num_warps * self.rpp))
        r = 1
        while 2 * r * self.cpl <= REG_VALUES and passes % (2 * r) == 0:
            r *= 2
        return r

    tile_rows = property(lambda self: self.num_warps * self.rpp * self.rpt)
    tiles = property(lambda self: self.rows // self.tile_rows)
    threads = property(lambda self: self.num_warps * LANES)  # NT: the consumer threads

    @property
    def conv_batch(self) -> int:
        """Channels whose conv inputs (window, T inputs, bias, taps) a thread loads at once: all
        of its channels within CONV_VALUES registers."""
        per = self.win + self.tokens + 1 + self.conv_k
        return max(1, min(-(-self.ch // self.threads), CONV_VALUES // per))

    conv_chunks = property(lambda self: -(-self.ch // (self.threads * self.conv_batch)))
    gate_items = property(lambda self: -(-self.tokens * self.rep // self.threads))  # per thread
    out_cols = property(lambda self: -(-self.rows // self.threads))  # output columns per thread
    entries = property(lambda self: -(-self.cap // self.lpr))  # ring entries per lane (r4)

    @property
    def ring_batch(self) -> int:
        """Ring B values a thread loads at once in r1 (all of them within RING_BATCH)."""
        return max(1, min(-(-self.cap * self.state_size // self.threads), RING_BATCH))

    dt_items = property(lambda self: -(-self.cap * self.rep // self.threads))  # ring dt (r1)

    def round_trips(self) -> int:
        """Dependent global round trips of one core record, counted from the loop nest above
        (the cost model's per-record latency term): the conv batches with the gates (one per
        conv chunk), one per state tile (the next tile's loads overlap this tile's work, so the
        tiles' trips chain), the output (1). ReplaySSM adds the ring's B and dt (one per
        RING_BATCH values a thread loads) before the tiles."""
        trips = self.conv_chunks + self.tiles + 1
        if self.cap:
            trips += -(-self.cap * self.state_size // (self.threads * self.ring_batch))
            trips += self.dt_items
        return trips

    # ---- shared memory (fp32 words from the start of the scratch span) --------------------------
    def smem(self) -> dict[str, int]:
        """name -> word offset, and "words" the total: x [T][ch] (conv outputs: x | B | C),
        dt [T][R], da [T][R] (e^{dt A}), d [R] and a [R] (the heads' D and A = -exp(A_log)),
        bc [T] (B . C), y [T][R P], ss [T][NW] (the warps' sums of g^2); with a ring (cap > 0)
        also bs [CAP][N] and dtr, lam, wf [CAP][R] (every entry's B, dt, A dt and fold weight),
        dots [T][CAP], coef [T][CAP][R] and decay [T][R] (steps r1-r3 above)."""
        t, r, cap = self.tokens, self.rep, self.cap
        out, off = {}, 0
        ring = (("bs", cap * self.state_size), ("dtr", cap * r), ("lam", cap * r),
                ("wf", cap * r), ("dots", t * cap), ("coef", t * cap * r), ("decay", t * r))
        for name, n in (("x", t * self.ch), ("dt", t * r), ("da", t * r), ("d", r), ("a", r),
                        ("bc", t), ("y", t * self.rows), ("ss", t * self.num_warps),
                        *(ring if cap else ())):
            out[name] = off
            off += -(-n // 4) * 4  # 16-byte aligned
        out["words"] = off
        return out

    # ---- indices -------------------------------------------------------------------------------
    def channel(self, c, j, minimum=min):
        """Conv channel (window row; proj column d_inner + it) of the record's channel c of group
        j: x [0, R P) -> j R P + c; B [R P, R P + N) -> d_inner + j N + c - R P; C -> d_inner +
        G N + j N + c - R P - N. Branch-free (`minimum` = cutlass.min in the kernel)."""
        rp, n = self.rows, self.state_size
        is_bc = minimum(c // rp, 1)  # B or C
        is_c = c // (rp + n)  # C (c < R P + 2 N < 2 (R P + N))
        return c + (1 - is_bc) * j * rp + is_bc * (self.d_inner - rp + j * n) + is_c * (self.gn
                                                                                       - n)

    def window(self, b, chan, k):
        """Element (b, chan, k) of the conv window [B, C, K-1] (from the record's STATE)."""
        return (b * self.conv_dim + chan) * self.win + k

    def state(self, b, j, row, n):
        """Element (b, head j R + row // P, row % P, n) of the state [B, H, P, N] (from STATE:
        after the window); the record's rows are contiguous."""
        conv = self.batch * self.conv_dim * self.win
        return conv + ((b * self.heads + j * self.rep) * self.head_dim + row) * self.state_size + n

    # ---- the ReplaySSM ring (after the state: x [B, CAP, H, P], B [B, CAP, G, N], dt [B, CAP, H])
    def ring_x(self, b, e, j, row):
        """Element (b, entry e, head j R + row // P, row % P) of the ring's x."""
        base = self.state(self.batch, 0, 0, 0)
        return base + ((b * self.cap + e) * self.heads + j * self.rep) * self.head_dim + row

    def ring_b(self, b, e, j, n):
        """Element (b, entry e, group j, n) of the ring's B."""
        base = self.state(self.batch, 0, 0, 0) + self.batch * self.cap * self.d_inner
        return base + ((b * self.cap + e) * self.groups + j) * self.state_size + n

    def ring_dt(self, b, e, j, r):
        """Element (b, entry e, head j R + r) of the ring's dt."""
        base = (self.state(self.batch, 0, 0, 0)
                + self.batch * self.cap * (self.d_inner + self.gn))
        return base + (b * self.cap + e) * self.heads + j * self.rep + r

    def ring_end(self):
        """Element after the ring (x, B, dt): where a speculative step's `pending` starts."""
        return (self.state(self.batch, 0, 0, 0)
                + self.batch * self.cap * (self.d_inner + self.gn + self.heads))

    def pending(self, b, chan, t):
        """Element (b, chan, t) of a speculative step's pending conv inputs [B, C, T] (after the
        ring, layers/recurrent.py state())."""
        return self.ring_end() + (b * self.conv_dim + chan) * self.tokens + t

    def count(self, b, j):
        """ring_count[b, j] of the layer (from the record's COUNT_OFF)."""
        return b * self.groups + j

    def proj(self, b, t, col):
        """Element of proj [N, P'] (from PROJ_OFF): row b T + t, column col."""
        return (b * self.tokens + t) * self.proj_width + col

    def x_col(self, chan):
        """proj column of conv channel chan (xBC follows z)."""
        return self.d_inner + chan

    def z_col(self, j, c):
        """proj column of z for the record's column c (head j R + c // P, dim c % P)."""
        return j * self.rows + c

    def dt_col(self, h):
        return self.d_inner + self.conv_dim + h

    def out(self, b, t, j, c):
        """Element of ssm_out [N, H P] (from OUT_OFF); c also indexes the norm weight from
        NORM_W + j R P."""
        return (b * self.tokens + t) * self.d_inner + j * self.rows + c

    def row(self, it, warp, lane, k):
        """State row of the record that (warp, lane) holds as its k-th row in tile `it`."""
        return it * self.tile_rows + (k * self.num_warps + warp) * self.rpp + lane // self.lpr

    def col(self, lane, c):
        """State column n of a lane's c-th value."""
        return lane % self.lpr + c * self.lpr

    def conv_channel(self, chunk, tidx, i):
        """Record channel of a thread's i-th conv channel in conv chunk `chunk`."""
        return (chunk * self.conv_batch + i) * self.threads + tidx

    def out_col(self, tidx, i):
        """Record column (of y, z, the norm weight and ssm_out) of a thread's i-th output."""
        return tidx + i * self.threads

    def entry(self, lane, i):
        """Ring entry whose x a lane holds as its i-th (r4): lane mod LPR + LPR i."""
        return lane % self.lpr + i * self.lpr

    def entry_lane(self, lane, e):
        """The lane of lane's row group that holds entry e (its index e // LPR there)."""
        return lane - lane % self.lpr + e % self.lpr


def check_mamba(m: MambaShape) -> str:
    """Why the handler cannot run these shapes ('' when it can)."""
    n = m.state_size
    if (n > LANES and n % LANES) or (n < LANES and LANES % n):
        return f"Mamba2 state size {n} must divide {LANES} or be a multiple of it"
    if m.rows % (m.num_warps * m.rpp):
        return (f"Mamba2 state rows per group R P = {m.rows} must be a multiple of "
                f"{m.num_warps * m.rpp} ({m.num_warps} warps x {m.rpp} rows per warp pass)")
    return ""
