"""The emulator's one error type: what went wrong, where in the PTX, and on which thread."""

from __future__ import annotations


class EmulatorError(RuntimeError):
    """A kernel fault found by the emulator (bad access, trap, deadlock, barrier misuse) or a PTX
    form it does not support. The message names the PTX line and, where there is one, the CTA,
    warp and lane."""


class UnsupportedForm(EmulatorError):
    """An instruction form the emulator has no semantics for (named with its PTX line)."""
