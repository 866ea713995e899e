"""The shared-memory weight pipeline (spec.smem_stages >= 2): the host mirror of the loader's
schedule and ring protocol (no DSL), and the compiled variant for both archs (DSL, CPU only):
resources within budget, the bulk copies / mbarrier waits / consumer named barrier in the PTX
and SASS, the memory protocol kept.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.common.errors import SpecError
from megakernel.kernel.config import spec as spec_mod
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host import limits, plans
from megakernel.kernel.host.dense_index import ring_slot
from megakernel.kernel.host.limits import ROW_CHUNK, SMEM_STAGE_BYTES, tile_rows
from megakernel.kernel.host.plans import matvec_tiles, stage_plan
from megakernel.kernel.toolchain import fingerprint
from megakernel.models import preset
from tests.kernel.test_kernel_build import KV_PREFETCH_SITES

STAGES = limits.PIPELINE_STAGES


# ---- host mirror (no DSL) -----------------------------------------------------------------------
def test_tile_rows_rule():
    assert tile_rows(2048, 8) == 8  # 8 x 4 KB = one 32 KB stage
    assert tile_rows(8192, 8) == 2
    assert tile_rows(16384, 8) == 1
    assert tile_rows(16384 + 8, 8) == 0  # one row does not fit
    assert tile_rows(64, 8) == 8  # never more rows than warps
    assert tile_rows(64, 4) == 4


def _slabs(rng: random.Random) -> list[tuple[int, int]]:
    ks = [256, 512, 2048, 3072, 8192, 14336]
    out = []
    for _ in range(rng.randint(1, 8)):
        if rng.random() < 0.3:
            out.append((0, 0))  # embed / attention / argmax: no slab
        else:
            out.append((16 * rng.randint(1, 40), rng.choice(ks)))
    return out


def _check_plan(slabs, passes, k_chunk, nw):
    plan = stage_plan(slabs, passes, k_chunk, nw)
    # in queue order, passes in order, and within a slab the consumers' loop nest
    keys = [(i, p) for i, p, *_ in plan]
    assert keys == sorted(keys)
    for i, (nrows, k) in enumerate(slabs):
        for p in range(passes):
            tiles = [t for t in plan if t[0] == i and t[1] == p]
            if nrows == 0:
                assert not tiles
                continue
            covered = [[0] * (k // 8) for _ in range(nrows)]  # 16-byte vectors
            for _, _, r0, rows, c0, cols in tiles:
                assert 0 < rows and rows * cols * 2 <= SMEM_STAGE_BYTES
                assert cols % 8 == 0 and c0 % 8 == 0  # 16-byte bulk copies, aligned
                assert r0 // ROW_CHUNK == (r0 + rows - 1) // ROW_CHUNK  # never across a chunk
                for r in range(r0, r0 + rows):
                    for v in range(c0 // 8, (c0 + cols) // 8):
                        covered[r][v] += 1
            assert all(c == 1 for row in covered for c in row), (i, p)  # every byte exactly once


def test_stage_plan_covers_every_slab_byte_once_per_pass_in_queue_order():
    rng = random.Random(11)
    for _ in range(60):
        _check_plan(_slabs(rng), rng.choice([1, 2]), rng.choice([512, 2048, 8192, 16384]),
                    rng.choice([4, 8]))


def test_stage_plan_follows_the_consumer_loop_nest():
    # 40 rows of K = 8192 with 2048-wide K-chunks: 8-row tiles (8 x 2048 x 2 B = one stage)
    tiles = list(matvec_tiles(40, 8192, 1, 2048, 8))
    tr = tile_rows(2048, 8)
    assert tr == 8
    # chunk 0 (rows 0..39 < ROW_CHUNK): K-chunk 0 over all row tiles, then K-chunk 1, ...
    want = [(0, r0, min(tr, 40 - r0), kc0, 2048) for kc0 in range(0, 8192, 2048)
            for r0 in range(0, 40, tr)]
    assert tiles == want
    # a slab longer than a row chunk restarts the K-chunks per chunk
    t2 = list(matvec_tiles(ROW_CHUNK + 16, 512, 2, 512, 8))
    assert [t[1] for t in t2[:3]] == [0, 8, 16]
    assert t2[len(t2) // 2][0] == 1  # second pass streams the slab again
    with pytest.raises(SpecError, match="does not fit one"):
        list(matvec_tiles(16, 20000, 1, 20000, 8))


def _simulate_ring(n_tiles: int, stages: int, rng: random.Random) -> int:
    """Loader and consumers as two agents over mbarriers with parity waits (ring_slot), in a
    random interleaving. Checks: the consumers read tile j from stage j % S after it landed and
    before it is overwritten; never more than S tiles loaded but not released. Returns the
    largest number in flight."""
    full_phase = [0] * stages  # completed phases per mbarrier
    empty_phase = [0] * stages
    stage_tile = [None] * stages
    pj = cj = 0
    in_flight, worst = 0, 0

    def passes(completed: int, parity: int) -> bool:
        # try_wait.parity(P) succeeds once the phase with parity P before the current one is
        # complete; a fresh barrier (0 completed) counts the phase "before 0" (parity 1) done
        return (completed & 1) != parity

    for _ in range(100 * n_tiles):
        if cj == n_tiles:
            break
        if pj < n_tiles and rng.random() < 0.5:
            s, _, pe = ring_slot(pj, stages)
            if passes(empty_phase[s], pe):
                assert stage_tile[s] is None, "overwrote a stage not yet released"
                stage_tile[s] = pj
                full_phase[s] += 1  # expect_tx arrive + bytes: the phase completes
                pj += 1
                in_flight += 1
                worst = max(worst, in_flight)
                assert in_flight <= stages
        else:
            s, pf, _ = ring_slot(cj, stages)
            if passes(full_phase[s], pf):
                assert stage_tile[s] == cj, (stage_tile[s], cj)
                stage_tile[s] = None
                empty_phase[s] += 1  # all consumer warps arrived
                cj += 1
                in_flight -= 1
    assert cj == n_tiles, f"deadlock: {pj} tiles loaded, {cj} consumed"
    return worst


def test_ring_protocol_never_more_than_s_in_flight():
    rng = random.Random(5)
    for stages in (2, 3, 4):
        worst = max(_simulate_ring(50, stages, rng) for _ in range(20))
        assert worst == stages  # the loader does run S tiles ahead, and never more


def test_ring_slot_parities():
    assert [ring_slot(j, 3) for j in range(7)] == [
        (0, 0, 1), (1, 0, 1), (2, 0, 1), (0, 1, 0), (1, 1, 0), (2, 1, 0), (0, 0, 1)]


def test_default_falls_back_to_fewer_stages_then_the_global_path(monkeypatch):
    """make_spec(smem_stages=None) takes the deepest ring that fits and, when not even
    MIN_PIPELINE_STAGES fit, the global-memory path (no current preset needs that at the real
    budget, so the budget is lowered here)."""
    cfg = preset("qwen3-0.6b")
    base = make_spec(cfg, 32, 1, "sm_90a", smem_stages=0).smem_bytes  # x, acc, ... without ring
    ring2 = make_spec(cfg, 32, 1, "sm_90a", smem_stages=2).smem_bytes
    monkeypatch.setattr(spec_mod, "SMEM_BUDGET", ring2)
    assert make_spec(cfg, 32, 1, "sm_90a").smem_stages == 2
    monkeypatch.setattr(spec_mod, "SMEM_BUDGET", ring2 - 1)
    low = make_spec(cfg, 32, 1, "sm_90a")
    assert low.smem_stages == 0 and not low.pipelined and low.smem_bytes == base


def test_pipeline_spec_limits_and_messages():
    cfg = preset("llama-3.2-1b")
    s = make_spec(cfg, 1, 1, "sm_90a", smem_stages=STAGES)
    assert s.pipelined and s.block_threads == s.num_threads + 32
    assert "ring" in s.smem_regions() and "mbar" in s.smem_regions()
    assert s.smem_bytes <= limits.SMEM_BUDGET
    assert s.k_chunk * 2 <= SMEM_STAGE_BYTES
    d = make_spec(cfg, 1, 1, "sm_90a", smem_stages=0)
    assert not d.pipelined and d.block_threads == d.num_threads and "ring" not in d.smem_regions()
    assert s.tag == d.tag  # variants share the build-set tag (gpu-check keeps them apart)
    assert fingerprint.fingerprint(s, "4.8.1") != fingerprint.fingerprint(d, "4.8.1")
    with pytest.raises(SpecError, match="smem_stages must be 0"):
        make_spec(cfg, 1, 1, "sm_90a", smem_stages=1)
    with pytest.raises(SpecError, match="shared memory > budget"):
        make_spec(cfg, 1, 1, "sm_90a", smem_stages=8)
    with pytest.raises(SpecError, match="power-of-two number of consumer warps"):
        make_spec(cfg, 1, 1, "sm_90a", num_threads=192, smem_stages=STAGES)
    # the default: the deepest ring the budget leaves room for (B = 1: all PIPELINE_STAGES;
    # larger batches stage more activations), else the global path
    assert make_spec(cfg, 1, 1, "sm_100a").smem_stages == STAGES == 6
    for model, b, want in (("llama-3.2-1b", 16, 4), ("qwen3-0.6b", 32, 3)):
        got = make_spec(preset(model), b, 1, "sm_90a")
        assert got.smem_stages == want and got.pipelined, (model, b, got.smem_stages)
        with pytest.raises(SpecError, match="shared memory > budget"):
            make_spec(preset(model), b, 1, "sm_90a", smem_stages=want + 1)
    # every gpu-check case can be served by the pipelined variant
    from megakernel.gpu_check.cases import stage_cases

    for c, _ in stage_cases():
        for arch in ARCHS:
            got = make_spec(preset(c.model), c.batch, c.tokens, arch).smem_stages
            assert limits.MIN_PIPELINE_STAGES <= got <= STAGES


# ---- compiled variant (DSL) ---------------------------------------------------------------------
CASES = [("llama-tiny", 1, 1), ("qwen3-tiny", 2, 2)]


@pytest.fixture(scope="module")
def builds(kernel_build) -> dict[tuple[str, str], tuple[Path, dict]]:
    return {(name, arch): kernel_build(preset(name), arch, b, t, smem_stages=STAGES)
            for name, b, t in CASES for arch in ARCHS}


def test_pipeline_builds_within_budgets(builds):
    for (name, arch), (_, m) in sorted(builds.items()):
        r = m["resources"]
        spec = spec_mod.KernelSpec.from_dict(m["spec"])
        assert spec.smem_stages == STAGES and m["smem_stages"] == STAGES
        assert m["block"] == [spec.num_threads + 32, 1, 1]
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, arch, r)
        assert r["local_bytes"] == 0 and r["local_stores"] == 0 and r["local_loads"] == 0, r
        assert 0 < r["registers"] <= limits.REGISTER_BUDGET
        assert r["registers"] * m["block"][0] <= 65536
        assert m["dynamic_smem_bytes"] == spec.smem_bytes <= limits.SMEM_BUDGET
        print(f"pipelined {name} {arch}: {r['registers']} regs, smem "
              f"{m['dynamic_smem_bytes']} B, compile {m['compile_seconds']} s")


def test_ptx_has_the_pipeline(builds):
    """One loader (bulk copies completing on an mbarrier with expect_tx, waiting for a free
    stage), consumers waiting for a full stage and releasing it, S full + S empty barriers set
    up, watchdogs on the waits, and the consumers' CTA barriers on named barrier 1 (only the
    set-up uses barrier 0)."""
    for (name, arch), (d, m) in sorted(builds.items()):
        ptx = (d / "megakernel.ptx").read_text()
        nt = m["block"][0] - 32
        assert re.search(rf"\.reqntid {nt + 32}, 1, 1", ptx), (name, arch)
        assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") >= 2
        assert ptx.count("mbarrier.arrive.expect_tx.shared.b64") == 1, (name, arch)
        # full, empty and done waits, each a first try plus the watchdog loop (pipeline.mbar_wait)
        assert ptx.count("mbarrier.try_wait.parity.acquire.cta.shared::cta.b64") == 6, name
        # counter wait, the three mbarrier waits, the tile-count check at END
        assert ptx.count("trap;") >= 5, (name, arch)
        assert ptx.count("mbarrier.arrive.shared.b64") == 2, (name, arch)  # release, done
        assert ptx.count("mbarrier.init.shared.b64") == 2 * STAGES + 1, (name, arch)
        assert len(re.findall(r"bar\.sync\s+0;", ptx)) == 1, (name, arch)
        assert len(re.findall(rf"bar\.sync\s+1, {nt};", ptx)) >= 8, (name, arch)
        # the L2 lookahead: the weights' in the loader's branch (prefetch_tiles: whole-row and
        # per-row requests, its limit the loader's volume + the arch's window), the consumers
        # keep only the K/V ones
        body = _loader_ptx(ptx, nt // 32)
        n_loader = body.count("cp.async.bulk.prefetch.L2.global")
        assert n_loader >= 2, (name, arch, n_loader)
        consumers = ptx.count("cp.async.bulk.prefetch.L2.global") - n_loader
        assert consumers == KV_PREFETCH_SITES, (name, arch, consumers)
        w = limits.prefetch_window(arch)
        assert re.search(rf"add\.s64\s+%rd\d+, %rd\d+, {w};", body), (name, arch, w)
        # the GEMV reads its weights from shared memory, not with 16-byte global loads
        assert "ld.global.L1::no_allocate.L2::256B.v4" not in ptx, (name, arch)


def test_sass_has_the_pipeline_and_keeps_the_memory_protocol(builds):
    from megakernel.kernel.toolchain.tools import sass_text

    for (name, arch), (d, _) in sorted(builds.items()):
        sass = sass_text(str(d / "megakernel.cubin"))
        ops = [m.strip() for m in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
        assert any("UBLKCP.S.G" in o for o in ops), (name, arch)  # the bulk copy
        assert any("SYNCS.PHASECHK" in o for o in ops), (name, arch)  # mbarrier waits
        assert any("SYNCS.ARRIVE.TRANS64" in o for o in ops), (name, arch)
        for i, o in enumerate(ops):  # acquires still invalidate L1
            if re.search(r"\bLDG\.E\.STRONG\.GPU\b", o) or "ATOMG.E.ADD.STRONG.GPU" in o:
                assert any("CCTL.IVALL" in x for x in ops[i + 1:i + 3]), (name, arch, o)
        assert any("BPT.TRAP" in o for o in ops), (name, arch)


# ---- the host mirror and the device loops stay in lockstep (no DSL) ----------------------------
def _loops(fn_src: str) -> list[tuple[int, str, str]]:
    """(depth, loop variable, normalised iterator) of every `for` in a function, in source order;
    `self.`, `self.pipe.` and `self.spec.` prefixes dropped, `Int32(x)` -> `x`."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(fn_src))
    out: list[tuple[int, str, str]] = []

    def norm(node) -> str:  # noqa: ANN001
        s = ast.unparse(node)
        for p in ("self.pipe.", "self.spec.", "self."):
            s = s.replace(p, "")
        return re.sub(r"Int32\(([^()]*)\)", r"\1", s)

    def walk(node, depth: int) -> None:  # noqa: ANN001
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.For):
                out.append((depth, norm(child.target), norm(child.iter)))
                walk(child, depth + 1)
            else:
                walk(child, depth)

    walk(tree, 0)
    return out


def _assigns(fn_src: str) -> dict[str, str]:
    import ast
    import textwrap

    out = {}
    for node in ast.walk(ast.parse(textwrap.dedent(fn_src))):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Name):
                s = ast.unparse(node.value)
                for p in ("self.pipe.", "self.spec.", "self."):
                    s = s.replace(p, "")
                out[t.id] = re.sub(r"Int32\(([^()]*)\)", r"\1", s)
    return out


def test_loader_consumer_and_mirror_share_the_tile_loop_nest():
    """The loader (Pipeline.load_queue), the consumers (Matvec.run_piped) and the host mirror
    (spec.matvec_tiles) must walk the same tiles: same loop nest (passes > ROW_CHUNK rows >
    K-chunks > tile rows), same bounds and the same tile-size rule. Read from the sources, so an
    edit to one of them that the others do not follow fails here, before a GPU hangs on it."""
    import inspect

    pytest.importorskip("cutlass", reason="the device modules import the DSL")
    from megakernel.kernel.device import matvec as mv
    from megakernel.kernel.device import pipeline as pl

    load = inspect.getsource(pl.Pipeline.load_queue)
    cons = inspect.getsource(mv.Matvec.run_piped)
    mirror = inspect.getsource(plans.matvec_tiles)
    # tile-walking loops only (the tidx-strided ones are per-thread work, not tiles)
    lt = [(v, it) for _, v, it in _loops(load)]
    ct = [(v, it) for _, v, it in _loops(cons) if "tidx" not in it]
    mt = [(v, it) for _, v, it in _loops(mirror)]
    assert lt[:4] == [("_p", "cutlass.range(passes)"), ("rc0", "cutlass.range(0, nrows, RC)"),
                      ("kc0", "cutlass.range(0, k, KC)"), ("t0", "cutlass.range(0, nr, tr)")]
    assert lt[4:] == [("r", "cutlass.range(rows)")]  # per-row copies of a partial-K tile
    assert ct == [("n0", "cutlass.range(0, live, NO)"), ("rc0", "cutlass.range(0, nrows, RC)"),
                  ("kc0", "cutlass.range(0, k, KC)"), ("t0", "cutlass.range(0, nr, tr)")]
    assert mt == [("p", "range(passes)"), ("rc0", "range(0, nrows, ROW_CHUNK)"),
                  ("kc0", "range(0, k, k_chunk)"), ("t0", "range(0, nr, tr)")]
    # the four loops are nested, one inside the other, in both device functions
    assert [d for d, _, it in _loops(load)][:4] == [0, 1, 2, 3]
    cdepth = [d for d, _, it in _loops(cons) if "tidx" not in it]
    assert cdepth == sorted(cdepth) and len(set(cdepth)) == 4
    # same bounds and tile-size rule
    la, ca, ma = _assigns(load), _assigns(cons), _assigns(mirror)
    assert la["nr"] == ca["nr"] == "cutlass.min(RC, nrows - rc0)"
    assert ma["nr"] == "min(ROW_CHUNK, nrows - rc0)"
    assert la["kc"] == ca["kc"] == "cutlass.min(KC, k - kc0)"
    assert ma["kc"] == "min(k_chunk, k - kc0)"
    assert la["tr"] == ca["tr"] == "tile_rows(cutlass.min(KC, k), wb)"
    assert ma["tr"] == "tile_rows(min(k_chunk, k), num_warps, wbytes=wb)"
    # the same bytes per weight (2, or 1 for an FP8 slab: kernel/fp8_index.py) on both sides
    assert la["wb"] == ca["wb"] == "weight_bytes(op)"
    assert la["rows"] == "cutlass.min(tr, nr - t0)" and "min(tr, nr - t0)" in mirror
    assert "cutlass.min(tr, nr - t0)" in cons
    # the lookahead cursor (prefetch_tiles) walks the same nest as an odometer, same bounds
    pf = inspect.getsource(pl.Pipeline.prefetch_tiles)
    pa = _assigns(pf)
    for var in ("nr", "kc", "tr", "rows", "wb"):
        assert pa[var] == la[var], (var, pa[var], la[var])
    for step in ("t0 = t0 + tr", "kc0 = kc0 + KC", "rc0 = rc0 + RC", "p = p + 1",
                 "if p >= passes:"):
        assert step in pf, step
    # one wait, one expect_tx and one j += 1 per loader tile; one wait + one release per consumer
    assert load.count("mbar_wait(") == 1 and load.count("arrive_and_expect_tx(") == 1
    assert load.count("j += 1") == 1 and cons.count("j += 1") == 1
    assert cons.count("wait_full(") == 1 and cons.count(".release(") == 1
    # the loader's K and passes are the consumers': KC = spec.k_chunk, RC = ROW_CHUNK
    assert "KC, RC = self.spec.k_chunk, self.spec.row_chunk" in load


def test_passes_match_the_consumer_outer_loop():
    cfg = preset("qwen3-0.6b")
    for b in range(1, 17):
        for t in (1, 2, 3, 5):
            if b * t > 256:
                continue
            s = make_spec(cfg, b, t, "sm_90a", smem_stages=0)
            assert s.passes == len(range(0, s.rows, s.no)), (b, t)


PROGRAM_CASES = [("llama-tiny", 1, 1), ("qwen3-tiny", 2, 2), ("qwen3-tiny", 9, 1),
                 ("llama-3.2-1b", 1, 1), ("llama-3.2-1b", 3, 3), ("qwen3-0.6b", 4, 1),
                 ("qwen3-1.7b", 9, 1)]


@pytest.mark.parametrize("name,batch,tokens", PROGRAM_CASES)
def test_real_programs_fit_the_ring(name, batch, tokens):
    """On compiled programs (real slab offsets, K and row counts): every bulk copy of the
    loader's plan has a 16-byte aligned global source, a 16-byte aligned stage offset and a
    size that is a multiple of 16; the tile (= expect_tx bytes) fits its stage; the consumers'
    K-split accumulators fit the acc region; the plan has one tile sequence per CTA."""
    from megakernel.program.compiler import compile_program
    from megakernel.program.gpus import gpu
    MATVEC_OPS, Op, decode = isa.matvec_ops(), isa.Op, isa.decode

    cfg = preset(name)
    prog = compile_program(cfg, batch, gpu("h200"), tokens=tokens)
    spec = make_spec(cfg, batch, tokens, "sm_90a")  # the default build: the deepest ring
    assert spec.smem_stages >= limits.MIN_PIPELINE_STAGES
    nw, kc_max = spec.num_warps, spec.k_chunk
    regions = spec.smem_regions()
    assert regions["ring"][0] % 128 == 0 and regions["mbar"][0] % 8 == 0
    assert regions["ring"][0] + spec.smem_stages * SMEM_STAGE_BYTES <= regions["mbar"][0]
    n_tiles = 0
    for q in prog.records().tolist():
        slabs, bases = [], []
        for rec in q:
            if rec[0] == Op.END:
                break
            d = decode(rec)
            if d["OPCODE"] in MATVEC_OPS:
                assert d["K"] % 8 == 0 and d["W"] % 8 == 0, d
                slabs.append((d["NROWS"], d["K"]))
                bases.append(d["W"])
                tr = tile_rows(min(kc_max, d["K"]), nw)
                assert (nw // tr) * spec.no * min(ROW_CHUNK, d["NROWS"]) <= spec.acc_words
            else:
                slabs.append((0, 0))
                bases.append(0)
        plan = stage_plan(slabs, spec.passes, kc_max, nw)
        n_tiles += len(plan)
        for i, _, r0, rows, c0, cols in plan:
            k = slabs[i][1]
            nbytes = rows * cols * 2  # expect_tx
            assert 0 < nbytes <= SMEM_STAGE_BYTES
            copies = [(r0, rows * cols * 2)] if cols == k else [(r0 + r, cols * 2)
                                                                for r in range(rows)]
            assert sum(n for _, n in copies) == nbytes
            for j, (row, n) in enumerate(copies):
                src = 2 * (bases[i] + row * k + c0)
                dst = j * cols * 2  # inside the stage
                assert src % 16 == 0 and dst % 16 == 0 and n % 16 == 0, (i, row, c0, n)
    assert n_tiles > 0


def _loader_ptx(ptx: str, nw: int) -> str:
    """The PTX of the loader warp's branch: from the warp test after the set-up barrier
    (`warp == NW`) to the label the consumers branch to."""
    m = re.search(r"bar\.sync\s+0;\s*\n\s*setp\.ne\.b32\s+(%p\d+), %r\d+, " + str(nw)
                  + r";\s*\n\s*@\1 bra\s+(\$L__BB\d+_\d+);", ptx)
    assert m, "loader branch (warp == NW right after the set-up barrier) not found"
    end = ptx.index("\n" + m.group(2) + ":", m.end())
    return ptx[m.end():end]


def test_loader_path_has_no_warp_collectives(builds):
    """Only lane 0 of the loader warp runs the loader (the other lanes have exited): a
    warp-collective or CTA-wide instruction there would hang or be undefined."""
    for (name, arch), (d, m) in sorted(builds.items()):
        ptx = (d / "megakernel.ptx").read_text()
        body = _loader_ptx(ptx, (m["block"][0] - 32) // 32)
        assert "cp.async.bulk.shared::cluster" in body and "mbarrier.try_wait" in body
        ops = [ln.split()[0] for ln in body.splitlines()
               if ln.strip() and not ln.strip().startswith(("//", "$", "@"))]
        ops += [ln.split()[1] for ln in body.splitlines() if ln.strip().startswith("@")]
        bad = [o for o in ops if o.split(".")[0] in (
            "shfl", "vote", "bar", "barrier", "elect", "redux", "match", "activemask")
            or ".aligned" in o]
        assert not bad, (name, arch, bad)


def test_every_cta_barrier_after_set_up_is_the_consumers_named_barrier(builds):
    """Any barrier form (bar/barrier, sync/arrive/red, with or without a count): exactly one
    barrier 0 (the set-up, before the loader starts); every other one is barrier 1 over the
    consumer threads, so the loader warp (and its exited lanes) never block a CTA barrier."""
    for (name, arch), (d, m) in sorted(builds.items()):
        ptx = (d / "megakernel.ptx").read_text()
        nt = m["block"][0] - 32
        bars = [re.sub(r"\s+", " ", b) for b in re.findall(
            r"\b(?:bar|barrier)(?:\.cta)?\.(?:sync|arrive|red)[^;]*;", ptx)]
        zero = [b for b in bars if re.search(r"\s0\s*[;,]", b)]
        assert zero == ["bar.sync 0;"], (name, arch, zero)
        rest = [b for b in bars if b not in zero]
        assert rest and all(b == f"bar.sync 1, {nt};" for b in rest), (name, arch, set(rest))
        first_named = re.search(rf"bar\.sync\s+1, {nt};", ptx).start()
        assert re.search(r"bar\.sync\s+0;", ptx).start() < first_named


def test_loader_and_consumers_compare_tile_counts_at_end():
    """At END the loader publishes its tile count (an int64 slot after the done mbarrier) and
    arrives on `done`; consumer thread 0 waits for it and traps on a mismatch, before the CTA is
    counted out (megakernel.consume)."""
    import inspect

    pytest.importorskip("cutlass", reason="the device modules import the DSL")
    from megakernel.kernel.device import megakernel as mk
    from megakernel.kernel.device import pipeline as pl

    spec = make_spec(preset("llama-3.2-1b"), 1, 1, "sm_90a", smem_stages=STAGES)
    off, n = spec.smem_regions()["mbar"]
    assert n == 8 * (2 * STAGES + 3) and off % 8 == 0  # full[S], empty[S], done, count, bound
    load = inspect.getsource(pl.Pipeline.load_queue)
    tail = load[load.index("while op != Op.END"):]
    assert "mbar + 2 * self.S + 1" in tail and "mbarrier_arrive(mbar + 2 * self.S)" in tail
    init = inspect.getsource(pl.Pipeline.init)
    assert "mbarrier_init(mbar + 2 * self.S, 1)" in init
    cons = inspect.getsource(mk.DecodeMegakernel.consume)
    assert cons.index("check_done(mbar, j)") < cons.index("finish_step(")
