"""torch.ops.megakernel.speculative_step on a CPU machine: drafts in, greedy tokens [B, 1 + k] and
accepted counts [B] out (the op's CPU executor), its argument checks before any step, its fake
under FakeTensorMode, and a build without the speculative step refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megakernel.launch.device_state as device_state
import megakernel.launch.torch_op as op
from megakernel.executor import executor_gpu
from megakernel.launch.checks import ArgumentError
from megakernel.launch.runtime import Manifest
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from tests.runtime.test_runtime import manifest_dict, tensors

K = 2


@pytest.fixture(scope="module")
def model():
    cfg = preset("llama-tiny")
    return cfg, random_weights(cfg, seed=3, dtype=torch.bfloat16)


def spec_state(model, ngram: int = 0):  # noqa: ANN001, ANN201
    cfg, w = model
    prog = compile_program(cfg, 2, executor_gpu(4), max_seq_len=16, drafts=K, ngram=ngram,
                           policy="structure")
    st = device_state.allocate_state(cfg, w, prog, "cpu")
    return prog, st, op.register_program(prog, st.packed)


def call(st, kid, drafts=None, offsets=None):  # noqa: ANN001, ANN201
    return torch.ops.megakernel.speculative_step(*st.tensors().values(), kid,
                                                 offsets or st.spec_offsets, drafts)


def test_drafts_in_tokens_and_accepted_out(model):
    """Step 1 feeds the last token and drafts; with the drafts equal to the greedy tokens every
    draft is accepted (accepted = k), with wrong ones none; the emitted tokens are the greedy
    ones, as the reference's verify step says."""
    from megakernel.reference.model import ReferenceModel, greedy

    cfg, w = model
    prog, st, kid = spec_state(model)
    assert st.spec_offsets[:4] == st.offsets and len(st.spec_offsets) == 6
    first = torch.tensor([5, 7])
    st.region("i32", "tokens_in").view(2, 1 + K)[:, 0] = first.to(torch.int32)
    tokens, acc = call(st, kid, torch.zeros(2, K, dtype=torch.int64))  # probe: greedy rows
    assert tokens.shape == (2, 1 + K) and tokens.dtype == torch.int32 and acc.shape == (2,)
    ref = ReferenceModel(cfg, w, mode="bf16")
    cache = ref.new_cache(2, 16, max_step_tokens=1 + K)
    g = greedy(ref._forward(cache, torch.cat((first[:, None], torch.zeros(2, K,
               dtype=torch.int64)), 1), replay=False, prefill=False))
    assert tokens.tolist() == g.tolist()
    want = [int((torch.tensor(0) == g[b, :K]).long().cumprod(0).sum()) for b in range(2)]
    assert acc.tolist() == want
    assert st.region("i32", "lengths").tolist() == [a + 1 for a in want]


def test_oracle_drafts_are_all_accepted(model):
    """Drafts equal to what plain greedy decoding produces are every one accepted: the op
    writes the drafts it is given where ACCEPT reads them."""
    from megakernel.serve.executor_backend import generate

    cfg, w = model
    plain = generate(cfg, w, [[5], [7]], 1 + 2 * (K + 1))  # after the prompt token
    _, st, kid = spec_state(model)
    st.region("i32", "tokens_in").view(2, 1 + K)[:, 0] = torch.tensor([5, 7], dtype=torch.int32)
    seq = [[5] + p for p in plain]
    tok, acc = call(st, kid, torch.tensor([s[1: 1 + K] for s in seq]))
    assert acc.tolist() == [K, K]
    assert tok.tolist() == [s[1: 2 + K] for s in seq]
    tok, acc = call(st, kid, torch.tensor([s[2 + K: 2 + 2 * K] for s in seq], dtype=torch.int32))
    assert acc.tolist() == [K, K] and tok.tolist() == [s[2 + K: 3 + 2 * K] for s in seq]


def test_device_drafter_needs_no_drafts(model):
    _, st, kid = spec_state(model, ngram=3)
    st.region("i32", "tokens_in").view(2, 1 + K)[:, 0] = torch.tensor([5, 7], dtype=torch.int32)
    tok, acc = call(st, kid, None)
    assert tok.shape == (2, 1 + K) and all(0 <= a <= K for a in acc.tolist())


@pytest.mark.parametrize("drafts,needle", [
    (torch.zeros(2, K + 1, dtype=torch.int64), r"drafts must be \[2, 2\]"),
    (torch.zeros(2, K), "drafts must be torch.int32 or torch.int64"),
    (torch.zeros(1, K, dtype=torch.int64), r"drafts must be \[2, 2\]"),
    (None, "has no device drafter"),
])
def test_bad_drafts_are_refused(model, drafts, needle):
    _, st, kid = spec_state(model)
    with pytest.raises(ArgumentError, match=needle):
        call(st, kid, drafts)


def test_bad_offsets_and_plain_programs_are_refused(model):
    cfg, w = model
    _, st, kid = spec_state(model)
    with pytest.raises(ArgumentError, match="offsets must be .*tokens_in_off, emitted_off"):
        call(st, kid, torch.zeros(2, K, dtype=torch.int64), offsets=st.offsets)
    bad = [*st.offsets, st.i32.numel(), 0]
    with pytest.raises(ArgumentError, match="tokens_in_off .* outside the i32 arena"):
        call(st, kid, torch.zeros(2, K, dtype=torch.int64), offsets=bad)
    plain = compile_program(cfg, 2, executor_gpu(4), max_seq_len=16, policy="structure")
    pst = device_state.allocate_state(cfg, w, plain, "cpu")
    assert pst.spec_offsets is None
    pkid = op.register_program(plain, pst.packed)
    with pytest.raises(ArgumentError, match="is a plain program"):
        torch.ops.megakernel.speculative_step(*pst.tensors().values(), pkid,
                                              [*pst.offsets, 0, 0], None)


def test_a_build_without_the_speculative_step_is_refused():
    kid = op.register_build(Manifest(Path("/nonexistent"), manifest_dict(batch=2, tokens=3)))
    ts = tensors(manifest_dict(batch=2, tokens=3)["spec"])
    with pytest.raises(ArgumentError, match="no speculative step"):
        torch.ops.megakernel.speculative_step(*ts.values(), kid, [128, 64, 0, 32, 0, 8],
                                              torch.zeros(2, 2, dtype=torch.int64))


def test_fake_describes_outputs(model):
    _, st, kid = spec_state(model)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {n: mode.from_tensor(t) for n, t in st.tensors().items()}
        tok, acc = torch.ops.megakernel.speculative_step(
            *fake.values(), kid, st.spec_offsets, mode.from_tensor(torch.zeros(2, K).long()))
        assert tok.shape == (2, 1 + K) and tok.dtype == torch.int32
        assert acc.shape == (2,) and acc.dtype == torch.int32


def test_the_plain_op_keeps_its_signature(model):
    """decode_step is unchanged: four offsets, tokens [N] and logits."""
    cfg, w = model
    prog = compile_program(cfg, 2, executor_gpu(4), max_seq_len=16, policy="structure")
    st = device_state.allocate_state(cfg, w, prog, "cpu")
    kid = op.register_program(prog, st.packed)
    tok, logits = torch.ops.megakernel.decode_step(*st.tensors().values(), kid, st.offsets, True)
    assert tok.shape == (2,) and logits.shape == (2, cfg.vocab_size)
