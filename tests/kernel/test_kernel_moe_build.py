"""The MoE handlers in the compiled kernel: Kimi builds (make_spec(..., unhandled="trap"), the
opcodes without a handler yet trap) with EXPERT_GATEUP / EXPERT_DOWN / MOE_COMBINE compiled in,
within the build rules (build.build_spec: no spills, no local memory, registers <= budget) for
both archs; and runtime.check_header holding a program's MOE_* words against the build."""

from __future__ import annotations

import dataclasses

import pytest

from megakernel import isa
from megakernel.kernel import spec as spec_mod
from megakernel.kernel.fields import OpTable
from megakernel.models import preset
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu

NAME = "kimi-linear-tiny"
MOE_OPS = {isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN, isa.Op.MOE_COMBINE}
# (batch, tokens, smem_stages): the default pipeline, the global-memory path, B = 4 piped, T = 4
BUILDS = [(1, 1, None), (4, 1, 0), (4, 1, None), (1, 4, None)]


def test_kimi_spec_handles_the_moe_opcodes():
    s = spec_mod.make_spec(preset(NAME), 4, 1, "sm_90a", unhandled="trap")
    assert MOE_OPS <= set(s.ops) and isa.Op.ROUTER not in s.ops
    t = OpTable.for_spec(s)
    assert t.epilogue("expert_gateup") == (isa.Op.EXPERT_GATEUP,)
    assert {isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN} <= set(t.slab)


@pytest.mark.parametrize("arch", spec_mod.ARCHS)
@pytest.mark.parametrize(("batch", "tokens", "stages"), BUILDS)
def test_kimi_tiny_builds_with_the_moe_handlers(arch, batch, tokens, stages, tmp_path):  # noqa: ANN001
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")
    from megakernel.kernel.build import build_spec

    cfg = preset(NAME)
    spec = spec_mod.make_spec(cfg, batch, tokens, arch, smem_stages=stages, unhandled="trap")
    assert spec.pipelined == (stages is None)
    res = build_spec(spec, cfg, tmp_path)["resources"]  # raises BuildError on a rule broken
    assert res["spill_stores"] == res["spill_loads"] == res["local_bytes"] == 0
    assert res["registers"] <= spec_mod.REGISTER_BUDGET


def test_check_header_holds_the_moe_words():
    from megakernel.runtime import ArgumentError, check_header

    cfg = preset(NAME)
    spec = spec_mod.make_spec(cfg, 2, 1, "sm_90a", unhandled="trap").to_dict()
    header = compile_program(cfg, 2, gpu("h100").with_sms(8)).header
    check_header(header, spec)
    for word in ("MOE_E", "MOE_TOPK", "MOE_I", "MOE_SHARED", "MOE_X_STRIDE"):
        with pytest.raises(ArgumentError, match=word):
            check_header({**header, word: header[word] + 1}, spec)
    moe = next(b.cfg for b in cfg.blocks if b.kind == "moe")
    other = cfg.replace(moe=dataclasses.replace(moe, intermediate_size=2 * moe.intermediate_size))
    with pytest.raises(ArgumentError, match="MOE_I"):
        check_header(compile_program(other, 2, gpu("h100").with_sms(8)).header, spec)
