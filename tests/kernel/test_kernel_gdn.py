"""Builds of the GDN handler (kernel/device/gdn.py): Qwen3.5 (GDN + gated attention) on both archs
and weight paths, recurrent and by ReplaySSM (GDN_REPLAY, fold window 4), within the
register/spill/local budgets; T = 4 tokens per step; the handler compiled in only where the model
has GDN layers; the spec's scratch span and tag; the ReplaySSM window against the header."""

from __future__ import annotations

import re

import pytest

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.common.errors import SpecError
from megakernel.executor import executor_gpu
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host import limits
from megakernel.launch.checks import ArgumentError, check_header
from megakernel.models import preset
from megakernel.program.compiler import compile_program
from tests.kernel.helpers import specs_within_budgets, variant_builds

GDN = "qwen3.5-tiny"
# the handler's transcendentals: the gates' exp / softplus / sigmoid, the l2 and RMS norms' sqrt
MATH_PTX = re.compile(r"ex2\.approx\.ftz\.f32|sqrt\.rn\.f32")
STATE_PREFETCH = "cp.async.bulk.prefetch.L2.global"


@pytest.fixture(scope="module")
def gdn_builds(kernel_build):  # noqa: ANN001, ANN201
    return variant_builds(kernel_build, GDN)


def test_gdn_builds_within_budgets(gdn_builds):
    for s in specs_within_budgets(gdn_builds).values():
        assert s.constants("gdn") == (2, 4, 16, 8, 4) and isa.Op.GDN_CORE in s.handled_ops
        assert isa.Op.GDN_REPLAY not in s.handled_ops and s.recurrent_smem_bytes > 0


def test_gdn_builds_for_four_tokens(kernel_build):
    builds = {arch: kernel_build(preset(GDN), arch, 2, 4) for arch in ARCHS}
    for s in specs_within_budgets(builds).values():
        assert s.tokens == 4 and s.shape("gdn").smem()["words"] * 4 == s.recurrent_smem_bytes


WINDOW = 4  # the ReplaySSM builds' fold window L


@pytest.fixture(scope="module")
def replay_builds(kernel_build):  # noqa: ANN001, ANN201
    """Both archs: B = 1 on the pipeline and B = 4 on the global-memory path (T = 1), and T = 4
    (B = 2, the pipeline)."""
    return {(arch, b, t, st): kernel_build(preset(GDN), arch, b, t, smem_stages=st,
                                           replay_window=WINDOW)
            for arch in ARCHS for b, t, st in ((1, 1, None), (4, 1, 0), (2, 4, None))}


def test_gdn_replay_builds_within_budgets(replay_builds, gdn_builds):
    for (_, _, t, _), s in specs_within_budgets(replay_builds).items():
        assert isa.Op.GDN_REPLAY in s.handled_ops and isa.Op.GDN_CORE not in s.handled_ops
        assert s.replay_window == WINDOW and s.shape("gdn").cap == WINDOW - 1 + t
        assert s.shape("gdn").smem()["words"] * 4 == s.recurrent_smem_bytes
    for arch in ARCHS:  # the ReplaySSM math (decays of the ring and the fold) is compiled in
        mine = (replay_builds[(arch, 1, 1, None)][0] / "megakernel.ptx").read_text()
        theirs = (gdn_builds[(arch, 1, None)][0] / "megakernel.ptx").read_text()
        assert len(MATH_PTX.findall(mine)) >= len(MATH_PTX.findall(theirs)) + 2, arch


def test_replay_window_is_a_build_constant_checked_against_the_header():
    """A ReplaySSM build bakes in L (its ring capacity and fold); a program compiled with
    another window, or none, is refused, and a replay spec without a window is refused."""
    s = make_spec(preset(GDN), 2, 1, "sm_90a", replay_window=WINDOW)
    assert s.ring_cap == WINDOW and isa.Op.GDN_REPLAY in s.ops
    for window, ok in ((WINDOW, True), (WINDOW + 1, False), (None, False)):
        hdr = compile_program(preset(GDN), 2, executor_gpu(8), max_seq_len=32,
                              replay_window=window).header
        if ok:
            check_header(hdr, s.to_dict())
        else:
            with pytest.raises(ArgumentError, match="REPLAY_WINDOW"):
                check_header(hdr, s.to_dict())
    with pytest.raises(SpecError, match="replay_window >= 1"):
        make_spec(preset(GDN), 1, 1, "sm_90a", smem_stages=0, replay=True)
    with pytest.raises(SpecError, match="recurrent layers"):
        make_spec(preset("qwen3.5-attn-tiny"), 1, 1, "sm_90a", replay_window=WINDOW)


def test_only_gdn_builds_carry_the_handler(gdn_builds, kernel_build):
    # the attention-only model's global-memory build: its attention is the FMA loop, as the GDN
    # model's (the weight-ring build's runs on tensor cores, with exps of its own)
    attn_only = {arch: kernel_build(preset("qwen3.5-attn-tiny"), arch, smem_stages=0)
                 for arch in ARCHS}
    for arch in ARCHS:
        mine = (gdn_builds[(arch, 1, None)][0] / "megakernel.ptx").read_text()
        theirs = (attn_only[arch][0] / "megakernel.ptx").read_text()
        assert len(MATH_PTX.findall(mine)) >= len(MATH_PTX.findall(theirs)) + 8, arch
        # the state prefetch before the wait (and the weight lookahead both have)
        assert mine.count(STATE_PREFETCH) > theirs.count(STATE_PREFETCH), arch


def test_spec_tag_tells_layer_patterns_apart():
    """Two models with the same main shapes but other layers (GDN or attention) have different
    build-set tags, so a build set never serves one with the other's cubin."""
    a = make_spec(preset(GDN), 1, 1, "sm_90a")
    b = make_spec(preset("qwen3.5-attn-tiny"), 1, 1, "sm_90a")
    assert a.tag != b.tag and a.tag.split("-")[:-1] == b.tag.split("-")[:-1]
    assert make_spec(preset(GDN), 1, 1, "sm_100a").tag == a.tag  # the variants share it


def test_recurrent_scratch_fits_and_extends_the_consumer_span():
    """The GDN scratch span starts at shared byte 0 and ends before the weight ring: when the
    consumers' regions are shorter, an `ssm` region extends them."""
    for name, b, t in ((GDN, 1, 1), (GDN, 4, 4), ("qwen3.5-0.8b", 1, 1), ("qwen3.5-0.8b", 8, 4)):
        s = make_spec(preset(name), b, t, "sm_90a")
        regions = s.smem_regions()
        end = regions["ring"][0] if s.pipelined else s.smem_bytes
        assert s.recurrent_smem_bytes <= end, (name, b, t)
        assert s.smem_bytes <= limits.SMEM_BUDGET
