"""The first hybrid family in the kernel: Nemotron-H's attention (no RoPE, KV cache slots of the
attention layers only) and relu^2 MLP blocks, with per-family handler selection.

CPU only: check_kernel_support's refusals as a table; the spec carries the model's opcodes, its
attention layers and the RoPE switch; the dispatch tables (OpTable) hold only the epilogues the
model uses; builds of the "*-*-" preset for sm_90a and sm_100a within the resource budgets, their
PTX holding the relu^2 epilogue and the dense builds' not (the session build cache).
"""

from __future__ import annotations

import re

import pytest

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.common.errors import SpecError
from megakernel.kernel.config import spec as spec_mod
from megakernel.kernel.config.fields import OpTable
from megakernel.kernel.config.model_spec import check_kernel_support, make_spec, program_ops
from megakernel.launch.checks import ArgumentError, check_header
from megakernel.models import preset
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from tests.kernel.helpers import specs_within_budgets, variant_builds

HYBRID = "nemotron-h-attn-tiny"  # hybrid_override_pattern "*-*-"


def _nemotron(pattern: str):  # noqa: ANN202
    """nemotron-h-tiny with its layers from a hybrid_override_pattern (M, *, -)."""
    kinds = {"M": "mamba2", "*": "attention", "-": "mlp"}
    return preset("nemotron-h-tiny").replace(layer_types=tuple(kinds[c] for c in pattern))


# (config, None when accepted else the words the refusal names)
SUPPORT = [
    (lambda: preset("llama-tiny"), None),
    (lambda: preset("qwen3-tiny"), None),
    (lambda: preset(HYBRID), None),
    (lambda: _nemotron("-*-*--*"), None),
    (lambda: _nemotron("*-M-"), None),  # MAMBA_CORE has a handler (kernel/mamba2.py)
    (lambda: preset("nemotron-h-tiny"), None),
    (lambda: preset("qwen3.5-tiny"), None),  # GDN_CORE (kernel/device/gdn.py)
    (lambda: preset("kimi-linear-tiny"), None),  # KDA, MLA, MoE (kda.py, mla.py, moe*.py)
    (lambda: _nemotron("**"), ("feed-forward", "[]")),
    (lambda: _nemotron("--"), None),  # no attention layers: no attention handler is built
    (lambda: preset("qwen3.5-tiny").replace(layer_types=("gdn", "attention", "gdn")), None),
    (lambda: preset("qwen3.5-tiny").replace(layer_types=("attention",)), None),  # attention only
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


def test_kimi_spec_carries_its_kinds_and_traps_what_has_no_handler(monkeypatch):
    """The kinds' constants come from LayerKind.kernel_constants; MLA layers hold the KV slots;
    the attention fields are KernelSpec.NO_ATTENTION's placeholders. make_spec(unhandled="trap")
    builds without an opcode that has no handler (planted here: MLA's, unregistered from the
    device), which make_spec otherwise refuses by name."""
    import dataclasses

    from megakernel.isa import registry

    cfg = preset("kimi-linear-tiny")
    s = make_spec(cfg, 2, 1, "sm_90a")
    assert set(s.ops) == program_ops(cfg) and all(isa.spec(op).device for op in s.ops)
    mla = isa.spec(isa.Op.MLA)
    monkeypatch.setitem(registry._SPECS, int(isa.Op.MLA),
                        dataclasses.replace(mla, device=False, handler=None))
    with pytest.raises(SpecError, match="no device handlers for MLA yet"):
        make_spec(cfg, 2, 1, "sm_90a")
    trap = make_spec(cfg, 2, 1, "sm_90a", unhandled="trap")
    assert set(trap.ops) == program_ops(cfg) - {isa.Op.MLA}
    assert s.constants("kda") == (2, 16, 4) and s.constants("mla") == (4, 32, 16, 8, 16)
    assert s.constants("moe")[:6] == (8, 3, 32, 4, 2, 1)
    assert s.attn_layers == (1,) and s.heads == 0 and isa.Op.ATTN_PARTIAL not in s.ops
    assert {16 * 2, 4 * 16, 32} <= set(s.matvec_ks)  # KDA H d, MLA H dv, an expert's I
    with pytest.raises(SpecError, match="unhandled"):
        make_spec(cfg, 1, 1, "sm_90a", unhandled="skip")


def test_spec_carries_the_models_opcodes_attention_layers_and_rope():
    cfg = _nemotron("-*-*--*")
    s = make_spec(cfg, 1, 1, "sm_90a")
    assert set(s.ops) == program_ops(cfg) and isa.Op.UP_RELU2 in s.ops
    assert isa.Op.GATEUP not in s.ops
    assert s.attn_layers == (1, 3, 6) and s.kv_layers == 3 and not s.rope
    assert s.inter == cfg.intermediate_size
    assert spec_mod.KernelSpec.from_dict(s.to_dict()) == s
    dense = make_spec(preset("llama-tiny"), 1, 1, "sm_90a")
    assert dense.attn_layers == () and dense.kv_layers == dense.layers and dense.rope
    assert set(dense.ops) == program_ops(preset("llama-tiny")) == set(dense.handled_ops)


def test_dispatch_tables_hold_only_the_models_epilogues():
    hyb = OpTable.for_spec(make_spec(preset(HYBRID), 1, 1, "sm_90a"))
    dense = OpTable.for_spec(make_spec(preset("llama-tiny"), 1, 1, "sm_90a"))
    assert hyb.epilogue("epilogues.Relu2") == (isa.Op.UP_RELU2,)
    assert hyb.epilogue("epilogues.GateUp") == ()
    assert dense.epilogue("epilogues.GateUp") == (isa.Op.GATEUP,)
    assert dense.epilogue("epilogues.Relu2") == ()
    assert isa.Op.UP_RELU2 in hyb.slab and isa.Op.UP_RELU2 not in dense.slab
    assert dense.handled == tuple(sorted(program_ops(preset("llama-tiny"))))


# ---- builds -------------------------------------------------------------------------------------
# relu(acc)^2 in fp32: acc <= 0 selects 0 (a NaN stays NaN, as torch.relu), then the square
RELU2_PTX = re.compile(r"setp\.le\.f32\s+(%p\d+), (%r\d+), 0f00000000;\s*"
                       r"selp\.f32\s+(%r\d+), 0f00000000, \2, \1;.*?mul\.f32\s+%r\d+, \3, \3;",
                       re.S)


@pytest.fixture(scope="module")
def hybrid_builds(kernel_build):  # noqa: ANN001, ANN201
    return variant_builds(kernel_build, HYBRID)


def test_hybrid_builds_within_budgets(hybrid_builds):
    for s in specs_within_budgets(hybrid_builds).values():
        assert s.attn_layers == (0, 2) and not s.rope and isa.Op.UP_RELU2 in s.ops


def test_ptx_holds_the_relu2_epilogue_and_dense_builds_do_not(hybrid_builds, kernel_build):
    for key, (d, _) in hybrid_builds.items():
        assert RELU2_PTX.search((d / "megakernel.ptx").read_text()), key
    for arch in ARCHS:
        d, _ = kernel_build(preset("llama-tiny"), arch, 1, 1, smem_stages=0)
        assert not RELU2_PTX.search((d / "megakernel.ptx").read_text()), arch


# ---- Mamba2 (MAMBA_CORE, kernel/mamba2.py) ------------------------------------------------
@pytest.fixture(scope="module")
def mamba_builds(kernel_build):  # noqa: ANN001, ANN201
    return variant_builds(kernel_build, "nemotron-h-tiny")


def test_mamba_builds_within_budgets(mamba_builds, kernel_build):
    """nemotron-h-tiny (Mamba2 + attention + relu^2) on both archs and weight paths, and at T = 4,
    without spills or local memory within the register budget."""
    for s in specs_within_budgets(mamba_builds).values():
        assert s.has("mamba2") and isa.Op.MAMBA_CORE in s.handled_ops and s.recurrent_smem_bytes > 0
        assert isa.Op.MAMBA_REPLAY not in s.handled_ops and not s.has("gdn")
    four = {arch: kernel_build(preset("nemotron-h-tiny"), arch, 2, 4) for arch in ARCHS}
    for s in specs_within_budgets(four).values():
        assert s.tokens == 4


def test_only_mamba_builds_carry_the_state_prefetch(mamba_builds, hybrid_builds):
    """The state prefetch before the dependency wait is compiled into the Mamba2 builds only."""
    for key, (d, _) in mamba_builds.items():
        mine = (d / "megakernel.ptx").read_text().count("cp.async.bulk.prefetch.L2.global")
        theirs = (hybrid_builds[key][0] / "megakernel.ptx").read_text().count(
            "cp.async.bulk.prefetch.L2.global")
        assert mine > theirs, key


# ---- Mamba2 by ReplaySSM (MAMBA_REPLAY, kernel/device/mamba_replay.py) ---------------------------
WINDOW = 4


def test_replay_spec_and_the_program_header():
    """replay_window is a constant of the build: its op set and ring capacity follow from it,
    the program header's REPLAY_WINDOW and RING_CAP must match it (launch.checks.check_header), a
    dense model or a ReplaySSM op set without a window is refused."""
    cfg = preset("nemotron-h-tiny")
    s = make_spec(cfg, 2, 2, "sm_90a", replay_window=WINDOW)
    assert s.replay_window == WINDOW and s.ring_cap == s.shape("mamba2").cap == WINDOW - 1 + 2
    assert isa.Op.MAMBA_REPLAY in s.handled_ops and isa.Op.MAMBA_CORE not in s.handled_ops
    assert spec_mod.KernelSpec.from_dict(s.to_dict()) == s
    assert s.tag != make_spec(cfg, 2, 2, "sm_90a").tag
    with pytest.raises(SpecError, match="recurrent layers"):
        make_spec(preset("llama-tiny"), 1, 1, "sm_90a", replay_window=WINDOW)
    with pytest.raises(SpecError, match="replay_window >= 1"):
        make_spec(cfg, 1, 1, "sm_90a", replay=True)
    h200 = gpu("h200")
    replayed = compile_program(cfg, 2, h200, tokens=2, max_seq_len=32, replay_window=WINDOW)
    recurrent = compile_program(cfg, 2, h200, tokens=2, max_seq_len=32)
    check_header(replayed.header, s.to_dict())
    check_header(recurrent.header, make_spec(cfg, 2, 2, "sm_90a").to_dict())
    other = compile_program(cfg, 2, h200, tokens=2, max_seq_len=32, replay_window=WINDOW + 1)
    for header, spec, field in (
            (recurrent.header, s, "REPLAY_WINDOW"),
            (replayed.header, make_spec(cfg, 2, 2, "sm_90a"), "REPLAY_WINDOW"),
            (other.header, s, "REPLAY_WINDOW"),
            ({**replayed.header, "RING_CAP": WINDOW}, s, "RING_CAP")):
        with pytest.raises(ArgumentError, match=field):
            check_header(header, spec.to_dict())


def test_mamba_replay_builds_within_budgets(kernel_build):
    """nemotron-h-tiny by ReplaySSM (L = 4) on both archs and weight paths, and at T = 4,
    without spills or local memory within the register budget; the replay builds compile
    MAMBA_REPLAY in place of MAMBA_CORE."""
    builds = variant_builds(kernel_build, "nemotron-h-tiny", replay_window=WINDOW)
    builds.update({(arch, 2, 4): kernel_build(preset("nemotron-h-tiny"), arch, 2, 4,
                                              replay_window=WINDOW) for arch in ARCHS})
    for s in specs_within_budgets(builds).values():
        assert s.replay_window == WINDOW and s.shape("mamba2").cap == WINDOW - 1 + s.tokens
        assert isa.Op.MAMBA_REPLAY in s.handled_ops and isa.Op.MAMBA_CORE not in s.handled_ops
