"""torch.ops.megakernel.decode_step on a CPU machine: argument errors before any CUDA call, the
fake under torch.compile (meta and CPU tensors), and a clear error from the kernel backend when
there is no GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megakernel.launch.device_state as device_state
import megakernel.launch.torch_op as op
import megakernel.serve.kernel_backend as kernel_backend
from megakernel.launch.checks import ArgumentError
from megakernel.launch.runtime import KernelUnavailable, Manifest
from megakernel.models import preset
from tests.runtime.test_runtime import manifest_dict, tensors

REPO = Path(__file__).resolve().parents[2]
S_MAX = 32  # tests.runtime.test_runtime.tensors' cache length
OFFSETS = [128, 64, 0, S_MAX]  # lengths, tokens_out (i32); logits (f32); the program's S_MAX


@pytest.fixture(scope="module")
def kid() -> int:
    return op.register_build(Manifest(Path("/nonexistent"), manifest_dict(batch=2)))


def call(ts: dict, kid: int, logits: bool = True):
    return torch.ops.megakernel.decode_step(
        ts["program"], ts["counters"], ts["weights"], ts["f32"], ts["bf16"], ts["i32"],
        ts["k_cache"], ts["v_cache"], ts["state"], kid, OFFSETS, logits)


def spec() -> dict:
    return manifest_dict(batch=2)["spec"]


def test_op_rejects_cpu_tensors_with_a_clear_error(kid):
    with pytest.raises(ArgumentError, match="the kernel needs CUDA tensors"):
        call(tensors(spec()), kid)


@pytest.mark.parametrize("name,bad,match", [
    ("i32", lambda t: t.to(torch.int64), "i32 must be torch.int32"),
    ("weights", lambda t: t.float(), "weights must be torch.bfloat16"),
    ("k_cache", lambda t: t[:, :, :, :, ::2], r"k_cache must be \[L, B, Hkv, S_max, D\]"),
    ("k_cache", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "must be contiguous"),
])
def test_op_rejects_bad_arguments(kid, name, bad, match):
    ts = tensors(spec())
    ts[name] = bad(ts[name])
    with pytest.raises(ArgumentError, match=match):
        call(ts, kid)


def test_op_rejects_a_batch_larger_than_built(kid):
    big = tensors(manifest_dict(batch=4)["spec"])
    with pytest.raises(ArgumentError, match="built for batch 2"):
        call(big, kid)


def test_op_rejects_unknown_kernel_and_bad_offsets(kid):
    with pytest.raises(ArgumentError, match="unknown kernel id 987654"):
        call(tensors(spec()), 987654)
    ts = tensors(spec())
    with pytest.raises(ArgumentError, match="offsets must be"):
        torch.ops.megakernel.decode_step(ts["program"], ts["counters"], ts["weights"], ts["f32"],
                                         ts["bf16"], ts["i32"], ts["k_cache"], ts["v_cache"],
                                         ts["state"], kid, [1, 2], False)


def test_op_refuses_a_cache_of_another_length_than_the_program(kid):
    """The kernel finds the rope sin table at ROPE_OFF + S_max * D/2 with S_max from the cache:
    a cache longer or shorter than the program's S_MAX is refused on the host (CPU tensors, so
    no CUDA call has happened), naming both lengths."""
    for s_max in (S_MAX + 8, S_MAX - 1):
        ts = tensors(spec(), s_max=s_max)
        with pytest.raises(ArgumentError, match=rf"S_max = {s_max} positions but the program "
                                                rf"was compiled for max_seq_len {S_MAX}"):
            call(ts, kid)
    with pytest.raises(ArgumentError, match="the kernel needs CUDA tensors"):
        call(tensors(spec(), s_max=S_MAX), kid)  # the same length passes this check


def test_fake_describes_outputs(kid):
    with FakeTensorMode():
        ts = tensors(spec())
        tok, logits = call(ts, kid)
        assert tok.shape == (2,) and tok.dtype == torch.int32
        assert logits.shape == (2, preset("llama-tiny").vocab_size)
        tok, logits = call(ts, kid, logits=False)
        assert logits.shape == (0, preset("llama-tiny").vocab_size)


def test_op_traces_under_torch_compile_on_meta(kid):
    def step(ts):
        tok, logits = call(ts, kid)
        return tok.long() + 1, logits * 2

    torch._dynamo.reset()
    tok, logits = torch.compile(step, fullgraph=True, backend="aot_eager")(
        tensors(spec(), device="meta"))
    assert tok.device.type == "meta" and tok.shape == (2,) and tok.dtype == torch.int64
    assert logits.shape == (2, 512) and logits.dtype == torch.float32


def test_compiled_op_reaches_the_real_checks_on_cpu(kid):
    def step(ts):
        return call(ts, kid)[0] + 1

    torch._dynamo.reset()
    with pytest.raises(ArgumentError, match="the kernel needs CUDA tensors"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(tensors(spec()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_kernel_backend_without_gpu_is_a_clear_error():
    from megakernel.models.weights import random_weights

    cfg = preset("llama-tiny")
    with pytest.raises(KernelUnavailable, match="needs an sm_90a .* CUDA GPU"):
        kernel_backend.generate(cfg, random_weights(cfg), [[1, 2, 3]], steps=2)
    r = subprocess.run([sys.executable, "-m", "megakernel", "generate", "--backend", "kernel",
                        "--model", "llama-tiny", "--steps", "2"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: the kernel backend needs") and "Traceback" not in r.stderr


@pytest.mark.parametrize("model,batch,tokens", [("llama-tiny", 2, 1), ("qwen3-tiny", 3, 2),
                                                ("qwen2-tiny", 2, 1)])
def test_host_state_on_cpu_matches_the_build_and_the_executor(model, batch, tokens):
    """The buffers Megakernel hands the kernel pass the launch checks and match the executor:
    weights, records and every host-written constant region (RoPE tables, ...)."""
    from megakernel import isa
    from megakernel.executor import Executor, executor_gpu
    from megakernel.launch.checks import check_records, validate_args
    from megakernel.models.weights import random_weights
    from megakernel.program.compiler import compile_program
    from megakernel.program.pack import pack_weights

    cfg = preset(model)
    w = random_weights(cfg, seed=1)
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=tokens, max_seq_len=40)
    spec = manifest_dict(batch=batch, tokens=tokens, model=model)["spec"]
    st = device_state.allocate_state(cfg, w, prog, "cpu")
    check_records(st.program, spec)
    validate_args(spec, st.tensors(), lengths_off=st.offsets[0], max_seq_len=st.offsets[3],
                  require_cuda=False)
    assert st.offsets[3] == prog.max_seq_len == st.k_cache.shape[3]
    ex = Executor(prog, pack_weights(cfg, w), check=False)
    assert torch.equal(st.weights, ex.weights)
    assert torch.equal(st.program, ex.records)
    assert "rope" in prog.buffers.constants
    for name in prog.buffers.constants:
        assert torch.equal(st.region("f32", name), ex.region("f32", name).reshape(-1)), name
    assert st.offsets[0] == prog.buffers.i32["lengths"].offset
    assert tuple(st.k_cache.shape) == prog.buffers.kv_shape
    bad = st.program.clone()
    matvec = {int(o) for o in isa.matvec_ops()}
    first_mv = next(i for i in range(bad.shape[1]) if int(bad[0, i, 0]) in matvec)
    # IN_OFF no longer 16-byte aligned for bf16 vectors
    bad[0, first_mv, isa.field_index(int(bad[0, first_mv, 0]), "IN_OFF")] += 4
    with pytest.raises(ArgumentError, match="IN_OFF=.* not a multiple of 8"):
        check_records(bad, spec)


@pytest.mark.parametrize("model", ["llama-tiny", "qwen2-tiny", "qwen3.5-tiny", "nemotron-h-tiny"])
def test_prefill_cache_lands_where_the_executor_puts_it(model):
    """After the reference's prefill, the kernel's KV cache, recurrent state arena (conv windows,
    states) and lengths hold what the CPU executor's load_cache makes of the same reference cache
    (unwritten slots NaN in both)."""
    from megakernel.executor import Executor, executor_gpu
    from megakernel.layers import kind
    from megakernel.models.weights import random_weights
    from megakernel.program.compiler import compile_program
    from megakernel.program.pack import pack_weights
    from megakernel.reference.model import ReferenceModel

    cfg = preset(model)
    w = random_weights(cfg, seed=2)
    prog = compile_program(cfg, 2, executor_gpu(8), max_seq_len=16, policy="structure")
    st = device_state.allocate_state(cfg, w, prog, "cpu")
    ref = ReferenceModel(cfg, w, mode="bf16")
    cache = ref.new_cache(2, 12)
    ref.prefill(cache, [[5, 17, 3], [7, 1, 30, 2, 9]])
    st.load_cache(cache)
    ex = Executor(prog, pack_weights(cfg, w), check=False)
    ex.load_cache(cache)
    for mine, theirs in ((st.k_cache, ex.k), (st.v_cache, ex.v)):
        written = mine[:, :, :, :12]
        assert torch.equal(written.isnan(), theirs[:, :, :, :12].isnan())
        assert torch.equal(written.nan_to_num(), theirs[:, :, :, :12].nan_to_num())
        assert int(written.isfinite().sum()) > 0
    assert st.region("i32", "lengths").tolist() == ex.lengths.tolist() == [3, 5]
    assert st.state.numel() == prog.buffers.state_numel
    assert torch.equal(st.state, ex.state)
    assert (st.state.numel() > 0) == any(kind(b.kind).recurrent for b in cfg.blocks)
    if st.state.numel():
        assert int((st.state != 0).sum()) > st.state.numel() // 4  # the prefill's states landed
    with pytest.raises(ArgumentError, match="does not fit the program's 16"):
        st.load_cache(ref.new_cache(2, 17))


def test_find_build_refuses_a_build_with_other_baked_in_constants(tmp_path):
    """eps and the family are compile-time constants of the kernel: a build made for the same
    shapes but another rms_norm_eps must not be launched for this model."""
    import dataclasses

    from tests.runtime.test_runtime import write_build

    cfg = preset("llama-tiny")
    root = write_build(tmp_path, manifest_dict("sm_90a", batch=2, tokens=1))
    assert device_state.find_build(cfg, 2, 1, "sm_90a", root).arch == "sm_90a"
    other = dataclasses.replace(cfg, rms_norm_eps=1e-6)
    with pytest.raises(ArgumentError, match="eps built 1e-05 vs needed 1e-06"):
        device_state.find_build(other, 2, 1, "sm_90a", root)
