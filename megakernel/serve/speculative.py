"""Speculative decoding as a user asks for it: the method string (`--speculative`,
`mk.load(..., speculative=)`) and what a program needs of it.

Methods, each with k drafts a step (1 <= k <= 7):
  ngram:K        prompt lookup on the device (layers/speculative.py NGRAM), every model;
  mtp:K          the checkpoint's multi-token-prediction layer chained K times (reference/mtp.py);
  draft:MODEL:K  a smaller model with the same tokenizer drafts K tokens.
The step itself (verify 1 + k tokens, accept, commit) is the same for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakernel.common.errors import UserError
from megakernel.kernel.host.limits import MAX_DRAFTS
from megakernel.reference.speculative import NGRAM_MAX

METHODS = ("ngram", "mtp", "draft")


class SpeculativeError(UserError, ValueError):
    """A speculative method the project does not understand or cannot run."""


@dataclass(frozen=True)
class Speculative:
    """A parsed method: its name, k drafts a step, the draft model (draft only)."""

    method: str
    k: int
    model: str | None = None

    @property
    def ngram(self) -> int:
        """The device drafter's longest suffix (0: the drafts come from the host)."""
        return NGRAM_MAX if self.method == "ngram" else 0

    def __str__(self) -> str:
        return ":".join(x for x in (self.method, self.model, str(self.k)) if x)


def parse(text: str | Speculative | None) -> Speculative | None:
    """'ngram:3' | 'mtp:2' | 'draft:MODEL:3' -> Speculative; None or '' -> None."""
    if text is None or isinstance(text, Speculative):
        return text
    if not isinstance(text, str):
        raise SpeculativeError(f"speculative must be a string such as 'ngram:3', got "
                               f"{type(text).__name__}")
    if not text:
        return None
    parts = text.split(":")
    method = parts[0]
    want = {"ngram": 2, "mtp": 2, "draft": 3}
    if method not in want:
        raise SpeculativeError(f"unknown speculative method {method!r} in {text!r}; expected "
                               "ngram:K, mtp:K or draft:MODEL:K")
    if len(parts) != want[method] or not all(parts):
        form = "draft:MODEL:K" if method == "draft" else f"{method}:K"
        raise SpeculativeError(f"speculative {text!r}: expected {form}")
    try:
        k = int(parts[-1])
    except ValueError:
        raise SpeculativeError(f"speculative {text!r}: K must be an integer number of drafts, "
                               f"got {parts[-1]!r}") from None
    if not 1 <= k <= MAX_DRAFTS:
        raise SpeculativeError(f"speculative {text!r}: K must be in [1, {MAX_DRAFTS}] drafts a "
                               f"step, got {k}")
    return Speculative(method, k, parts[1] if method == "draft" else None)
