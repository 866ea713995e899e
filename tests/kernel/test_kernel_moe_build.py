"""The MoE handlers' place in a build: a Kimi spec handles the router and expert opcodes, the
expert slabs on their own epilogue; launch.checks.check_header holds a program's MOE_* words against
the build (the builds themselves: test_kernel_kimi.py)."""

from __future__ import annotations

import dataclasses

import pytest

from megakernel import isa
from megakernel.kernel.config import model_spec
from megakernel.kernel.config.fields import OpTable
from megakernel.models import preset
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu

NAME = "kimi-linear-tiny"
MOE_OPS = {isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN, isa.Op.MOE_COMBINE}


def test_kimi_spec_handles_the_moe_opcodes():
    s = model_spec.make_spec(preset(NAME), 4, 1, "sm_90a")
    assert MOE_OPS | {isa.Op.ROUTER_SCORE, isa.Op.ROUTER} <= set(s.ops)
    t = OpTable.for_spec(s)
    assert t.epilogue("moe.ExpertGateUp") == (isa.Op.EXPERT_GATEUP,)
    assert t.epilogue("moe.ExpertDown") == (isa.Op.EXPERT_DOWN,)
    assert {isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN} <= set(t.slab)


def test_check_header_holds_the_moe_words():
    from megakernel.launch.checks import ArgumentError, check_header

    cfg = preset(NAME)
    spec = model_spec.make_spec(cfg, 2, 1, "sm_90a").to_dict()
    header = compile_program(cfg, 2, gpu("h100").with_sms(8)).header
    check_header(header, spec)
    for word in ("MOE_E", "MOE_TOPK", "MOE_I", "MOE_SHARED", "MOE_X_STRIDE"):
        with pytest.raises(ArgumentError, match=word):
            check_header({**header, word: header[word] + 1}, spec)
    moe = next(b.cfg for b in cfg.blocks if b.kind == "moe")
    other = cfg.replace(moe=dataclasses.replace(moe, intermediate_size=2 * moe.intermediate_size))
    with pytest.raises(ArgumentError, match="MOE_I"):
        check_header(compile_program(other, 2, gpu("h100").with_sms(8)).header, spec)
