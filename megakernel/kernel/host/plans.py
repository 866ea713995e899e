"""Host mirrors of the weight loader's schedule and the L2 lookahead (no DSL): the tiles the
loader warp streams in queue order (Pipeline.load_queue) and the prefetch requests of both weight
paths (Pipeline.prefetch_tiles, lookahead.Lookahead.extend), the same loop nests and state
machines as the device code, for the tests, the cost model and the docs.
"""

from __future__ import annotations

from megakernel.common.errors import SpecError
from megakernel.kernel.host.limits import ROW_CHUNK, SMEM_STAGE_BYTES, tile_rows


def matvec_tiles(nrows: int, k: int, passes: int, k_chunk: int, num_warps: int, wb: int = 2):
    """The tiles of one matvec slab in the order the loader streams and the consumers read them
    (Matvec.run_piped / Pipeline.load_queue use the same loop nest): (pass, row0, rows, col0,
    cols), rows of `tile_rows(min(k_chunk, k))` for weights of `wb` bytes (2: bf16, 1: FP8).
    Loop nest: pass > ROW_CHUNK chunk > K-chunk > rows of the chunk."""
    tr = tile_rows(min(k_chunk, k), num_warps, wbytes=wb)
    if tr == 0:
        raise SpecError(f"a weight row chunk of {min(k_chunk, k)} inputs does not fit one "
                        f"{SMEM_STAGE_BYTES} B pipeline stage")
    for p in range(passes):
        for rc0 in range(0, nrows, ROW_CHUNK):
            nr = min(ROW_CHUNK, nrows - rc0)
            for kc0 in range(0, k, k_chunk):
                kc = min(k_chunk, k - kc0)
                for t0 in range(0, nr, tr):
                    yield p, rc0 + t0, min(tr, nr - t0), kc0, kc


def stage_plan(slabs: list[tuple[int, ...]], passes: int, k_chunk: int,
               num_warps: int) -> list[tuple[int, int, int, int, int, int]]:
    """Host mirror of the loader warp's schedule (Pipeline.load_queue), for tests and docs.

    `slabs[i]` = (NROWS, K) of queue instruction i ((0, 0) for opcodes without a slab), or
    (NROWS, K, bytes per weight) (2 when absent; 1: an FP8 slab); each matvec streams its slab
    once per pass over the activation rows. Returns the tiles in issue
    order: (instruction, pass, first row, rows, first column, columns); tile j goes to stage
    `ring_slot(j, S)[0]` once the consumers have released tile j - S.
    """
    return [(i, *t) for i, (nrows, k, *wb) in enumerate(slabs) if nrows
            for t in matvec_tiles(nrows, k, passes, k_chunk, num_warps, *wb)]


def slab_wbytes(slab: tuple[int, ...]) -> int:
    """Bytes per weight of a stage_plan slab entry (2 unless it says 1)."""
    return slab[2] if len(slab) > 2 else 2


def lookahead_plan(slabs: list[int], window: int) -> list[list[tuple[int, int, int]]]:
    """Host mirror of the global-memory build's lookahead (lookahead.Lookahead.extend, same state
    machine, for tests and documentation).

    `slabs[i]`: prefetchable weight bytes of queue instruction i (0 for opcodes without a slab).
    Returns, per instruction i, the (instruction, byte offset, bytes) ranges requested when the
    CTA reaches i: everything of slabs i, i+1, ... below (start of slab i) + window that was not
    requested before (bytes of earlier slabs are left to the demand loads).
    """
    out: list[list[tuple[int, int, int]]] = []
    pf_pc, pf_off, pf_cum, cum = 0, 0, 0, 0
    for pc, nb in enumerate(slabs):
        if pf_pc < pc:  # the demand loads of earlier slabs overtook the lookahead
            pf_pc, pf_off, pf_cum = pc, 0, cum
        limit = cum + window
        got: list[tuple[int, int, int]] = []
        while pf_cum < limit and pf_pc < len(slabs):
            take = min(slabs[pf_pc] - pf_off, limit - pf_cum)
            if take > 0:
                got.append((pf_pc, pf_off, take))
                pf_off += take
                pf_cum += take
            if pf_off >= slabs[pf_pc]:
                pf_pc, pf_off = pf_pc + 1, 0
        out.append(got)
        cum += nb
    return out


def tile_requests(slabs: list[tuple[int, int]], tile: tuple) -> list[tuple[int, int, int]]:
    """The L2 prefetch requests of one stage_plan tile (instruction, byte offset in its slab,
    bytes): one for a tile of whole rows, one per row of a K-chunk (Pipeline.prefetch_tiles)."""
    i, _p, row0, rows, col0, cols = tile
    k, wb = slabs[i][1], slab_wbytes(slabs[i])
    if cols == k:
        return [(i, row0 * k * wb, rows * cols * wb)]
    return [(i, ((row0 + r) * k + col0) * wb, cols * wb) for r in range(rows)]


def loader_lookahead_plan(slabs: list[tuple[int, int]], passes: int, k_chunk: int,
                          num_warps: int, window: int) -> list[tuple[tuple, list]]:
    """The pipelined build's lookahead (Pipeline.prefetch_tiles): a cursor walks the loader's
    own tile sequence (stage_plan) and, before the loader issues tile j, prefetches tiles until
    the bytes it has covered reach (bytes of tiles 0..j-1) + window. `slabs` as in stage_plan.
    Returns (tile, requests issued just before it) per tile, requests as in tile_requests."""
    tiles = stage_plan(slabs, passes, k_chunk, num_warps)
    out, vol, covered, u = [], 0, 0, 0
    for tile in tiles:
        reqs = []
        while covered < vol + window and u < len(tiles):
            reqs += tile_requests(slabs, tiles[u])
            covered += tiles[u][3] * tiles[u][5] * slab_wbytes(slabs[tiles[u][0]])
            u += 1
        out.append((tile, reqs))
        vol += tile[3] * tile[5] * slab_wbytes(slabs[tile[0]])
    return out

