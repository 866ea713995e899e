"""Progress of long work on stderr: one line per stage with its elapsed time.

`stage("loading weights")` prints "loading weights ..." when the stage starts and "loading weights
... 1.2 s" when it ends, both on stderr, so stdout (and a `--json` last line) stays clean. Quiet
when `quiet=True`, after `set_quiet(True)` (`--json` runs), or when the `MEGAKERNEL_QUIET`
environment variable is set.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

_QUIET = [False]  # set by a command's --json (`set_quiet`)


def set_quiet(quiet: bool) -> None:
    """Silence (or restore) every stage of this process: a `--json` run prints no progress."""
    _QUIET[0] = quiet


def is_quiet(quiet: bool = False) -> bool:
    return quiet or _QUIET[0] or bool(os.environ.get("MEGAKERNEL_QUIET"))


@contextmanager
def stage(msg: str, quiet: bool = False) -> Iterator[None]:
    """Print `msg ...` on entry and `msg ... <seconds> s` on a normal exit (stderr)."""
    if is_quiet(quiet):
        yield
        return
    t0 = time.perf_counter()
    print(f"{msg} ...", file=sys.stderr, flush=True)
    yield
    print(f"{msg} ... {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
