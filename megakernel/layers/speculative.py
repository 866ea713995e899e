"""The speculative step's end: ACCEPT (verify the drafts, emit the accepted tokens and the bonus,
advance the lengths) and NGRAM (the device n-gram drafter), and the buffers they keep.

A speculative program runs T = 1 + k tokens per sequence: row b*T + 0 is the last known token,
rows b*T + 1 .. b*T + k its drafts (reference/speculative.py is the semantics). ACCEPT replaces
ARGMAX: it merges the LM head's partial argmaxes into each row's greedy token, counts the
accepted drafts a, and keeps `emitted[b]` = a + 1 tokens: the positions lengths[b] ..
lengths[b] + a become committed, `lengths[b]` advances by a + 1, and the bonus (the greedy token
of row a) becomes the next step's input 0. A sequence too close to the end of its cache for
another step (lengths + a + 1 + T > S_max) keeps at most what fits, and none once it is full: it
is stepped in place (the engine stops such a row before it gets there). KV entries past the
accepted ones are overwritten by the next step; recurrent layers commit `emitted[b]` entries of
their ReplaySSM ring in their COMMIT records, which wait on ACCEPT (layers/recurrent.py).

Buffers (i32, persistent): emitted [B] (tokens the last step emitted per sequence), history
[B, S_max] (the token at each position: every committed input, then the bonus at lengths[b]),
the drafter's input. The drafts of the next step are NGRAM's (`drafter` "ngram") or the host's
(written into tokens_in rows b*T + 1 .. between steps).
"""

from __future__ import annotations

from megakernel.isa.registry import OpSpec, register
from megakernel.isa.stages import Instr, Stage
from megakernel.layers.base import STREAM, Need, StepShape, partial_argmax_bytes

ACCEPT = register(OpSpec(
    35, "ACCEPT", "frame", "merge partial argmaxes -> greedy tokens; accept the drafts, emit the "
    "accepted tokens and the bonus, advance lengths, feed the bonus back",
    (
        ("N_TILES", "partial-argmax slots"),
        ("PARG_OFF", "f32: partial argmax [n_tiles, N, 2]"),
        ("OUT_OFF", "i32: tokens_out [N] (each row's greedy token)"),
        ("TOK_OFF", "i32: tokens_in [N] (row b*T: the last token; b*T + 1 ..: the drafts)"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("EMIT_OFF", "i32: emitted [B]: tokens this step emitted per sequence"),
        ("HIST_OFF", "i32: history [B, S_max]"),
    ),
    notes="Per sequence b (T = 1 + k, n = b*T): g[t] = tokens_out[n + t] (greedy, as ARGMAX); "
    "a = leading t < k with tokens_in[n + 1 + t] == g[t]; e = min(a + 1, max(0, S_max - T - "
    "lengths[b])); history[b, lengths[b] + t] = tokens_in[n + t] for t < e; when e > 0: "
    "history[b, lengths[b] + e] = tokens_in[n] = g[e - 1]; emitted[b] = e; lengths[b] += e.",
    device=True, step="speculative", ends_step=True, waits_on="LMHEAD", covers=("one", "", "")))
# (ACCEPT runs in the persistent loop itself: kernel/device/megakernel.py)


def check_ngram(d: dict, spec) -> str:  # noqa: ANN001 (KernelSpec)
    """NGRAM's sequences and suffix length against the build (launch.checks.check_records)."""
    if not (0 <= d["B0"] <= d["B1"] <= spec.batch and 1 <= d["N_MAX"] <= spec.ngram):
        return (f"sequences [{d['B0']}, {d['B1']}) or suffix length {d['N_MAX']} outside "
                f"the build's B={spec.batch}, ngram={spec.ngram}")
    return ""


NGRAM = register(OpSpec(
    36, "NGRAM", "frame", "propose the next step's drafts of sequences [B0, B1) by prompt lookup "
    "in their history",
    (
        ("B0", "first sequence"),
        ("B1", "one past the last sequence"),
        ("N_MAX", "longest suffix matched"),
        ("TOK_OFF", "i32: tokens_in [N]: rows b*T + 1 .. b*T + k get the drafts"),
        ("LEN_OFF", "i32: lengths [B] (after ACCEPT)"),
        ("HIST_OFF", "i32: history [B, S_max]"),
    ),
    notes="h = history[b, 0 .. lengths[b]] (the bonus last, m = lengths[b] + 1 tokens): for n = "
    "min(N_MAX, m - 1) down to 1, the largest p < m with h[p - n : p] == h[m - n : m] gives draft "
    "i = h[p + i % (m - p)]; no match: h[m - 1] k times (reference/speculative.ngram_propose).",
    device=True, handler="speculative.NgramDrafter", step="ngram", waits_on="ACCEPT",
    covers=("batch", "B0", "B1"), check=check_ngram))


def needs(model, shape: StepShape) -> list[Need]:  # noqa: ANN001
    """The speculative step's persistent buffers (none for a plain step)."""
    if not shape.drafts:
        return []
    return [Need("i32", "emitted", (shape.batch,), STREAM, persistent=True),
            Need("i32", "history", (shape.batch, shape.max_seq_len), STREAM, persistent=True)]


def accept_stages(ctx, wait: int, lm_tiles: int) -> tuple[list[Stage], int]:  # noqa: ANN001
    """ACCEPT (one record, waiting on the LM head's `lm_tiles` slabs at most) and, with the
    device drafter, NGRAM (one record per sequence, waiting on ACCEPT); returns the stages and
    ACCEPT's counter, which the recurrent layers' COMMIT records wait on."""
    n, b, t = ctx.rows, ctx.batch, ctx.tokens
    f32, i32 = ctx.buf.f32, ctx.buf.i32
    c_acc = ctx.ctr("accept")
    hist, lens, toks = i32["history"].offset, i32["lengths"].offset, i32["tokens_in"].offset

    def mk_accept(u0: int, u1: int) -> Instr:
        nt = lm_tiles  # an upper bound; number_lm_tiles sets the slots and their bytes
        return Instr(ACCEPT, -1, dict(
            N_TILES=nt, PARG_OFF=f32["part_argmax"].offset, OUT_OFF=i32["tokens_out"].offset,
            TOK_OFF=toks, LEN_OFF=lens, EMIT_OFF=i32["emitted"].offset, HIST_OFF=hist),
            wait=wait, signal=c_acc, l2_bytes=partial_argmax_bytes(nt, n) + n * 4 + b * 4,
            store_bytes=n * 4 + b * (8 + 4 * (t + 1)) + b * 4)

    out = [Stage("accept", ACCEPT, -1, 1, False, mk_accept)]
    if ctx.ngram:
        c_ng = ctx.ctr("ngram")
        s_max = ctx.buf.i32["history"].shape[1]

        def mk_ngram(u0: int, u1: int) -> Instr:
            # the whole history is compared once per suffix length, from L2 (just written)
            return Instr(NGRAM, -1, dict(B0=u0, B1=u1, N_MAX=ctx.ngram, TOK_OFF=toks,
                                         LEN_OFF=lens, HIST_OFF=hist),
                         wait=c_acc, signal=c_ng, l2_bytes=(u1 - u0) * s_max * 4,
                         store_bytes=(u1 - u0) * (t - 1) * 4,
                         fp32_flops=(u1 - u0) * ctx.context * ctx.ngram * 2.0)

        out.append(Stage("ngram", NGRAM, -1, b, False, mk_ngram))
    return out, c_acc
