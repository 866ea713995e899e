"""Index arithmetic shared by the COMMIT handlers (kernel/device/commit.py), no DSL: where a
committed conv window's values come from. The kinds' layouts (window, ring, pending) are their index
shapes' (gdn_index.py, kda_index.py, mamba_index.py `window`, `pending`, `ring_*`)."""

from __future__ import annotations


def shift_source(e, j, win):
    """Value j of a window of `win` values shifted by the first e pending inputs: the last win of
    [window | pending[:e]], position e + j of it. Returns (pending index, window index): the
    pending one when it is >= 0, else the window one."""
    return e + j - win, e + j
