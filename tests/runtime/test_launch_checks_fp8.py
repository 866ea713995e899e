"""The launcher's weight-format check (launch.checks.check_weight_format, docs/FP8.md "Kernel"):
with the program's packed layout, every matvec record's W must point into a matrix of the format
the build reads for its opcode, so a bf16 program refuses to launch on an FP8 build and an FP8
program on a bf16 build (or on an FP8 build of the other granularity, or of the other LM-head
format), each with a named error, before any CUDA call."""

from __future__ import annotations

import functools

import pytest

from megakernel.kernel.config.model_spec import make_spec
from megakernel.launch.checks import ArgumentError, check_header, check_records
from megakernel.models import preset
from megakernel.models.fp8 import Fp8Format
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu


@functools.cache
def _case(name: str, quant: Fp8Format | None):  # noqa: ANN202
    """(program, build spec) of `name` in weight format `quant` (None: bf16), batch 1."""
    cfg = preset(name).replace(quant=quant)
    return compile_program(cfg, 1, gpu("h200")), make_spec(cfg, 1, 1, "sm_90a")


def _check(prog, spec) -> None:  # noqa: ANN001
    check_records(prog.records(), spec, prog.layout)


BF16, CHANNEL, BLOCK = None, Fp8Format("channel"), Fp8Format("block")


@pytest.mark.parametrize("quant", [BF16, CHANNEL, BLOCK])
def test_a_program_launches_on_the_build_of_its_weight_format(quant):
    _check(*_case("llama-tiny", quant))


def test_a_bf16_program_refuses_an_fp8_build_and_the_other_way_round():
    bf_prog, bf_spec = _case("llama-tiny", BF16)
    fp_prog, fp_spec = _case("llama-tiny", CHANNEL)
    with pytest.raises(ArgumentError, match=r"points into a bf16 matrix .* an FP8 \(channel "
                                            r"scales\) build reads fp8 slabs for QKV"):
        _check(bf_prog, fp_spec)
    with pytest.raises(ArgumentError, match=r"points into a fp8 matrix .* a bf16-weight build "
                                            r"reads bf16 slabs .* another format"):
        _check(fp_prog, bf_spec)
    # without the layout the records alone cannot tell (the shapes are the model's)
    check_records(bf_prog.records(), fp_spec)


def test_an_fp8_program_refuses_the_other_granularity():
    ch_prog, ch_spec = _case("llama-tiny", CHANNEL)
    bl_prog, bl_spec = _case("llama-tiny", BLOCK)
    with pytest.raises(ArgumentError, match=r"2 scales per row of 128 inputs; the build reads 1 "
                                            r"of 256 \(channel"):
        _check(bl_prog, ch_spec)
    with pytest.raises(ArgumentError, match=r"1 scales per row of 256 inputs; the build reads 2 "
                                            r"of 128 \(block"):
        _check(ch_prog, bl_spec)


def test_the_lm_head_format_must_match():
    """qwen3.5-tiny has an untied head: quantized only with Fp8Format.lm_head."""
    head_prog, head_spec = _case("qwen3.5-tiny", Fp8Format(lm_head=True))
    plain_prog, plain_spec = _case("qwen3.5-tiny", CHANNEL)
    _check(head_prog, head_spec)
    _check(plain_prog, plain_spec)
    with pytest.raises(ArgumentError, match=r"\(LMHEAD\).* bf16 matrix .* fp8 slabs for LMHEAD"):
        _check(plain_prog, head_spec)
    with pytest.raises(ArgumentError, match=r"\(LMHEAD\).* fp8 matrix .* bf16 slabs for LMHEAD"):
        _check(head_prog, plain_spec)


def test_moe_expert_stride_is_the_formats():
    fp_prog, fp_spec = _case("kimi-linear-tiny", BLOCK)
    bf_prog, bf_spec = _case("kimi-linear-tiny", BF16)
    check_header(fp_prog.header, fp_spec)
    _check(fp_prog, fp_spec)
    with pytest.raises(ArgumentError, match="MOE_X_STRIDE"):
        check_header(fp_prog.header, bf_spec)
    with pytest.raises(ArgumentError, match="MOE_X_STRIDE"):
        check_header(bf_prog.header, fp_spec)
