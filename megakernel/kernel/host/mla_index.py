"""Index arithmetic of the latent-attention device handlers (MLA_Q, MLA, MLA_O;
kernel/device/mla.py), no DSL.

Shapes (layers/mla.py): H heads, latent rank r, dn / dr query-key dims without / with RoPE (no
RoPE is applied), dv value dims; W = r + dr latent columns per cached position.

MLA_Q (head h, all N rows): q_lat[n, h, :] = sum_i bf16(q_nope[n, h, i]) W_UK_h[i, :]. The N dn
rounded queries go to shared memory; thread = (row part p, column j): RC = min(r, NT) columns per
pass (a warp reads 32 consecutive bf16 of a W_UK row), P = NT / RC parts of the dn rows, N
accumulators a thread, the P parts summed in shared memory in order. W_UK_h is read once.

MLA (sequence b, split s): keys [lo, hi) of the split (attention's rule, spec.attn_keys). First a
warp per new position in [max(lo, length), hi) normalises its latent (RMSNorm, eps 1e-6, times
NORM_W; a lane's r / 32 columns and their weights loaded at once) and stores c and k_rope as bf16
into the cache. Then the keys go in chunks of KC: the chunk's latents are staged in shared memory
as fp32 (read from global once for all heads, BATCH loads a thread in flight; rows LS = W32 apart,
zero-padded to W32, a multiple of 32), a warp per query (token t, head h) scores the chunk (lanes
over the query's dims: lane l holds dims c 32 + l, all W32 / 32 of them loaded at once; one
accumulator per chunk key over those dims, summed over the warp by a butterfly, and lane kk keeps
key kk's score), updates the query's online softmax (m, l) and leaves e^(score - m) and the
rescale alpha in shared memory; every thread then updates the o elements it owns in registers
(element e = tidx + NT u of the [T, H, r] partial, u < OPT). A query with no visible key so far
keeps m = -inf, l = 0, o = 0 (the executor's empty range).

MLA_O (head h, all N rows): a thread per row forms the merge max M and denominator, threads over
(row, column) merge o_lat into shared memory, then a warp per output dim i of W_UV_h (lanes over
r: coalesced, the row's r / 32 loads a lane in flight) reduces all N rows and lane 0 stores bf16;
the loops over the splits load BATCH splits at a time. MLA_Q's threads load BATCH rows of W_UK at
a time. Every batch is consumed in the original order, so the sums are those of one load at a
time.

Plain arithmetic on ints here and in the host emulation (tests/kernel/test_kernel_mla_emulation.py),
on Int32/Int64 in the kernel: the same functions index both.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakernel.isa.records import ROW_ALIGN

LANES = 32
LATENT_NORM_EPS = 1e-6  # Kimi's kv_a_layernorm: the latent's RMSNorm (the executor's too)
# shared memory of one chunk of staged latents (fp32): Kimi's r = 512 gets 8 keys a chunk, which
# keeps the scratch span inside the consumers' regions (the 6-stage weight ring at B = 1)
MLA_CHUNK_BYTES = 24 * 1024
MLA_MAX_OWNED = 64  # o elements a thread holds in registers (OPT)
# global loads a thread issues before it uses the first: a warp issues in order, so a loop that
# uses each load in the trip that issues it pays a memory round trip per trip, this one per batch
BATCH = 8

__all__ = ["BATCH", "LANES", "LATENT_NORM_EPS", "MLAShape", "check_mla", "key_chunk"]


def key_chunk(width: int) -> int:
    """KC, keys per staged chunk of latents W = `width` columns wide: a power of two <= 32 whose
    fp32 rows (W32 words each) fit MLA_CHUNK_BYTES. Every chunk is scored in full (its stale
    rows masked), so a split of k keys scores ceil(k / KC) KC of them."""
    w32 = -(-width // LANES) * LANES
    kc = LANES
    while kc > 1 and 4 * kc * w32 > MLA_CHUNK_BYTES:
        kc //= 2
    return kc


@dataclass(frozen=True)
class MLAShape:
    """A build's MLA constants: spec.constants("mla") = (H, r, dn, dr, dv), batch, tokens,
    threads."""

    heads: int
    rank: int
    nope: int
    rope: int
    vdim: int
    batch: int
    tokens: int
    num_threads: int

    @classmethod
    def of(cls, mla: tuple[int, ...], batch: int, tokens: int, num_threads: int) -> MLAShape:
        return cls(*mla, batch, tokens, num_threads)

    @classmethod
    def for_spec(cls, spec) -> MLAShape:  # noqa: ANN001 (KernelSpec)
        """The shape of a build (its kind's KernelSpec constants)."""
        return cls.of(spec.constants("mla"), spec.batch, spec.tokens, spec.num_threads)

    # ---- sizes ---------------------------------------------------------------------------------
    rows = property(lambda self: self.batch * self.tokens)  # N
    dqk = property(lambda self: self.nope + self.rope)  # q head width in proj
    width = property(lambda self: self.rank + self.rope)  # W: latent columns of a position
    width32 = property(lambda self: -(-self.width // LANES) * LANES)  # W32: W padded to 32
    dim_steps = property(lambda self: self.width32 // LANES)  # a query's dims per lane
    queries = property(lambda self: self.tokens * self.heads)  # T H queries per record
    num_warps = property(lambda self: self.num_threads // LANES)

    @property
    def proj_cols(self) -> int:
        """P: columns of proj [N, P] = [q (H dqk) | c (r) | k_rope (dr)], rows rounded."""
        return -(-(self.heads * self.dqk + self.width) // ROW_ALIGN) * ROW_ALIGN

    @property
    def rc(self) -> int:
        """MLA_Q: W_UK columns per pass (a thread each)."""
        return min(self.rank, self.num_threads)

    @property
    def parts(self) -> int:
        """MLA_Q: P parts of the dn rows (threads per column)."""
        return self.num_threads // self.rc

    @property
    def ls(self) -> int:
        """Words between staged latent rows: W32 (every access of the staged chunk has its lanes
        on consecutive columns of a row, so no bank is hit twice)."""
        return self.width32

    def lat(self, kk, d):
        """Staged latent column d of chunk key kk (fp32 words from the chunk's start)."""
        return kk * self.ls + d

    @property
    def kc(self) -> int:
        """Keys per chunk (`key_chunk`)."""
        return key_chunk(self.width)

    @property
    def owned(self) -> int:
        """OPT: o elements of the [T, H, r] partial a thread holds in registers."""
        return -(-self.queries * self.rank // self.num_threads)

    # ---- proj, weights, buffers ----------------------------------------------------------------
    def proj(self, n, col):
        """fp32 element of proj [N, P] (relative to PROJ_OFF)."""
        return n * self.proj_cols + col

    def q_col(self, h, i):
        """proj column of query dim i of head h (i < dn: nope, dn <= i < dqk: rope)."""
        return h * self.dqk + i

    def lat_col(self, d):
        """proj column of latent column d (d < r: c, r <= d < W: k_rope)."""
        return self.heads * self.dqk + d

    def w_uk(self, h, i, j):
        """kv_b element (relative to KVB_W) of W_UK_h[i, j]: row h (dn + dv) + i."""
        return (h * (self.nope + self.vdim) + i) * self.rank + j

    def w_uv(self, h, i, j):
        """kv_b element of W_UV_h[i, j]: row h (dn + dv) + dn + i."""
        return (h * (self.nope + self.vdim) + self.nope + i) * self.rank + j

    def qlat(self, n, h, j):
        """fp32 element of q_lat [N, H, r] (relative to QLAT_OFF)."""
        return (n * self.heads + h) * self.rank + j

    def po(self, s, n, h, j):
        """fp32 element of the partial latent o [S, N, H, r] (relative to PO_OFF)."""
        return ((s * self.rows + n) * self.heads + h) * self.rank + j

    def pml(self, s, n, h):
        """fp32 element of the partial (m, l) [S, N, H, 2] (relative to PML_OFF): m; l at +1."""
        return ((s * self.rows + n) * self.heads + h) * 2

    def out(self, n, h, i):
        """bf16 element of the attention output [N, H dv] (relative to OUT_OFF)."""
        return n * (self.heads * self.vdim) + h * self.vdim + i

    # ---- the latent cache ----------------------------------------------------------------------
    def c_elem(self, row, d):
        """k cache element of latent dim d at cache row `row` (spec.kv_row with one kv head +
        position): the cache is [slots, B, 1, S_max, r]."""
        return row * self.rank + d

    def kr_elem(self, row, d):
        """v cache element of k_rope dim d at cache row `row`: [slots, B, 1, S_max, dr]."""
        return row * self.rope + d

    # ---- thread mappings -----------------------------------------------------------------------
    def q_part(self, tidx):
        """MLA_Q: (row part p, column j in the pass) of thread tidx."""
        p = tidx // self.rc
        return p, tidx - p * self.rc

    def part_rows(self, p):
        """MLA_Q: rows [i0, i1) of W_UK_h that part p sums."""
        return p * self.nope // self.parts, (p + 1) * self.nope // self.parts

    def red(self, p, n, j):
        """MLA_Q scratch: part p's sum of row n, column j of the pass."""
        return (p * self.rows + n) * self.rc + j

    def query(self, qi):
        """MLA: (token t, head h) of query qi = t H + h."""
        t = qi // self.heads
        return t, qi - t * self.heads

    def own(self, tidx, u):
        """MLA: (query qi, latent column j) of the u-th o element of thread tidx (qi >= T H:
        none)."""
        e = tidx + self.num_threads * u
        qi = e // self.rank
        return qi, e - qi * self.rank

    def new_keys(self, lo, hi, length, maximum=max):
        """MLA: the split's new positions [max(lo, length), hi) (empty when that is <= 0)."""
        return maximum(lo, length), hi

    # ---- shared memory (fp32 words from the start of the scratch span) -------------------------
    def smem(self) -> dict[str, int]:
        """Word offsets of the three handlers' scratch (each record uses its own; they overlay)
        and "words", the largest of them."""
        n, rs = self.rows, self.rank
        q = {"q": 0, "red": n * self.nope}
        q_end = q["red"] + self.parts * n * self.rc
        a = {"lat": 0, "p": self.kc * self.ls}
        a["alpha"] = a["p"] + self.queries * self.kc
        a["m"] = a["alpha"] + self.queries
        a["l"] = a["m"] + self.queries
        a_end = a["l"] + self.queries
        o = {"o": 0, "mx": n * rs, "den": n * rs + n}
        o_end = o["den"] + n
        return {**q, **a, **o, "words": max(q_end, a_end, o_end)}


def check_mla(m: MLAShape) -> str:
    """Why the handlers' thread mappings cannot run this shape ('' when they can)."""
    nt = m.num_threads
    if m.rank % LANES or (m.rank < nt and nt % m.rank) or (m.rank >= nt and m.rank % nt):
        return (f"MLA kv_lora_rank {m.rank} must be a multiple of {LANES} that divides or is a "
                f"multiple of the {nt} threads")
    if m.parts > m.nope:
        return f"MLA qk_nope_head_dim {m.nope} < {m.parts} row parts of W_UK"
    if m.owned > MLA_MAX_OWNED:
        return (f"MLA: T H r = {m.queries * m.rank} partial elements need {m.owned} registers "
                f"a thread > {MLA_MAX_OWNED} (tokens {m.tokens})")
    return ""
