"""The L2 lookahead prefetch (host mirror of the kernel's walk; no DSL, no GPU).

`spec.lookahead_plan` runs the same state machine as `DecodeMegakernel.prefetch_ahead`; the
compiled kernel's PTX is checked against it in test_kernel_build.py.
"""

from __future__ import annotations

import random

import pytest

from megakernel.kernel import spec as spec_mod
from megakernel.kernel.spec import lookahead_plan, prefetch_window


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
    for arch in spec_mod.ARCHS:
        w = prefetch_window(arch)
        assert w % spec_mod.PREFETCH_CHUNK == 0 and w > 0
        total = w * spec_mod.ARCH_SMS[arch]
        assert total <= spec_mod.L2_PREFETCH_SHARE * spec_mod.L2_BYTES[arch]
        assert total > 0.4 * spec_mod.L2_BYTES[arch]  # not needlessly small either
    assert prefetch_window("sm_90a") == 192 * 1024
    assert prefetch_window("sm_100a") == 432 * 1024
    with pytest.raises(spec_mod.SpecError, match="unsupported arch 'sm_80'"):
        prefetch_window("sm_80")


def _check_loader(slabs: list[tuple[int, int]], passes: int, k_chunk: int, window: int) -> None:
    """The loader's sliding lookahead: before each tile, every byte of the stream from the
    tile's slab on below (loader position + window) has been requested, each byte once, in
    order, nothing beyond; the position is the slab's start + the bytes of it issued before."""
    from megakernel.kernel.spec import loader_lookahead_plan

    plan = loader_lookahead_plan(slabs, passes, k_chunk, 8, window)
    nbytes = [n * k * 2 for n, k in slabs]
    starts = [sum(nbytes[:i]) for i in range(len(slabs) + 1)]
    done = [0] * len(slabs)
    sent = [0] * len(slabs)
    high = 0  # highest limit so far
    for (i, _p, row0, rows, _col0, cols), reqs in plan:
        pos = starts[i] + min(sent[i], nbytes[i])
        assert pos + window >= high  # it only slides forward within a queue
        for j, off, n in reqs:
            assert j >= i and n > 0 and off == done[j], (i, j, off, done[j])
            done[j] += n
            assert starts[j] + off + n <= pos + window, (i, j, off, n)
        high = pos + window
        for j in range(i, len(slabs)):
            want = max(0, min(nbytes[j], high - starts[j]))
            assert done[j] >= want, (i, j, done[j], want)
        if cols == slabs[i][1]:  # whole-row tiles: the tile itself was requested before its copy
            assert starts[i] + (row0 + rows) * cols * 2 <= high or window < rows * cols * 2
        sent[i] += rows * cols * 2
    if window >= 32 * 1024:  # >= one tile: the last tile's limit covers the end of the stream
        assert done == nbytes  # the whole stream, once


def test_loader_lookahead_slides_within_slabs():
    """A slab larger than the window is requested ahead of the loader as it goes (the consumer
    walk requests only its first window and leaves the rest to demand loads)."""
    from megakernel.kernel.spec import loader_lookahead_plan

    w = 64 * 1024
    slabs = [(0, 0), (64, 2048), (0, 0), (16, 2048)]  # 256 KiB, attention, 64 KiB
    plan = loader_lookahead_plan(slabs, 1, 2048, 8, w)
    first_tile, first = plan[0]
    assert first_tile[0] == 1 and first == [(1, 0, w)]
    # every 8-row tile (32 KiB) moves the window 32 KiB on, inside slab 1 and then into slab 3
    assert plan[1][1] == [(1, w, 32 * 1024)]
    moved = sum(n for _, reqs in plan for _, _, n in reqs)
    assert moved == (64 + 16) * 2048 * 2
    old = lookahead_plan([n * k * 2 for n, k in slabs], w)
    assert sum(n for reqs in old for _, _, n in reqs) < moved  # the reach walk stops short
    _check_loader(slabs, 1, 2048, w)


def test_loader_lookahead_properties_on_random_queues():
    rng = random.Random(11)
    for _ in range(150):
        k = rng.choice([256, 512, 2048, 4096])
        slabs = [rng.choice([(0, 0), (16, k), (48, k), (256, k), (512, k)])
                 for _ in range(rng.randint(1, 8))]
        _check_loader(slabs, rng.choice([1, 2]), rng.choice([1024, 2048]),
                      rng.choice([16 * 1024, 64 * 1024, 192 * 1024]))
