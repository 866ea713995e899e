"""CPU executor of FP8 programs vs the FP8 model's reference (docs/FP8.md): every family, both
scale granularities, ragged batches, T = 1 and a multi-token step, recurrent and ReplaySSM.

The truth is the reference with each quantized weight dequantized exactly (code * scale in fp32);
its bf16 mirror keeps those weights in fp32 and rounds activations where the kernel does. The
executor dequantizes its packed slabs (codes and reversed-row scales) the same way, so the bound
is the bf16 executor tests' one (tests/executor/helpers.py); measured: bit-identical logits.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.executor import Executor
from megakernel.models import fp8, preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from megakernel.program.pack import pack_weights
from megakernel.reference.model import ReferenceModel
from tests.executor.helpers import check_logits
from tests.registries import model

LOGIT_TOL = 0.05
STATE_TOL = 1e-5
STEPS = 3
CASES = [("llama-tiny", None), ("smollm-shaped", None), ("qwen3.5-tiny", None),
         ("qwen3.5-tiny", 3), ("nemotron-h-tiny", 2), ("kimi-linear-tiny", None)]

_W: dict[tuple[str, str], dict[str, torch.Tensor]] = {}


def fp8_model(name: str, granularity: str, seed: int = 3):
    """(config, FP8 weight mapping) of a preset quantized on load."""
    cfg = model(name).replace(quant=fp8.Fp8Format(granularity))
    if (name, granularity) not in _W:
        q = fp8.QuantizedWeights(cfg, random_weights(model(name), seed=seed))
        _W[(name, granularity)] = {n: q[n] for n in q}
    return cfg, _W[(name, granularity)]


@pytest.mark.parametrize("name,window", CASES)
@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.parametrize("batch,tokens", [(3, 1), (2, 3)])
def test_fp8_executor_matches_the_fp8_reference(name, window, granularity, batch, tokens):
    cfg, w = fp8_model(name, granularity)
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 8, (batch,), generator=g).tolist()  # ragged prompts
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    s_max = max(lens) + STEPS * tokens
    ref16 = ReferenceModel(cfg, w, mode="bf16", replay_window=window)
    ref32 = ReferenceModel(cfg, w, mode="fp32", replay_window=window)
    c16 = ref16.new_cache(batch, s_max, max_step_tokens=tokens)
    c32 = ref32.new_cache(batch, s_max, max_step_tokens=tokens)
    ref16.prefill(c16, prompts)
    ref32.prefill(c32, prompts)
    prog = compile_program(cfg, batch, gpu("h100").with_sms(8), tokens=tokens, max_seq_len=s_max,
                           replay_window=window)
    ex = Executor(prog, pack_weights(cfg, w))
    ex.load_cache(c16)
    for step in range(STEPS):
        tok = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=g)
        l16, l32 = ref16.decode(c16, tok), ref32.decode(c32, tok)
        ex.step(tok, seed=step)
        mine = ex.logits.view(batch, tokens, -1)
        check_logits(step, mine, l16, l32, LOGIT_TOL)
        assert torch.equal(mine.argmax(-1), l16.argmax(-1)), f"step {step}: greedy tokens differ"
        assert ex.lengths.tolist() == c16.lengths.tolist()
        for layer in ex.prog.buffers.state:  # committed state, conv window (and ring)
            lc = c16.layers[layer]
            err = (ex.recurrent_state(layer) - lc.state).abs().max().item()
            assert err <= STATE_TOL, f"step {step} layer {layer}: state differs by {err:.3g}"
            assert torch.equal(ex.state_region(layer, "conv"), lc.conv), f"step {step} conv"


def test_fp8_is_not_the_bf16_model():
    """The FP8 program computes the quantized model: its logits differ from the bf16 model's by
    about what quantization moves them, and a slab read as bf16 would be garbage."""
    cfg, w = fp8_model("llama-tiny", "channel")
    base = random_weights(preset("llama-tiny"), seed=3)
    prompts = [[3, 1, 4, 1, 5]]
    l8 = ReferenceModel(cfg, w, mode="fp32")
    lb = ReferenceModel(preset("llama-tiny"), base, mode="fp32")
    a = l8.prefill(l8.new_cache(1, 8), prompts)
    b = lb.prefill(lb.new_cache(1, 8), prompts)
    diff = (a - b).abs().max().item()
    assert 1e-3 < diff < 0.5 * b.abs().max().item(), diff


def test_executor_counts_fp8_bytes():
    """A step streams one byte per weight plus the scales: the executor's count equals the
    program's (cost model) bytes, about half the bf16 program's blocks."""
    cfg, w = fp8_model("llama-tiny", "channel")
    prog = compile_program(cfg, 1, gpu("h100").with_sms(8), max_seq_len=16)
    ex = Executor(prog, pack_weights(cfg, w))
    ex.step(torch.tensor([[5]]))
    want = sum(i.w_bytes for i in prog.instrs if i.op in _matvec_ops())
    assert ex.slab_bytes["weights"] == want
    bf = compile_program(preset("llama-tiny"), 1, gpu("h100").with_sms(8), max_seq_len=16)
    head = 2 * cfg.vocab_size * cfg.hidden_size  # bf16 in both (padded rows aside)
    blocks8 = want - sum(i.w_bytes for i in prog.instrs if _name(i.op) == "LMHEAD")
    blocks16 = sum(i.w_bytes for i in bf.instrs if i.op in _matvec_ops()) - sum(
        i.w_bytes for i in bf.instrs if _name(i.op) == "LMHEAD")
    assert 0.5 < blocks8 / blocks16 < 0.52, (blocks8, blocks16)
    assert head > 0


def _name(op: int) -> str:
    from megakernel import isa

    return isa.spec(op).name


def _matvec_ops() -> set[int]:
    from megakernel import isa

    return {s.code for s in isa.specs() if s.matvec is not None}
