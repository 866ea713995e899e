"""The second hybrid slice in the kernel: Qwen3.5's gated full attention (partial RoPE, (1 + w)
q/k norms, sigmoid output gate) and the (1 + w) RMSNorm, as compile-time switches of KernelSpec.

CPU only: check_kernel_support's rows for the family; the spec's switches and the gate offset
against the compiled programs' headers (launch.checks.check_header); builds of qwen3.5-attn-tiny for
sm_90a and sm_100a within the budgets, their PTX holding the merge's sigmoid and the dense builds'
not; numpy emulations, with the kernel's own index helpers (rope_pair, qkv_slot, gate_index), of
the partial-RoPE pairing against the executor's rope and of the gate's addressing (QKV epilogue
store, merge load) against the executor's gate buffer [N, Hq, D].
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megakernel.common.arch import ARCHS
from megakernel.common.errors import SpecError
from megakernel.executor.ops.attention import rope
from megakernel.kernel.config import spec as spec_mod
from megakernel.kernel.config.model_spec import check_kernel_support, make_spec
from megakernel.kernel.host.dense_index import gate_index, qkv_slot, rope_pair
from megakernel.kernel.host.limits import LANES
from megakernel.launch.checks import ArgumentError, check_header
from megakernel.models import preset
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from tests.kernel.helpers import specs_within_budgets, variant_builds

GATED = "qwen3.5-attn-tiny"


def _qwen35(**att):  # noqa: ANN003, ANN202
    """qwen3.5-attn-tiny with other attention settings."""
    cfg = preset(GATED)
    return cfg.replace(attention=cfg.attention.__class__(**{**cfg.attention.__dict__, **att}))


SUPPORT = [
    (lambda: preset(GATED), None),
    (lambda: _qwen35(head_dim=256, rotary_dim=64), None),  # the real presets' layout
    (lambda: _qwen35(head_dim=128, rotary_dim=128), None),
    (lambda: preset("qwen3.5-tiny"), None),  # GDN_CORE has a handler (kernel/device/gdn.py)
    (lambda: preset("qwen3.5-0.8b"), None),
    (lambda: _qwen35(head_dim=128, rotary_dim=48), ("RoPE on 48 of 128",)),
]


@pytest.mark.parametrize("make,refusal", SUPPORT)
def test_kernel_support_table(make, refusal):
    cfg = make()
    if refusal is None:
        check_kernel_support(cfg)
        return
    with pytest.raises(SpecError) as e:
        check_kernel_support(cfg)
    for word in refusal:
        assert word in str(e.value), (word, str(e.value))


@pytest.mark.parametrize("batch", [1, 4])
def test_spec_switches_and_the_gate_offset_match_the_programs(batch):
    cfg = preset(GATED)
    s = make_spec(cfg, batch, 1, "sm_90a")
    assert s.output_gate and s.norm_one_plus and s.rotary == 16 and s.rotary_dim == 16
    assert s.qkv_slots == 2 * s.group + 2 and s.qkv_rows == cfg.attention.qkv_rows
    assert spec_mod.KernelSpec.from_dict(s.to_dict()) == s
    for n_splits, s_max in ((1, 64), (3, 128), (8, 512)):
        hdr = compile_program(cfg, batch, gpu("h200"), max_seq_len=s_max,
                              n_splits=n_splits).header
        assert hdr["F32_GATE_OFF"] == s.gate_off, (n_splits, s_max)
        check_header(hdr, s.to_dict())
    with pytest.raises(ArgumentError, match="F32_GATE_OFF"):
        check_header({**hdr, "F32_GATE_OFF": s.gate_off + 64}, s.to_dict())
    dense = make_spec(preset("qwen3-tiny"), batch, 1, "sm_90a")
    assert not (dense.output_gate or dense.norm_one_plus or dense.rotary) and dense.gate_off < 0
    with pytest.raises(ArgumentError, match="NORM_KIND"):
        check_header(hdr, dense.to_dict())


# ---- builds -------------------------------------------------------------------------------------
# the merge's gate: e = ex2(-g log2 e) (cute.math.exp), 1 + e, its reciprocal times the merged
# output, rounded to bf16
SIGMOID_PTX = re.compile(r"ex2\.approx\.ftz\.f32\s+(%r\d+), %r\d+;\s*"
                         r"fma\.rn\.f32\s+(%r\d+), \1, %r\d+, 0f3F800000;\s*"
                         r"rcp\.rn\.f32\s+(%r\d+), \2;\s*"
                         r"mul\.f32\s+(%r\d+), %r\d+, \3;\s*"
                         r"cvt\.rn\.bf16\.f32\s+%rs\d+, \4;")


@pytest.fixture(scope="module")
def gated_builds(kernel_build):  # noqa: ANN001, ANN201
    return variant_builds(kernel_build, GATED)


def test_gated_builds_within_budgets(gated_builds):
    for s in specs_within_budgets(gated_builds).values():
        assert s.output_gate and s.norm_one_plus and s.rotary == 16 and s.gate_off >= 0


def test_ptx_holds_the_gate_sigmoid_and_dense_builds_do_not(gated_builds, kernel_build):
    for key, (d, _) in gated_builds.items():
        assert SIGMOID_PTX.search((d / "megakernel.ptx").read_text()), key
    for arch in ARCHS:
        d, _ = kernel_build(preset("qwen3-tiny"), arch, 4, 1, smem_stages=0)
        assert not SIGMOID_PTX.search((d / "megakernel.ptx").read_text()), arch


# ---- emulations ---------------------------------------------------------------------------------
def _kernel_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary: int) -> np.ndarray:
    """Matvec.epi_qkv's RoPE on one head x [D] (lane holds dims lane + 32 e) with the kernel's
    pairing: registers e, e + half of one lane when R/2 is a multiple of 32, else (R <= 32)
    register 0 of lane d and of lane rope_pair(d)."""
    d_ = x.shape[0]
    reg = x.reshape(d_ // LANES, LANES).T.copy()  # reg[lane, e] = x[lane + 32 e]
    hd = rotary // 2
    half = hd // LANES
    if half:
        for lane in range(LANES):
            for e in range(half):
                i = lane + LANES * e
                x1, x2 = reg[lane, e], reg[lane, e + half]
                reg[lane, e] = x1 * cos[i] + (-x2) * sin[i]
                reg[lane, e + half] = x2 * cos[i] + x1 * sin[i]
    else:
        new = reg[:, 0].copy()
        for lane in range(LANES):
            partner, col, upper = rope_pair(lane, hd)
            xp = reg[partner, 0]  # shuffle_sync
            if lane < 2 * hd:
                sgn = 1.0 if upper else -1.0
                new[lane] = reg[lane, 0] * cos[col] + sgn * xp * sin[col]
        reg[:, 0] = new
    return reg.T.reshape(-1)


@pytest.mark.parametrize("d,rotary", [(64, 16), (64, 32), (64, 64), (256, 64), (128, 128)])
def test_partial_rope_pairing_matches_the_executor(d, rotary):
    g = torch.Generator().manual_seed(d + rotary)
    s_max, n = 16, 5
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    pos = torch.randint(0, s_max, (n,), generator=g)
    table = torch.randn(2, s_max, rotary // 2, generator=g, dtype=torch.float64)
    ex = SimpleNamespace(prog=SimpleNamespace(header={"ROTARY_DIM": rotary}, max_seq_len=s_max),
                         f32=table.reshape(-1))
    want = rope(ex, x, pos, 0).numpy()
    for r in range(n):
        p = int(pos[r])
        got = _kernel_rope(x[r].numpy(), table[0, p].numpy(), table[1, p].numpy(), rotary)
        np.testing.assert_allclose(got, want[r], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch", [1, 4])
def test_gate_addressing_matches_the_executor(batch):
    s = make_spec(preset(GATED), batch, 1, "sm_90a")
    n_rows, hq, d, g, e_ = s.rows, s.heads, s.head_dim, s.group, s.head_dim // LANES
    rng = np.random.default_rng(batch)
    acc = rng.standard_normal((n_rows, s.kv_heads * s.qkv_slots, d))  # QKV slab outputs
    # the executor: slot j of group grp = divmod(slot, G + NG + 2), gate head grp*G + j - G of
    # the gate buffer [N, Hq, D]
    want = np.full((n_rows, hq, d), np.nan)
    for slot in range(acc.shape[1]):
        grp, jj = divmod(slot, 2 * g + 2)
        if g <= jj < 2 * g:
            want[:, grp * g + jj - g] = acc[:, slot]
    # the QKV epilogue's stores (lane holds dims lane + 32 e)
    buf = np.full(n_rows * hq * d, np.nan)
    for slot in range(acc.shape[1]):
        grp, j = qkv_slot(slot, g, True)
        if g <= j < 2 * g:
            for n in range(n_rows):
                for lane in range(LANES):
                    for e in range(e_):
                        buf[gate_index(n, grp * g + j - g, lane + LANES * e, hq, d)] = \
                            acc[n, slot, lane + LANES * e]
    np.testing.assert_array_equal(buf.reshape(n_rows, hq, d), want)
    # the merge's loads (lane holds dims lane * E + e) read the executor's gate
    for n in range(n_rows):
        for head in range(hq):
            got = np.array([[buf[gate_index(n, head, lane * e_ + e, hq, d)] for e in range(e_)]
                            for lane in range(LANES)]).reshape(-1)
            np.testing.assert_array_equal(got, want[n, head])
