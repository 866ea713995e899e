"""The L2 lookahead prefetch (host mirrors of the kernel's walks; no DSL, no GPU).

`spec.lookahead_plan` runs the same state machine as `lookahead.Lookahead.extend` (the
global-memory build; its PTX is checked in test_kernel_build.py); `spec.loader_lookahead_plan`
mirrors the loader's cursor `Pipeline.prefetch_tiles` (the pipelined build).
"""

from __future__ import annotations

import random

import pytest

from megakernel.common import errors
from megakernel.common.arch import ARCH_SMS, ARCHS, L2_BYTES
from megakernel.kernel.host import limits
from megakernel.kernel.host.limits import prefetch_window
from megakernel.kernel.host.plans import lookahead_plan


def _check(slabs: list[int], window: int) -> None:
    plan = lookahead_plan(slabs, window)
    assert len(plan) == len(slabs)
    starts = [sum(slabs[:i]) for i in range(len(slabs) + 1)]
    seen: dict[int, list[tuple[int, int]]] = {}
    for pc, ranges in enumerate(plan):
        for i, off, n in ranges:
            assert n > 0 and i >= pc, (pc, i)
            assert 0 <= off and off + n <= slabs[i], (i, off, n)
            # never past the window from the start of the current slab
            assert starts[i] + off + n <= starts[pc] + window, (pc, i, off, n)
            seen.setdefault(i, []).append((off, n))
    for i, rs in seen.items():  # each byte at most once
        rs.sort()
        for (o0, n0), (o1, _) in zip(rs, rs[1:], strict=False):
            assert o0 + n0 <= o1, (i, rs)
    # at each instruction, everything below min(start + window, end) has been requested by then
    done = [0] * len(slabs)  # bytes requested so far, per slab (contiguous from its start)
    for pc, ranges in enumerate(plan):
        for i, off, n in ranges:
            assert off == done[i], (i, off, done[i])  # contiguous: the walk never skips
            done[i] += n
        lim = starts[pc] + window
        for i in range(pc, len(slabs)):
            want = max(0, min(slabs[i], lim - starts[i]))
            assert done[i] >= want, (pc, i, done[i], want)


def test_lookahead_reaches_following_slabs_once():
    w = 192 * 1024
    slabs = [0, 100 * 1024, 0, 50 * 1024, 300 * 1024, 20 * 1024, 0]  # embed, qkv, attn, ...
    plan = lookahead_plan(slabs, w)
    # at the first record (no slab) the window already covers slab 1 and part of slab 3
    assert plan[0] == [(1, 0, 100 * 1024), (3, 0, 50 * 1024), (4, 0, 42 * 1024)]
    assert plan[1] == []  # nothing new: slab 1 starts where the window started
    assert plan[2] == [(4, 42 * 1024, 100 * 1024)]  # window moved 100 KB on
    assert plan[3] == []  # slab 3 (50 KB) does not move it
    assert plan[4] == [(4, 142 * 1024, 50 * 1024)]
    # slab 4 is larger than the window: its tail is left to the demand loads, slab 5 is
    # requested when the CTA reaches it
    assert plan[5] == [(5, 0, 20 * 1024)]
    _check(slabs, w)


def test_lookahead_properties_on_random_queues():
    rng = random.Random(7)
    for _ in range(300):
        slabs = [rng.choice([0, 0, 16, 4096, 65536, 200_000, 1 << 20]) // 16 * 16
                 for _ in range(rng.randint(1, 12))]
        _check(slabs, rng.choice([16 * 1024, 192 * 1024, 432 * 1024]))


def test_window_from_l2_size():
    for arch in ARCHS:
        w = prefetch_window(arch)
        assert w % limits.PREFETCH_CHUNK == 0 and w > 0
        total = w * ARCH_SMS[arch]
        assert total <= limits.L2_PREFETCH_SHARE * L2_BYTES[arch]
        assert total > 0.4 * L2_BYTES[arch]  # not needlessly small either
    assert prefetch_window("sm_90a") == 192 * 1024
    assert prefetch_window("sm_100a") == 432 * 1024
    with pytest.raises(errors.SpecError, match="unsupported arch 'sm_80'"):
        prefetch_window("sm_80")


def _check_loader(slabs: list[tuple[int, int]], passes: int, k_chunk: int, window: int) -> None:
    """The loader's lookahead: its requests, in order, are exactly the loader's tiles in order
    (every pass), each tile's bytes requested before its copy, and before tile j the cursor has
    covered (bytes of tiles 0..j-1) + window, but not a tile more."""
    from megakernel.kernel.host.plans import loader_lookahead_plan, stage_plan, tile_requests

    plan = loader_lookahead_plan(slabs, passes, k_chunk, 8, window)
    tiles = stage_plan(slabs, passes, k_chunk, 8)
    assert [t for t, _ in plan] == tiles
    every = [r for _, reqs in plan for r in reqs]
    assert every == [r for t in tiles for r in tile_requests(slabs, t)]  # same order, once each
    sizes = [t[3] * t[5] * 2 for t in tiles]
    starts = [sum(sizes[:u]) for u in range(len(sizes) + 1)]  # volume before tile u
    vol = covered = 0
    seen: set[tuple[int, int, int]] = set()
    for (tile, reqs), size in zip(plan, sizes, strict=True):
        for r in reqs:
            seen.add(r)
            covered += r[2]
        assert set(tile_requests(slabs, tile)) <= seen  # requested before the copy
        u = starts.index(covered)  # the cursor stops between tiles
        assert covered >= min(starts[-1], vol + window)  # a full window ahead ...
        assert u == 0 or starts[u - 1] < vol + window  # ... and not a tile more
        vol += size
    for tile in tiles:  # the requests cover the tile's bytes exactly
        i, _p, row0, rows, col0, cols = tile
        k = slabs[i][1]
        got = sorted((off, n) for _, off, n in tile_requests(slabs, tile))
        want = sorted((((row0 + r) * k + col0) * 2, cols * 2) for r in range(rows))
        if cols == k:
            assert got == [(row0 * k * 2, rows * cols * 2)]
        else:
            assert got == want


def test_loader_lookahead_follows_the_loaders_tiles():
    """Whole-row slabs: the window slides tile by tile; K-chunked slabs: the cursor requests the
    loader's column bands in its order, row by row (not the slab's rows ahead of them)."""
    from megakernel.kernel.host.plans import loader_lookahead_plan

    w = 64 * 1024
    slabs = [(0, 0), (64, 2048), (0, 0), (16, 2048)]  # 256 KiB, attention, 64 KiB
    plan = loader_lookahead_plan(slabs, 1, 2048, 8, w)
    assert plan[0][0][0] == 1 and plan[0][1] == [(1, 0, 32 * 1024), (1, 32 * 1024, 32 * 1024)]
    assert plan[1][1] == [(1, 64 * 1024, 32 * 1024)]  # one 8-row tile more per tile issued
    chunked = loader_lookahead_plan([(16, 4096)], 1, 1024, 8, w)
    first = chunked[0][1]
    # 8 rows x 1024 columns per tile: the first band of rows 0..7, then rows 8..15, ...
    assert first[:8] == [(0, r * 8192, 2048) for r in range(8)]
    assert first[8:16] == [(0, (8 + r) * 8192, 2048) for r in range(8)]
    _check_loader(slabs, 1, 2048, w)
    _check_loader([(16, 4096)], 2, 1024, w)


def test_loader_lookahead_properties_on_random_queues():
    rng = random.Random(11)
    for _ in range(150):
        k = rng.choice([256, 512, 2048, 4096])
        slabs = [rng.choice([(0, 0), (16, k), (48, k), (256, k), (512, k)])
                 for _ in range(rng.randint(1, 8))]
        _check_loader(slabs, rng.choice([1, 2]), rng.choice([1024, 2048]),
                      rng.choice([16 * 1024, 64 * 1024, 192 * 1024]))
