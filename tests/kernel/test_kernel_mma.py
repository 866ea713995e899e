"""The tensor-core GEMV (matvec.py `mma_tile` / `mma_reduce`, spec.KernelSpec.mma).

No GPU here: a numpy emulation of one ring tile checks that the kernel's operand indexing (the
spec.mma_* helpers the kernel calls), laid onto the PTX ISA fragment layout of mma.sync m16n8k16
(A row-major, B column-major, bf16 pairs in 32-bit registers; written out here from the ISA),
computes the plain dot products; the spec rules choose the path; the compiled
kernel carries the mma in its PTX and HMMA in its SASS, within the register and shared-memory
budgets, on both archs.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.kernel.config import spec as spec_mod
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host import limits
from megakernel.kernel.host.dense_index import mma_c_coord, mma_operand_word, mma_red_index
from megakernel.kernel.host.limits import MMA_K_ALIGN, MMA_M, MMA_MIN_ROWS, MMA_N
from megakernel.models import preset


# ---- emulation of one tile (PTX ISA: "Matrix Fragments for mma.m16n8k16", .bf16) -------------
def _fragments_to_matrices(a_regs, b_regs):
    """Per-lane registers -> the A [16, 16] and B [16, 8] the mma multiplies (each register is
    two consecutive bf16 of one row of A / one column of B)."""
    A = np.full((16, 16), np.nan, np.float64)
    B = np.full((16, 8), np.nan, np.float64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        a0, a1, a2, a3 = a_regs[lane]
        b0, b1 = b_regs[lane]
        A[g, 2 * t:2 * t + 2] = a0
        A[g + 8, 2 * t:2 * t + 2] = a1
        A[g, 2 * t + 8:2 * t + 10] = a2
        A[g + 8, 2 * t + 8:2 * t + 10] = a3
        B[2 * t:2 * t + 2, g] = b0
        B[2 * t + 8:2 * t + 10, g] = b1
    assert not np.isnan(A).any() and not np.isnan(B).any()  # every slot supplied by a lane
    return A, B


def _emulate_tile(x: np.ndarray, tile: np.ndarray, rows: int, kc: int, nw: int = 8
                  ) -> np.ndarray:
    """What mma_tile + mma_reduce leave for one tile: [NO, rows]. `x` is the staged input as
    sX holds it, [NO, XS] (XS = spec.x_stride), `tile` the ring stage as [8, kc] (rows >=
    `rows` hold stale data)."""
    NO, XS = x.shape
    xw = x.reshape(NO * XS // 2, 2)  # 32-bit words of bf16 pairs
    ww = tile.reshape(-1, 2)
    steps = kc // MMA_K_ALIGN
    per = -(-steps // nw)
    red = np.full(2 * nw * NO * MMA_N, np.nan)  # sRed, flat, as the kernel indexes it
    buf = 1
    for warp in range(nw):
        sb, se = warp * per, min(steps, warp * per + per)
        acc = np.zeros((NO // MMA_M, 16, 8))
        for st in range(sb, se):
            for mb in range(NO // MMA_M):
                lo, hi, bw = {}, {}, {}
                for lane in range(32):  # the kernel's word offsets (spec.mma_operand_word)
                    g, t = divmod(lane, 4)
                    wb = mma_operand_word(g, st, t, kc // 2)
                    wa = mma_operand_word(mb * MMA_M + g, st, t, XS // 2)
                    wh = mma_operand_word(mb * MMA_M + g + 8, st, t, XS // 2)
                    bw[lane] = ([ww[wb + i] for i in range(4)] if g < rows
                                else [np.zeros(2)] * 4)
                    lo[lane] = [xw[wa + i] for i in range(4)]
                    hi[lane] = [xw[wh + i] for i in range(4)]
                for h in range(2):
                    a = {ln: (lo[ln][2 * h], hi[ln][2 * h], lo[ln][2 * h + 1], hi[ln][2 * h + 1])
                         for ln in range(32)}
                    b = {ln: (bw[ln][2 * h], bw[ln][2 * h + 1]) for ln in range(32)}
                    A, B = _fragments_to_matrices(a, b)
                    acc[mb] += A @ B
        for lane in range(32):  # C fragment -> sRed
            g, t = divmod(lane, 4)
            for mb in range(NO // MMA_M):
                # the PTX ISA's C/D layout: c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
                for c, (mm, nn) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                              (g + 8, 2 * t + 1))):
                    m, n = mma_c_coord(g, t, c)  # where the kernel puts register c
                    red[mma_red_index(buf, warp, mb * MMA_M + m, n, nw, NO)] = acc[mb][mm, nn]
    out = np.zeros((NO, rows))
    for nn in range(NO):  # mma_reduce: warps in order
        for r in range(rows):
            v = red[mma_red_index(buf, 0, nn, r, nw, NO)]
            for w in range(1, nw):
                v = v + red[mma_red_index(buf, w, nn, r, nw, NO)]
            out[nn, r] = v
    return out


def _bf16(a: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(a).to(torch.bfloat16).to(torch.float64).numpy()


@pytest.mark.parametrize("NO,KC,kc,rows", [(16, 2048, 2048, 8), (32, 1024, 1024, 8),
                                           (16, 2048, 512, 3), (32, 1024, 96, 8),
                                           (16, 2048, 2048 - 32, 5)])
def test_fragment_mapping_computes_the_dot_products(NO, KC, kc, rows):
    rng = np.random.default_rng(NO * 7 + kc + rows)
    x = np.full((NO, KC + limits.MMA_X_PAD), np.nan)  # sX rows x_stride apart, pad unread
    x[:, :kc] = _bf16(rng.standard_normal((NO, kc)))  # the K-chunk staged (kc <= KC)
    tile = _bf16(rng.standard_normal((MMA_N, kc)))
    tile[rows:] = np.nan  # stale rows of a short last tile must not leak into the result
    got = _emulate_tile(x, tile, rows, kc)
    want = x[:, :kc] @ tile[:rows].T
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)


# ---- spec rules ---------------------------------------------------------------------------------
def test_mma_path_is_chosen_by_rows_pipeline_and_alignment():
    cfg = preset("llama-3.2-1b")
    assert not make_spec(cfg, 1, 1, "sm_90a").mma  # B = 1: the FMA GEMV
    assert not make_spec(cfg, MMA_MIN_ROWS - 1, 1, "sm_90a").mma
    for b, t in ((MMA_MIN_ROWS, 1), (4, 4), (16, 1), (64, 1)):
        s = make_spec(cfg, b, t, "sm_90a")
        assert s.mma and s.pipelined, (b, t)
        assert s.x_stride == s.k_chunk + limits.MMA_X_PAD and (2 * s.x_stride) % 128 == 64
        assert s.no % MMA_M == 0 and s.no <= 2 * MMA_M and s.no >= min(s.rows, 2 * MMA_M)
        assert limits.tile_rows(min(s.k_chunk, s.k_max), s.num_warps) == MMA_N
        off, n = s.smem_regions()["red"]
        assert n == 4 * 2 * s.num_warps * s.no * MMA_N
        assert s.smem_bytes <= limits.SMEM_BUDGET
        assert 4 * s.acc_words <= limits.ACC_SMEM_BYTES
    # the global-memory path has no tensor-core GEMV
    assert not make_spec(cfg, 16, 1, "sm_90a", smem_stages=0).mma
    # every K must be a multiple of 32 (16 bytes per lane per weight row)
    # (a multiple of GATEUP_BLOCK = 16, as validate() requires, but not of 32)
    odd = dataclasses.replace(preset("llama-tiny"), intermediate_size=336)  # 336 % 32 = 16
    assert not make_spec(odd, 16, 1, "sm_90a").mma
    assert make_spec(preset("llama-tiny"), 16, 1, "sm_90a").mma
    # gpu-check runs both GEMVs on the GPU
    from megakernel.gpu_check.cases import stage_cases

    paths = {make_spec(preset(c.model), c.batch, c.tokens, "sm_90a").mma for c, _ in stage_cases()}
    assert paths == {True, False}


def test_cost_model_charges_the_path_the_build_runs():
    from megakernel.program.compiler import compile_program
    from megakernel.program.gpus import gpu

    MATVEC_OPS = isa.matvec_ops()

    cfg = preset("llama-tiny")
    for b, tensor in ((1, False), (4, False), (16, True), (64, True)):
        prog = compile_program(cfg, b, gpu("h200"), policy="structure")
        mv = [i for i in prog.instrs if i.op in MATVEC_OPS]
        assert all((i.tensor_flops > 0) == tensor and (i.fp32_flops > 0) != tensor
                   for i in mv), b
    # passes over the activation rows after the first re-read the slab through L2
    from megakernel.isa.stages import Counters
    from megakernel.layers.base import StepShape
    from megakernel.program import compiler as C
    from megakernel.program.pack import weight_layout

    assert make_spec(cfg, 64, 1, "sm_90a").passes == 2
    made = {}
    for passes in (1, 2):
        buf = C.plan_buffers(cfg, StepShape(64, 1, 128, 2, 132, 0))
        ctx = C.BuildContext(cfg, 64, 1, 64, 2, None, weight_layout(cfg), buf, Counters(), True,
                             passes)
        st = C.build_stages(ctx)
        made[passes] = [g.make(0, 1) for g in st if g.op in MATVEC_OPS]
    for one, two in zip(made[1], made[2], strict=True):
        assert two.l2_bytes - one.l2_bytes == one.w_bytes > 0


# ---- compiled (DSL) -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def builds(kernel_build):
    return {(name, b, t, arch): kernel_build(preset(name), arch, b, t)
            for name, b, t in (("llama-tiny", 16, 1), ("qwen3-tiny", 4, 4), ("llama-tiny", 1, 1))
            for arch in ARCHS}


def test_mma_builds_carry_tensor_core_instructions_within_budget(builds):
    from megakernel.kernel.toolchain.tools import sass_text

    for (name, b, t, arch), (d, m) in sorted(builds.items()):
        spec = spec_mod.KernelSpec.from_dict(m["spec"])
        ptx = (d / "megakernel.ptx").read_text()
        sass = sass_text(str(d / "megakernel.cubin"))
        n_mma = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
        n_hmma = len(re.findall(r"HMMA\.16816\.F32\.BF16", sass))
        r = m["resources"]
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["local_bytes"] == 0
        assert 0 < r["registers"] <= limits.REGISTER_BUDGET, (name, b, arch, r)
        assert m["dynamic_smem_bytes"] == spec.smem_bytes <= limits.SMEM_BUDGET
        if spec.mma:
            assert n_mma >= 2 and n_hmma >= 2, (name, b, t, arch, n_mma, n_hmma)
            assert "ld.shared.v4.b32" in ptx  # 16-byte operand loads from the ring and x
        elif spec.attn_tensor_cores:  # the FMA GEMV beside attention's tensor-core partial
            assert n_mma >= 2 and n_hmma >= 2, (name, b, t, arch, n_mma, n_hmma)
        else:
            assert n_mma == 0 and n_hmma == 0, (name, b, t, arch)
    assert {spec_mod.KernelSpec.from_dict(m["spec"]).mma for _, m in builds.values()} == {
        True, False}
