"""The model's frame, around its blocks: the embedding gather, the final RMSNorm + LM head with a
partial argmax, the argmax merge; and the matvecs several kinds share: the residual projections
every kind ends with (o_proj, out_proj, down: a bf16 input added into the fp32 residual stream h)
and PROJ, the fused input projection of a recurrent or MLA layer into fp32.

Buffers: f32 h [N, H] (the residual stream, fp32 throughout), logits [N, V], partial argmax
[num_sms, N, 2] (value, vocab index as an exact float); i32 tokens_in [N], tokens_out [N],
lengths [B]. N = B * T rows; row n is token t = n % T of sequence b = n // T, at position
lengths[b] + t.

The LM head is padded to ROW_ALIGN rows in the arena (zero rows; the embedding itself when tied):
rows past V never store a logit and never take part in the argmax. Ties: the lowest index wins.
"""

from __future__ import annotations

from megakernel.isa.records import FLAG_ADVANCE, FLAG_FEEDBACK, ROW_ALIGN
from megakernel.isa.registry import MATVEC, OpSpec, register
from megakernel.isa.stages import Instr, Stage
from megakernel.layers import speculative
from megakernel.layers.base import OUTPUT, STREAM, Need, StepShape, misaligned, partial_argmax_bytes

END = register(OpSpec(0, "END", "frame", "end of this CTA's queue", (), device=True, step="all"))


def check_embed(d: dict, spec) -> str:  # noqa: ANN001 (KernelSpec)
    """EMBED's rows and vectors against the build (launch.checks.check_records)."""
    if d["K"] != spec.hidden or not 0 <= d["N0"] <= d["N1"] <= spec.rows:
        return (f"rows [{d['N0']}, {d['N1']}) of K={d['K']} do not fit the build's "
                f"N={spec.rows}, H={spec.hidden}")
    return misaligned(d, {"W": 8, "K": 8, "OUT_OFF": 4})


EMBED = register(OpSpec(
    1, "EMBED", "frame", "gather embedding rows of tokens_in[N0:N1] into h (fp32)",
    (
        ("W_LO", "weights: embedding matrix [V, H] base, low 32 bits"),
        ("W_HI", "high 32 bits"),
        ("N0", "first activation row"),
        ("N1", "one past the last activation row"),
        ("K", "hidden size H"),
        ("TOK_OFF", "i32: tokens_in [N]"),
        ("OUT_OFF", "f32: h [N, H]; h[n] = fp32(embedding[tokens_in[n]])"),
    ), device=True, step="all", starts_step=True, covers=("rows", "N0", "N1"), check=check_embed))

OPROJ = register(OpSpec(
    5, "OPROJ", "frame", "slab of an output projection (o_proj, out_proj) on a bf16 input, added "
    "into h", MATVEC, notes="OUT_OFF = f32 h [N, H]: h[n, ROW0 + r] += acc (fp32).",
    slab=True, matvec="epilogues.Residual", device=True))

DOWN = register(OpSpec(
    7, "DOWN", "frame", "slab of an MLP's down projection on its bf16 activation, added into h",
    MATVEC, notes="OUT_OFF = f32 h [N, H]: h[n, ROW0 + r] += acc (fp32).",
    slab=True, matvec="epilogues.Residual", device=True))

PROJ = register(OpSpec(
    16, "PROJ", "frame", "RMSNorm(h) -> slab of a recurrent or MLA layer's fused input projection "
    "(fp32)", MATVEC + (("OUT_W", "row width P of the f32 output [N, P]"),),
    notes="OUT_OFF = f32 proj [N, P]: proj[n, ROW0 + r] = acc (fp32, not rounded).",
    slab=True, matvec="epilogues.Proj", device=True))

LMHEAD = register(OpSpec(
    8, "LMHEAD", "frame",
    "final RMSNorm(h) -> vocab slab of the LM head -> logits + partial argmax",
    MATVEC + (
        ("TILE", "partial-argmax slot of this slab"),
        ("PARG_OFF", "f32: partial argmax [n_lm_tiles, N, 2] = (max logit, its vocab index)"),
    ),
    notes="OUT_OFF = f32 logits [N, V]: rows ROW0 .. ROW0 + NROWS of the padded head, those < V "
    "(header V) stored; slot TILE gets the slab's max over rows < V and the lowest index of it.",
    slab=True, matvec="epilogues.LMHead", device=True, step="all"))

ARGMAX = register(OpSpec(
    9, "ARGMAX", "frame", "merge partial argmaxes -> tokens_out; optionally advance lengths, feed "
    "tokens back",
    (
        ("N_TILES", "partial-argmax slots"),
        ("PARG_OFF", "f32: partial argmax [n_tiles, N, 2]"),
        ("OUT_OFF", "i32: tokens_out [N]"),
        ("TOK_OFF", "i32: tokens_in [N]"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("FLAGS", "FLAG_ADVANCE (lengths[b] += T) | FLAG_FEEDBACK (tokens_in = tokens_out)"),
    ),
    notes="tokens_out[n] = the index of the largest of the N_TILES partials of row n; equal "
    "maxima (in one slab or several) go to the lowest vocab index, whatever the tile order.",
    device=True, step="plain", ends_step=True, waits_on="LMHEAD", covers=("one", "", "")))


def padded_vocab(vocab: int) -> int:
    """Rows of the packed LM head: the vocabulary rounded up to ROW_ALIGN."""
    return -(-vocab // ROW_ALIGN) * ROW_ALIGN


def needs(model, shape: StepShape) -> list[Need]:  # noqa: ANN001
    n = shape.rows
    return [Need("f32", "h", (n, model.hidden_size), STREAM),
            Need("f32", "logits", (n, model.vocab_size), OUTPUT),
            Need("f32", "part_argmax", (shape.num_sms, n, 2), OUTPUT),
            Need("i32", "tokens_in", (n,), STREAM), Need("i32", "tokens_out", (n,), STREAM),
            Need("i32", "lengths", (shape.batch,), STREAM, persistent=True)] + (
        # paged: the caller's block table [B, max_blocks] and slot mapping [N] (program/paged.py)
        [Need("i32", "block_table", (shape.batch, shape.paged.max_blocks), STREAM,
              persistent=True),
         Need("i32", "slot_mapping", (n,), STREAM, persistent=True)] if shape.paged else []) + (
        speculative.needs(model, shape))


def embed_stage(ctx) -> tuple[Stage, int]:  # noqa: ANN001
    """EMBED: h[n] = embedding[tokens_in[n]] for the N rows, in chunks of <= 32 KiB of gathered
    bf16; signals counter "embed"."""
    n, hid = ctx.rows, ctx.model.hidden_size
    e_rows = max(1, min(n, (32 * 1024) // (2 * hid)))
    c_embed = ctx.ctr("embed")
    f32, i32 = ctx.buf.f32, ctx.buf.i32

    def mk_embed(u0: int, u1: int) -> Instr:
        n0, n1 = u0 * e_rows, min(n, u1 * e_rows)
        return Instr(EMBED, -1, dict(W=ctx.lay["embed"].offset, N0=n0, N1=n1, K=hid,
                                     TOK_OFF=i32["tokens_in"].offset, OUT_OFF=f32["h"].offset),
                     signal=c_embed, hbm_bytes=(n1 - n0) * hid * 2, l2_bytes=(n1 - n0) * 4,
                     store_bytes=(n1 - n0) * hid * 4)

    return Stage("embed", EMBED, -1, -(-n // e_rows), False, mk_embed), c_embed


def residual_stage(ctx, op, blk, matrix: str, k: int, in_off: int, wait: int,  # noqa: ANN001
                   counter: str) -> tuple[Stage, int]:
    """A block's closing matvec (OPROJ or DOWN): rows of packed matrix `L{layer}.{name}.{matrix}`
    [H, k] on the bf16 input at `in_off`, added into h; ROW_ALIGN rows per unit."""
    layer, w_off = blk.layer, ctx.lay[f"{blk.key}.{matrix}"].offset
    n, h_off, c = ctx.rows, ctx.buf.f32["h"].offset, ctx.ctr(counter)

    def mk(u0: int, u1: int) -> Instr:
        r0, rows = u0 * ROW_ALIGN, (u1 - u0) * ROW_ALIGN
        return ctx.matvec(op, layer, w_off, r0, rows, k, -1, in_off, h_off, wait, c,
                          n * rows * 4, residual=True)

    return Stage(counter, op, layer, ctx.model.hidden_size // ROW_ALIGN, True, mk, ROW_ALIGN), c


def proj_stage(ctx, blk, height: int, wait: int) -> tuple[Stage, int]:  # noqa: ANN001
    """PROJ: RMSNorm(h) -> packed `L{layer}.{name}.proj` [height, H] -> f32 proj [N, height]
    (the start of the shared region proj)."""
    layer, n, hid = blk.layer, ctx.rows, ctx.model.hidden_size
    w_off, norm = ctx.lay[f"{blk.key}.proj"].offset, ctx.lay[f"{blk.key}.norm"].offset
    proj = ctx.buf.f32["proj"]
    h_off, width, c = ctx.buf.f32["h"].offset, height, ctx.ctr(f"L{layer}.proj")

    def mk(u0: int, u1: int) -> Instr:
        r0, rows = u0 * ROW_ALIGN, (u1 - u0) * ROW_ALIGN
        return ctx.matvec(PROJ, layer, w_off, r0, rows, hid, norm, h_off, proj.offset, wait, c,
                          n * rows * 4, OUT_W=width)

    return Stage(f"L{layer}.proj", PROJ, layer, height // ROW_ALIGN, True, mk, ROW_ALIGN), c


def round_rows(x: int) -> int:
    """x rounded up to ROW_ALIGN (a packed projection's zero-padded height)."""
    return -(-x // ROW_ALIGN) * ROW_ALIGN


def head_stages(ctx, wait: int) -> tuple[list[Stage], int]:  # noqa: ANN001
    """LMHEAD (final norm, padded vocab slabs) and ARGMAX, or in a speculative step ACCEPT (and
    NGRAM: layers/speculative.py); the LM-head slots are numbered after scheduling
    (program/compiler.number_lm_tiles). Returns the stages and the counter of ARGMAX / ACCEPT."""
    n, hid, f32, i32 = ctx.rows, ctx.model.hidden_size, ctx.buf.f32, ctx.buf.i32
    c_lm = ctx.ctr("lmhead")
    lm_off, vpad = ctx.lay.lm_head.offset, padded_vocab(ctx.model.vocab_size)

    def mk_lm(u0: int, u1: int) -> Instr:
        r0, rows = u0 * ROW_ALIGN, (u1 - u0) * ROW_ALIGN
        return ctx.matvec(LMHEAD, -1, lm_off, r0, rows, hid, ctx.lay["final_norm"].offset,
                          f32["h"].offset, f32["logits"].offset, wait, c_lm,
                          n * rows * 4 + n * 8, TILE=-1, PARG_OFF=f32["part_argmax"].offset)

    lm = Stage("lmhead", LMHEAD, -1, vpad // ROW_ALIGN, True, mk_lm, ROW_ALIGN)
    if ctx.drafts:
        tail, c_end = speculative.accept_stages(ctx, c_lm, vpad // ROW_ALIGN)
        return [lm, *tail], c_end
    # a paged program's caller owns lengths and input ids (program/paged.py)
    flags = 0 if ctx.buf.paged else FLAG_ADVANCE | (FLAG_FEEDBACK if ctx.tokens == 1 else 0)

    def mk_argmax(u0: int, u1: int) -> Instr:
        nt = vpad // ROW_ALIGN  # an upper bound; number_lm_tiles sets the slots and their bytes
        return Instr(ARGMAX, -1, dict(
            N_TILES=nt, PARG_OFF=f32["part_argmax"].offset, OUT_OFF=i32["tokens_out"].offset,
            TOK_OFF=i32["tokens_in"].offset, LEN_OFF=i32["lengths"].offset, FLAGS=flags),
            wait=c_lm, l2_bytes=partial_argmax_bytes(nt, n), store_bytes=n * 8 + ctx.batch * 4)

    return [lm, Stage("argmax", ARGMAX, -1, 1, False, mk_argmax)], c_lm
