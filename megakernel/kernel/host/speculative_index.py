"""Index arithmetic of the speculative step's device handlers (ACCEPT in megakernel.py, NGRAM in
speculative.py; layers/speculative.py is the semantics), no DSL.

ACCEPT (one record, one CTA): first ARGMAX's merge, a warp per row n of the N = B T rows (the
LM-head tiles' partial (max, index) pairs, ties to the lowest index) storing tokens_out[n]; one
barrier; then a thread per sequence b reads its T greedy tokens g[t] = tokens_out[b T + t] and
its T inputs, counts the accepted drafts a (the leading t < k with tokens_in[b T + 1 + t] ==
g[t]), keeps e = min(a + 1, max(0, S_max - T - lengths[b])) (`emitted`), writes the history
(inputs 0 .. e - 1 at lengths[b] .., the bonus g[e - 1] after them), feeds the bonus back into
tokens_in[b T], and stores emitted[b] and lengths[b] + e.

NGRAM (one record per range of sequences, one CTA): per sequence, with m = lengths[b] + 1 tokens
of history h (the bonus last), every candidate position p in [1, m) (p: the token after an
earlier occurrence of the suffix) is scanned by one thread (p = 1 + tidx + i NT): its match
length l(p) is the number of i = 1 .. min(N_MAX, p) with h[p - i] == h[m - i] before the first
difference. The reference's choice (the longest matched suffix n, then the most recent p with
that n) is the largest key l(p) m + p, and l = 0 everywhere is no match, so one max-reduction
picks it: a thread's max, the warp's (butterfly shuffles), the warps' through shared memory (two
buffers, alternating by sequence, so one barrier a sequence). Thread i < k then writes draft i =
h[p + i % (m - p)], with p = m - 1 when nothing matched (h[m - 1] repeated).

Plain arithmetic on ints here and in the host emulation (tests/kernel/test_kernel_speculative.py),
on Int32 in the kernel: the same functions index both.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakernel.kernel.host.limits import MAX_DRAFTS

LANES = 32
NGRAM_LIMIT = 8  # the longest suffix a build's drafter compares (the suffix held in registers)


@dataclass(frozen=True)
class AcceptShape:
    """ACCEPT's constants: batch B, tokens T = 1 + k, consumer warps."""

    batch: int
    tokens: int
    num_warps: int

    @classmethod
    def for_spec(cls, spec) -> AcceptShape:  # noqa: ANN001 (KernelSpec)
        return cls(spec.batch, spec.tokens, spec.num_warps)

    drafts = property(lambda self: self.tokens - 1)  # k
    rows = property(lambda self: self.batch * self.tokens)  # N

    def row(self, b, t):
        """Row of sequence b's input t (tokens_in, tokens_out)."""
        return b * self.tokens + t

    def parg(self, tile, n, which):
        """Element of part_argmax [tiles, N, 2] (from PARG_OFF): tile's (max, index) of row n."""
        return (tile * self.rows + n) * 2 + which

    @staticmethod
    def hist(b, pos, s_max):
        """Element of history [B, S_max] (from HIST_OFF)."""
        return b * s_max + pos

    def emitted(self, accepted, length, s_max, minimum=min, maximum=max):
        """Tokens the step emits for a sequence: the accepted drafts and the bonus, as many as
        leave room for another step (none when the cache is full)."""
        return minimum(accepted + 1, maximum(s_max - self.tokens - length, 0))


@dataclass(frozen=True)
class NgramShape:
    """NGRAM's constants: consumer threads, k drafts, the build's longest suffix (the record's
    N_MAX may be shorter)."""

    num_threads: int
    drafts: int
    n_max: int

    @classmethod
    def for_spec(cls, spec) -> NgramShape:  # noqa: ANN001 (KernelSpec)
        return cls(spec.num_threads, spec.drafts, spec.ngram)

    num_warps = property(lambda self: self.num_threads // LANES)

    def candidates(self, tidx, m):
        """range() arguments of the candidate positions p thread tidx scans."""
        return 1 + tidx, m, self.num_threads

    @staticmethod
    def compare(p, m, i):
        """(history position at p, at the suffix) the i-th comparison (i = 0 ..) of candidate p
        reads: h[p - 1 - i] against h[m - 1 - i]."""
        return p - 1 - i, m - 1 - i

    @staticmethod
    def limit(p, n_max, minimum=min):
        """Comparisons of candidate p: min(N_MAX, p)."""
        return minimum(n_max, p)

    @staticmethod
    def key(length, p, m):
        """The reduction's key of candidate p with match length `length` (0: no match)."""
        return length * m + p

    @staticmethod
    def source(key, m):
        """(matched?, p): the history position draft 0 is read from, p = m - 1 unmatched."""
        length = key // m
        return length > 0, key - length * m

    @staticmethod
    def draft(p, m, i):
        """History position of draft i after a match at p: the match's period repeats."""
        return p + i % (m - p)

    def part(self, buf, warp):
        """Word of the warps' maxima [2][NW] (buffer buf: the sequence's parity)."""
        return buf * self.num_warps + warp

    @staticmethod
    def tokens_row(b, tokens, i):
        """tokens_in row of sequence b's draft i (input 1 + i)."""
        return b * tokens + 1 + i


def check_speculative(spec) -> str:  # noqa: ANN001 (KernelSpec)
    """Why a build cannot run these speculative settings ('' when it can)."""
    k = spec.drafts
    if not 0 <= k <= MAX_DRAFTS:
        return f"a speculative build verifies 1 to {MAX_DRAFTS} drafts, got drafts={k}"
    if spec.ngram and not k:
        return f"ngram={spec.ngram} needs a speculative build (drafts >= 1)"
    if not 0 <= spec.ngram <= NGRAM_LIMIT:
        return f"the n-gram drafter matches 1 to {NGRAM_LIMIT} tokens, got ngram={spec.ngram}"
    if k and spec.tokens != 1 + k:
        return f"a speculative build with {k} drafts runs {1 + k} tokens, got tokens={spec.tokens}"
    if k and spec.paged:
        return "the paged build takes no drafts (its caller accepts)"
    if k and spec.layer_kinds() and any(kd.recurrent for kd in spec.layer_kinds()) \
            and not spec.replay_window:
        return "a speculative build of recurrent layers needs ReplaySSM (replay_window >= 1)"
    return ""
