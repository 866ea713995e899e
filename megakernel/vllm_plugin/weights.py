"""Hugging Face-named weights from a loaded vLLM model: what `pack_weights` takes, read from
vLLM's own parameters (its fused qkv_proj and gate_up_proj split back), never from the
checkpoint again."""

from __future__ import annotations

import torch

from megakernel.models.config import ModelConfig
from megakernel.models.weights import check_weights, expected_shapes


def hf_weights(cfg: ModelConfig, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """vLLM parameter names -> ours: `qkv_proj` [q | k | v] rows, `gate_up_proj` [gate | up];
    the vocabulary padding of vLLM's embedding and LM head dropped; a tied LM head left out."""
    attn = cfg.kind_config("attention")
    q, kv = attn.q_size, attn.kv_size
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if ".qkv_proj." in name:
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]),
                                  strict=True):
                out[name.replace("qkv_proj", part)] = rows
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    want = expected_shapes(cfg)
    for name in (cfg.embed_name, cfg.lm_head_name):
        if name in out and name in want:
            out[name] = out[name][: want[name][0]]
    weights = {n: out[n].to(torch.bfloat16).contiguous() for n in want if n in out}
    check_weights(cfg, weights)  # names the missing or misshaped tensor
    return weights
