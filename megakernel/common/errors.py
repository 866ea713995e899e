"""The user-facing error base, and the errors that modules of several packages raise.

`UserError` is bad input: a malformed argument, an unsupported model or shape, a missing build or
GPU. The CLI prints one `error: <message>` line for it and exits with status 2; any other
exception is a bug and keeps its traceback. Each module's error class derives from it and keeps
its builtin base (`class PlanError(UserError, ValueError)`), so `except ValueError` still
catches it. `ConfigError` (with `positive`, the field check behind most of them: layer kinds and
model families) and `SpecError` (the kernel build's modules) live here, re-exported by
megakernel.models.config and megakernel.kernel.config.spec.

A leaf module (it imports nothing of the package), so that any module may raise these.
"""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """Bad input to megakernel (the CLI: one `error:` line, exit status 2)."""


class KernelUnavailable(UserError, RuntimeError):
    """The kernel cannot run here (no GPU, unsupported GPU, no build for it, no cuda-python)."""


class ConfigError(UserError, ValueError):
    """A config names an architecture, field value or shape that megakernel does not support."""


def positive(obj: Any, *names: str, minimum: int = 1) -> None:
    """ConfigError unless every named field of `obj` is an int (not a bool) >= `minimum`."""
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ConfigError(f"{type(obj).__name__}.{n} must be {what}, got {v!r}")


class SpecError(UserError, ValueError):
    """A model/batch combination a kernel build cannot serve (named, with the limit)."""
