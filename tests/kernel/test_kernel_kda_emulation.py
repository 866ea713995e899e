"""A numpy emulation of the KDA_CORE / KDA_REPLAY device handler (kernel/device/kda.py on gdn.py's
loops), run with the kernel's own index helpers (kernel/host/kda_index.py), against the CPU
executor's step.

The shared delta-rule walk (tests/kernel/helpers.py, `channel=True`: KDA's per-channel decay) plus
KDA's own gates (the low-rank decay and gate of the head's f_b / g_b rows) and output gate
sigmoid(gate), over flat fp32 arrays laid out as the state arena, proj, ssm_out and the scratch
span. The executor's proj of the last KDA layer, that layer's state block before the step and its
outputs after it are the truth: windows, states, rings within fp32 rounding, ring counts exactly,
ssm_out within one bf16 ulp. Shapes: kimi-linear-tiny (d = 16 < 32: idle lanes) and a head_dim 64
variant (two column tiles).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megakernel import isa
from megakernel.common.errors import SpecError
from megakernel.executor import Executor, executor_gpu
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host.kda_index import KDAShape, check_kda
from megakernel.layers.kda import KDAConfig
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights
from tests.kernel.helpers import (
    NW,
    F,
    assert_bf16_close,
    emulate_conv_norms,
    emulate_norm_out,
    emulate_replay_states,
    emulate_states,
    last_records,
    sigmoid,
    softplus,
)

KIMI = "kimi-linear-tiny"
SHAPES = {"wide": KDAConfig(2, 64, 4)}  # d = 64: two column tiles, every lane live


def emulate_inputs(g: KDAShape, d: dict, W: np.ndarray, F32: np.ndarray, S: np.ndarray
                   ) -> np.ndarray:
    """Conv, l2 norms and KDA's gates (kernel/device/kda.py `gates`): the scratch span they
    leave."""
    b, h, proj, prm, sm = d["B_IDX"], d["HEAD"], d["PROJ_OFF"], d["PARAM_OFF"], g.smem()
    sS = emulate_conv_norms(g, d, h, W, F32, S)
    for t in range(g.tokens):
        sS[sm["beta"] + t] = sigmoid(F32[proj + g.proj(b, t, g.beta_col(h))])
        for which in range(2):
            for i in range(g.d):
                x = F32[proj + g.proj(b, t, g.low_rank_col(which, i))]
                sS[sm["lr"] + g.low_rank(t, which, i)] = torch.tensor(x).bfloat16().float()
    for which in range(2):  # a warp per (channel, f or g), lanes over the inputs
        for i in range(g.d):
            row = W[d["CONV_W"] + g.low_rank_w(which, h, i, 0) :][: g.d]
            for t in range(g.tokens):
                lr = sS[sm["lr"] + g.low_rank(t, which, 0) :][: g.d]
                s = (row * lr).sum(dtype=F)
                if which == 0:
                    sp = softplus(F(s + F32[prm + g.dt_bias(h, i)]))
                    sS[sm["g"] + g.decay(t, i)] = F(-np.exp(F32[prm + h], dtype=F) * sp)
                else:
                    sS[sm["gate"] + g.decay(t, i)] = s
    return sS


def emulate_record(g: KDAShape, d: dict, W: np.ndarray, F32: np.ndarray, I32: np.ndarray,
                   S: np.ndarray, out: np.ndarray, eps: float) -> None:
    """One KDA_CORE (g.cap == 0) or KDA_REPLAY record, as the device runs it."""
    sS = emulate_inputs(g, d, W, F32, S)
    if g.cap:
        emulate_replay_states(g, d, d["HEAD"], I32, S, sS, channel=True)
    else:
        emulate_states(g, d, d["HEAD"], S, sS, channel=True)
    gate = g.smem()["gate"]
    emulate_norm_out(g, d, d["HEAD"], W, sS, out, eps,
                     lambda t, h, j: sigmoid(sS[gate + g.decay(t, j)]))


def model_config(model: str):  # noqa: ANN201 (ModelConfig)
    if model in SHAPES:
        return dataclasses.replace(preset(KIMI), kda=SHAPES[model], name=f"kimi-kda-{model}")
    return preset(model)


def run_steps(model: str, batch: int, tokens: int, window: int, steps: int) -> set[int]:
    """`steps` executor steps (after two warm-up ones when recurrent), each emulated record by
    record from the state block before it and compared; returns the ring counts seen."""
    cfg = model_config(model)
    spec = make_spec(cfg, batch, tokens, "sm_90a", replay_window=window)
    g = spec.shape("kda")
    assert check_kda(g) == "" and g.num_warps == NW and g.cap == spec.ring_cap
    op = isa.Op.KDA_REPLAY if window else isa.Op.KDA_CORE
    assert op in spec.handled_ops
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=tokens, max_seq_len=64,
                           replay_window=window or None)
    ex = Executor(prog, pack_weights(cfg, random_weights(cfg, seed=5)), check=True)
    gen = torch.Generator().manual_seed(11)
    if not window:
        for _ in range(2):  # states and windows away from zero first
            ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
    layer = max(b.layer for b in cfg.blocks if b.kind == "kda")
    blk = prog.buffers.state[layer]
    last = "g" if window else "state"
    lo, hi = blk["conv"].offset, blk[last].offset + blk[last].numel
    seen = set()
    for step in range(steps):
        before, counts = ex.state.numpy().astype(F).copy(), ex.i32.numpy().copy()
        ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
        recs = last_records(prog, layer, op)
        assert len(recs) == batch * g.hk
        S, I32 = before.copy(), counts.copy()
        out = np.full(ex.bf16.numel(), np.nan, dtype=F)
        for d in recs:
            if window:
                seen.add(int(I32[d["COUNT_OFF"] + g.count(d["B_IDX"], d["HEAD"])]))
            emulate_record(g, d, ex.weights.float().numpy(), ex.f32.numpy().astype(F), I32, S,
                           out, cfg.rms_norm_eps)
        mine, theirs = S[lo:hi], ex.state.numpy()[lo:hi]
        assert np.abs(theirs).max() > 0.05 and not np.array_equal(mine, before[lo:hi])
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max(),
                                   err_msg=f"step {step}")
        if window:
            c0 = recs[0]["COUNT_OFF"]
            np.testing.assert_array_equal(I32[c0 : c0 + batch * g.hk],
                                          ex.i32.numpy()[c0 : c0 + batch * g.hk])
        assert_bf16_close(out, ex, prog.buffers.bf16["ssm_out"])
    return seen


@pytest.mark.parametrize("model,batch,tokens", [(KIMI, 2, 1), (KIMI, 2, 3), (KIMI, 1, 4),
                                                ("wide", 1, 2)])
def test_kda_core_emulation_matches_the_executor(model, batch, tokens):
    run_steps(model, batch, tokens, 0, 1)


WINDOW = 4


@pytest.mark.parametrize("model,batch,tokens", [(KIMI, 2, 1), (KIMI, 2, 3), (KIMI, 1, 4),
                                                ("wide", 1, 3)])
def test_kda_replay_emulation_matches_the_executor(model, batch, tokens):
    """KDA_REPLAY with L = 4 over steps that fill the ring, fold and restart it (T = 3: a step
    with committed entries and several new ones)."""
    seen = run_steps(model, batch, tokens, WINDOW, -(-2 * WINDOW // tokens) + 1)
    assert 0 in seen and (tokens == WINDOW or max(seen) > 0), seen


def test_kda_shapes_the_handler_refuses():
    """check_kda names a shape the thread mapping cannot run; make_spec refuses it."""
    assert "multiple of 32" in check_kda(KDAShape.of((2, 48, 4), 1, 1, 8))
    assert "multiple of the 8 warps" in check_kda(KDAShape.of((2, 20, 4), 1, 1, 8))
    assert "tokens" in check_kda(KDAShape.of((2, 16, 4), 1, 8, 8))
    cfg = dataclasses.replace(preset(KIMI), kda=KDAConfig(2, 48, 4))
    with pytest.raises(SpecError, match="KDA head_dim 48"):
        make_spec(cfg, 1, 1, "sm_90a")
