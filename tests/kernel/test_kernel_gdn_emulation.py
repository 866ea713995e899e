"""A numpy emulation of the GDN_CORE device handler (kernel/device/gdn.py), run with the kernel's
own index helpers (kernel/host/gdn_index.py), against the CPU executor's step.

The emulation walks the handler's phases with its thread mapping (a thread per conv channel, a
warp per (token, q/k) norm and per (token, value head) output, lanes = state columns in tiles of
CW, warps = row blocks of RPW, the two partial buffers) over flat fp32 arrays laid out as the
state arena, proj, ssm_out and the shared scratch span, in float32 as the device code computes.
The executor runs the same program step; its proj (the last GDN layer's), the state block of that
layer before the step, and its outputs after it are the ground truth: new conv window and states
within fp32 rounding, ssm_out within one bf16 ulp. Shapes: qwen3.5-tiny (R = 2, dv = 8 < 32: idle
lanes) at B = 2, T = 1 and 4, and two other head shapes (SHAPES: two column tiles; three value
heads per key head and a 3-tap conv).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megakernel import isa
from megakernel.executor import Executor, executor_gpu
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host.gdn_index import GDNShape, check_gdn
from megakernel.layers.gdn import GDNConfig
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
    silu,
    softplus,
)


def emulate_inputs(g: GDNShape, d: dict, W: np.ndarray, F32: np.ndarray, S: np.ndarray
                   ) -> np.ndarray:
    """Phases 1-2 of both handlers (conv, l2 norms, gates): the scratch span they leave."""
    b, kh, proj, prm, sm = d["B_IDX"], d["K_HEAD"], d["PROJ_OFF"], d["PARAM_OFF"], g.smem()
    sS = emulate_conv_norms(g, d, kh, W, F32, S)
    for idx in range(g.tokens * g.rep):
        t = idx // g.rep
        h = kh * g.rep + idx - t * g.rep
        bb = F32[proj + g.proj(b, t, g.beta_col(h))]
        aa = F(F32[proj + g.proj(b, t, g.a_col(h))] + F32[prm + g.hv + h])
        sS[sm["beta"] + idx] = sigmoid(bb)
        sS[sm["g"] + idx] = F(-np.exp(F32[prm + h], dtype=F) * softplus(aa))
    return sS


def emulate_output(g: GDNShape, d: dict, W: np.ndarray, F32: np.ndarray, sS: np.ndarray,
                   out: np.ndarray, eps: float) -> None:
    """Phase 4 of both handlers, gated by silu(z)."""
    b, proj = d["B_IDX"], d["PROJ_OFF"]
    emulate_norm_out(g, d, d["K_HEAD"], W, sS, out, eps,
                     lambda t, h, j: silu(F32[proj + g.proj(b, t, g.z_col(h, j))]))


def emulate_core(g: GDNShape, d: dict, W: np.ndarray, F32: np.ndarray, S: np.ndarray,
                 out: np.ndarray, eps: float) -> None:
    """One GDN_CORE record, as kernel/device/gdn.py runs it: W bf16 weights (as fp32), F32 the fp32
    arena, S the state arena (updated), out the bf16 arena as fp32 (written)."""
    sS = emulate_inputs(g, d, W, F32, S)
    emulate_states(g, d, d["K_HEAD"], S, sS)
    emulate_output(g, d, W, F32, sS, out, eps)


def emulate_replay(g: GDNShape, d: dict, W: np.ndarray, F32: np.ndarray, I32: np.ndarray,
                   S: np.ndarray, out: np.ndarray, eps: float) -> None:
    """One GDN_REPLAY record, as kernel/device/gdn.py runs it (steps r1-r3 of gdn_index.py); I32 the
    int32 arena (the ring count, updated), the rest as emulate_core."""
    sS = emulate_inputs(g, d, W, F32, S)
    emulate_replay_states(g, d, d["K_HEAD"], I32, S, sS)
    emulate_output(g, d, W, F32, sS, out, eps)


SHAPES = {  # qwen3.5-tiny with other GDN heads
    # dv = 64 > 32: two column tiles, every lane live
    "wide": GDNConfig(2, 2, 64, 64, 4),
    # R = 3 value heads per key head, R dv = 24 != dk: the v channels' stride is their own
    "odd": GDNConfig(2, 6, 16, 8, 3),
}


def model_config(model: str):  # noqa: ANN201 (ModelConfig)
    if model in SHAPES:
        return dataclasses.replace(preset("qwen3.5-tiny"), gdn=SHAPES[model],
                                   name=f"qwen3.5-gdn-{model}")
    return preset(model)


@pytest.mark.parametrize("model,batch,tokens", [("qwen3.5-tiny", 2, 1), ("qwen3.5-tiny", 2, 4),
                                                ("wide", 1, 2), ("odd", 2, 3)])
def test_gdn_core_emulation_matches_the_executor(model, batch, tokens):
    cfg = model_config(model)
    spec = make_spec(cfg, batch, tokens, "sm_90a")
    g = spec.shape("gdn")
    assert check_gdn(g) == "" and g.num_warps == NW
    w = random_weights(cfg, seed=5)
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=tokens, max_seq_len=32)
    ex = Executor(prog, pack_weights(cfg, w), check=True)
    gen = torch.Generator().manual_seed(11)
    for _ in range(2):  # states and windows away from zero first
        ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
    layer = max(b.layer for b in cfg.blocks if b.kind == "gdn")
    before = ex.state.clone()
    ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
    recs = last_records(prog, layer, isa.Op.GDN_CORE)
    assert len(recs) == batch * g.hk
    S = before.numpy().astype(F).copy()
    F32 = ex.f32.numpy().astype(F)  # proj of this step (the last GDN layer's)
    W = ex.weights.float().numpy()
    out = np.full(ex.bf16.numel(), np.nan, dtype=F)
    for d in recs:
        emulate_core(g, d, W, F32, S, out, cfg.rms_norm_eps)
    blk = prog.buffers.state[layer]
    lo = blk["conv"].offset
    hi = blk["state"].offset + blk["state"].numel
    mine, theirs = S[lo:hi], ex.state.numpy()[lo:hi]
    assert np.abs(theirs).max() > 0.05 and not np.array_equal(mine, before.numpy()[lo:hi])
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())
    assert_bf16_close(out, ex, prog.buffers.bf16["ssm_out"])


@pytest.mark.parametrize("model,batch,tokens", [("qwen3.5-tiny", 2, 1), ("qwen3.5-tiny", 2, 4),
                                                ("qwen3.5-tiny", 2, 3), ("wide", 1, 2)])
def test_gdn_replay_emulation_matches_the_executor(model, batch, tokens):
    """GDN_REPLAY with L = 4 over steps that fill the ring, fold and restart it (T = 3: a step
    with committed entries and several new ones); every step's state block (window, committed
    state, ring), ring counts and ssm_out against the executor's."""
    window = 4
    cfg = model_config(model)
    spec = make_spec(cfg, batch, tokens, "sm_90a", replay_window=window)
    g = spec.shape("gdn")
    assert check_gdn(g) == "" and g.replay_window == window
    assert isa.Op.GDN_REPLAY in spec.handled_ops
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=tokens, max_seq_len=64,
                           replay_window=window)
    assert g.cap == prog.buffers.ring_cap == prog.header["RING_CAP"]
    ex = Executor(prog, pack_weights(cfg, random_weights(cfg, seed=5)), check=True)
    gen = torch.Generator().manual_seed(11)
    layer = max(b.layer for b in cfg.blocks if b.kind == "gdn")
    blk = prog.buffers.state[layer]
    lo, hi = blk["conv"].offset, blk["g"].offset + blk["g"].numel
    seen = set()
    for step in range(-(-2 * window // tokens) + 1):
        before, counts = ex.state.numpy().astype(F).copy(), ex.i32.numpy().copy()
        ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
        recs = last_records(prog, layer, isa.Op.GDN_REPLAY)
        assert len(recs) == batch * g.hk
        S, I32 = before.copy(), counts.copy()
        out = np.full(ex.bf16.numel(), np.nan, dtype=F)
        for d in recs:
            seen.add(int(I32[d["COUNT_OFF"] + g.count(d["B_IDX"], d["K_HEAD"])]))
            emulate_replay(g, d, ex.weights.float().numpy(), ex.f32.numpy().astype(F), I32, S,
                           out, cfg.rms_norm_eps)
        mine, theirs = S[lo:hi], ex.state.numpy()[lo:hi]
        assert not np.array_equal(mine, before[lo:hi])
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max(),
                                   err_msg=f"step {step}")
        c0 = recs[0]["COUNT_OFF"]
        np.testing.assert_array_equal(I32[c0 : c0 + batch * g.hk],
                                      ex.i32.numpy()[c0 : c0 + batch * g.hk])
        assert_bf16_close(out, ex, prog.buffers.bf16["ssm_out"])
    # the ring restarted (count 0 after a fold) and, but for T = L, held committed entries
    assert 0 in seen and (tokens == window or max(seen) > 0), seen


def test_gdn_shapes_the_handler_refuses():
    """check_gdn names a shape the thread mapping cannot run; make_spec refuses it."""
    assert "multiple of the 8 warps" in check_gdn(GDNShape(2, 2, 20, 8, 4, 1, 1, 8))
    assert "value head dim 48" in check_gdn(GDNShape(2, 2, 16, 48, 4, 1, 1, 8))
    assert "tokens" in check_gdn(GDNShape(2, 2, 16, 8, 4, 1, 8, 8))
    cfg = dataclasses.replace(preset("qwen3.5-tiny"), gdn=GDNConfig(2, 4, 20, 8, 4))
    from megakernel.common.errors import SpecError

    with pytest.raises(SpecError, match="key head dim 20"):
        make_spec(cfg, 1, 1, "sm_90a")
