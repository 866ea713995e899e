"""Helpers of the layer-kind tests: the tiny presets' blocks of each kind and the block configs
no preset has, tagged checkpoint tensors, the transformers oracle of each family (which
tests/models/conftest.py uses too), compiled tiny programs and build contexts, and a one-model
executor-vs-reference run.

Everything expensive is cached for the session: a program or a transformers model is built once
however many tests read it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megakernel.isa.records import GATEUP_BLOCK
from megakernel.layers import kind
from megakernel.layers.attention import AttentionConfig
from megakernel.layers.base import StepShape
from megakernel.layers.mamba2 import Mamba2Config
from megakernel.layers.moe import MoEConfig
from megakernel.layers.swiglu import SwiGLUConfig
from megakernel.models import Block, ModelConfig, preset
from megakernel.models.weights import random_weights
from tests.registries import TINY  # the tiny preset of each family (of all its layer kinds)

HF_CLASSES = {  # family -> transformers (config class, model class): each family's oracle
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
}
TAG = 10_000_000  # tagged tensors: element j of tensor i holds (i + 1) * TAG + j
SMS = 8  # SMs of the GPU description the test programs are compiled for
LOGIT_TOL = 1e-3  # executor vs bf16 reference (measured: bit-identical)


# ---- blocks --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CustomModel(ModelConfig):
    """A model of any blocks (no family): for block configs no preset has."""

    custom_blocks: tuple[Block, ...]

    @property
    def num_layers(self) -> int:
        return len({b.layer for b in self.custom_blocks})

    def make_blocks(self) -> tuple[Block, ...]:
        return self.custom_blocks


def custom_model(*blocks: Block, hidden: int = 64, vocab: int = 256) -> CustomModel:
    return CustomModel(vocab_size=vocab, hidden_size=hidden, max_position_embeddings=512,
                       custom_blocks=tuple(blocks), name="custom")


def presets_with(kind_name: str) -> list[str]:
    """The tiny presets that have a block of `kind_name`."""
    return [n for n in TINY if preset(n).has_kind(kind_name)]


def blocks_of(kind_name: str) -> list[tuple[ModelConfig, Block]]:
    """(model, block) for every distinct block config of `kind_name` in the tiny presets (the
    first block of each config per preset)."""
    out = []
    for n in presets_with(kind_name):
        cfg, seen = preset(n), []
        for blk in cfg.blocks:
            if blk.kind == kind_name and blk.cfg not in seen:
                seen.append(blk.cfg)
                out.append((cfg, blk))
    return out


def gated_biased() -> tuple[ModelConfig, Block]:
    """A model of one attention block with both an output gate and q/k/v biases (no preset has
    both), and a SwiGLU."""
    att = AttentionConfig(4, 2, 64, rotary_dim=32, qk_norm=True, output_gate=True, qkv_bias=True)
    blk = Block(0, "attn", "attention", att, "layers.0.attn.", "layers.0.attn_norm.weight")
    mlp = Block(0, "mlp", "swiglu", SwiGLUConfig(128), "layers.0.mlp.", "layers.0.mlp_norm.weight")
    return custom_model(blk, mlp), blk


def without_conv_bias() -> tuple[ModelConfig, Block]:
    """The tiny preset's Mamba2 block without its conv bias."""
    cfg, blk = blocks_of("mamba2")[0]
    m = blk.cfg
    c = Mamba2Config(m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel, False)
    return cfg, Block(blk.layer, blk.name, "mamba2", c, blk.prefix, blk.norm)


def unshared() -> tuple[ModelConfig, Block]:
    """The tiny preset's MoE block without its shared expert."""
    cfg, blk = blocks_of("moe")[0]
    e = blk.cfg
    c = MoEConfig(e.num_experts, e.top_k, e.intermediate_size, 0, e.routed_scaling_factor,
                  e.n_group, e.topk_group)
    return cfg, Block(blk.layer, blk.name, "moe", c, blk.prefix, blk.norm)


VARIANTS: dict[str, Callable[[], tuple[ModelConfig, Block]]] = {
    "gated-biased": gated_biased, "no-conv-bias": without_conv_bias, "unshared": unshared}


def cases(*kinds: str, variants: bool = True) -> list[Any]:
    """pytest params (model, block) of `kinds`: every distinct block config of the tiny presets
    (`blocks_of`), and with `variants` the VARIANTS of those kinds."""
    out = [pytest.param(cfg, blk, id=f"{k}-{cfg.name}-L{blk.layer}")
           for k in kinds for cfg, blk in blocks_of(k)]
    for name, make in VARIANTS.items() if variants else ():
        cfg, blk = make()
        if blk.kind in kinds:
            out.append(pytest.param(cfg, blk, id=f"{blk.kind}-{name}"))
    return out


# ---- checkpoint tensors --------------------------------------------------------------------------
def tagged(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """float64 tensors of `shapes` whose elements name themselves: element j (flat) of the i-th
    tensor holds (i + 1) * TAG + j, so a packed tensor shows where each element came from (and
    zero padding reads 0)."""
    return {name: ((i + 1) * TAG + torch.arange(math.prod(s), dtype=torch.float64)).view(s)
            for i, (name, s) in enumerate(shapes.items())}


def pack_tagged(blk: Block, model: ModelConfig) -> tuple[dict[str, torch.Tensor],
                                                         dict[str, torch.Tensor]]:
    """(tagged checkpoint tensors of the block by local name, the kind's `pack` of them)."""
    kd = kind(blk.kind)
    w = tagged(kd.shapes(blk, model))
    return w, kd.pack(blk, model, w.__getitem__)


def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The documented gate/up order (SwiGLU, MoE experts), row by row: packed row r is, with
    j, i = divmod(r, 32), gate row 16 j + i for i < 16, else up row 16 j + i - 16."""
    rows = []
    for r in range(2 * gate.shape[0]):
        j, i = divmod(r, 2 * GATEUP_BLOCK)
        rows.append(gate[GATEUP_BLOCK * j + i] if i < GATEUP_BLOCK
                    else up[GATEUP_BLOCK * j + i - GATEUP_BLOCK])
    return torch.stack(rows)


# ---- the transformers oracle ---------------------------------------------------------------------
def hf_classes(family: str) -> tuple[type, type]:
    """family -> (transformers config class, transformers model class)."""
    import transformers

    cfg_name, model_name = HF_CLASSES[family]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


@functools.cache
def hf_model_tensors(name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint name -> (shape, dtype) of the transformers model of tiny preset `name`, built on
    the meta device in bf16 (the tensors transformers keeps in fp32 stay fp32), its names as
    save_pretrained writes them (load-time conversions reverted: unfused experts, split convs)
    and then mapped by the family's `canonical_name`."""
    from transformers.core_model_loading import revert_weight_conversion

    cfg = preset(name)
    cfg_cls, model_cls = hf_classes(cfg.family)
    with torch.device("meta"):
        hf = model_cls._from_config(cfg_cls(**cfg.to_hf_dict()), dtype=torch.bfloat16)
    out = {}
    for n, t in revert_weight_conversion(hf, hf.state_dict()).items():
        ours = cfg.canonical_name(n)
        if ours is not None:
            out[ours] = (tuple(t.shape), t.dtype)
    return out


def hf_block_tensors(model: ModelConfig, blk: Block) -> dict[str, tuple[tuple[int, ...],
                                                                        torch.dtype]]:
    """The transformers tensors under the block's prefix, by local name."""
    return {n[len(blk.prefix):]: v for n, v in hf_model_tensors(model.name).items()
            if n.startswith(blk.prefix)}


# ---- programs ------------------------------------------------------------------------------------
def gpu8() -> Any:
    from megakernel.program.gpus import gpu

    return gpu("h100").with_sms(SMS)


@functools.cache
def tiny_program(name: str, batch: int = 2, tokens: int = 1, window: int | None = None,
                 n_splits: int = 2) -> Any:
    """A compiled program of tiny preset `name` (max_seq_len 64)."""
    from megakernel.program.compiler import compile_program

    return compile_program(preset(name), batch, gpu8(), tokens=tokens, max_seq_len=64,
                           n_splits=n_splits, replay_window=window)


def build_context(cfg: ModelConfig, batch: int = 2, tokens: int = 1, max_seq_len: int = 64,
                  n_splits: int = 2, window: int | None = None, context: int = 32) -> Any:
    """A compiler BuildContext (layout, buffers, counters) without scheduling anything: what a
    kind's `stages` reads."""
    from megakernel.isa.stages import Counters
    from megakernel.program.buffers import plan_buffers
    from megakernel.program.compiler import BuildContext
    from megakernel.program.pack import weight_layout

    ring_cap = window - 1 + tokens if window else 0
    buf = plan_buffers(cfg, StepShape(batch, tokens, max_seq_len, n_splits, SMS, ring_cap))
    return BuildContext(cfg, batch, tokens, context, n_splits, window, weight_layout(cfg), buf,
                        Counters())


def block_records(prog: Any, blk: Block) -> list[dict]:
    """The decoded records of the program that belong to block `blk` (its layer, an opcode of its
    kind's flow)."""
    from megakernel import isa

    flow = kind(blk.kind).flow
    out = []
    for q in prog.records().tolist():
        for rec in q:
            if rec[0] == isa.Op.END:
                break
            d = isa.decode(rec)
            if d["LAYER"] == blk.layer and d["OPCODE"].name in flow:
                out.append(d)
    return out


def executor_vs_reference(cfg: ModelConfig, window: int | None = None, steps: int = 2,
                          tokens: int = 1) -> float:
    """Run `steps` program steps of `cfg` (batch 2, ragged prompts prefilled by the bf16
    reference) on the executor and the same steps on the bf16 reference; returns the largest
    logit difference (greedy tokens must agree)."""
    from megakernel.executor import Executor
    from megakernel.program.compiler import compile_program
    from megakernel.program.pack import pack_weights
    from megakernel.reference.model import ReferenceModel

    w = random_weights(cfg, seed=1)
    ref = ReferenceModel(cfg, w, mode="bf16", replay_window=window)
    cache = ref.new_cache(2, 16, max_step_tokens=tokens)
    first = ref.prefill(cache, [[1, 2, 3], [4, 5, 6, 7, 8]]).argmax(-1)
    prog = compile_program(cfg, 2, gpu8(), tokens=tokens, max_seq_len=16, replay_window=window)
    ex = Executor(prog, pack_weights(cfg, w))
    ex.load_cache(cache)
    gen = torch.Generator().manual_seed(2)
    tok = first[:, None] if tokens == 1 else torch.randint(0, cfg.vocab_size, (2, tokens),
                                                           generator=gen)
    worst = 0.0
    for step in range(steps):
        out = ex.step(tok, seed=step)
        want = ref.decode(cache, tok)
        worst = max(worst, (ex.logits.view(2, tokens, -1) - want).abs().max().item())
        assert torch.equal(out, want.argmax(-1)), f"step {step}: greedy tokens differ"
        tok = out[:, -1:] if tokens == 1 else torch.randint(0, cfg.vocab_size, (2, tokens),
                                                            generator=gen)
    return worst
