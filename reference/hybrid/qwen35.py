"""Qwen3.5 (text, dense MLP) reference: GDN and gated-attention layers, each followed by a SwiGLU.

Block order per layer: h += mixer(norm_in(h)); h += mlp(norm_post(h)). Every RMSNorm outside the
GDN output norm is the zero-centred (1 + w) form. Weights and layouts: megakernel.hybrid.weights,
gated_delta.py, attention.py.
"""

from __future__ import annotations

import torch

from megakernel.hybrid.config import Qwen35Config

from .attention import Attention
from .common import rms_norm_1p
from .gated_delta import GatedDeltaNet
from .mlp import SwiGLU
from .model import Block, HybridModel


class Qwen35Model(HybridModel):
    cfg: Qwen35Config

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rms_norm_1p(x, w, self.cfg.rms_norm_eps)

    def build_blocks(self) -> list[Block]:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        blocks = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"model.layers.{i}."
            norm_in = self._normed(p + "input_layernorm.weight")
            if kind == "gdn":
                op = GatedDeltaNet(cfg.gdn, self.w, p + "linear_attn.", eps, self.mode)
                blocks.append(Block(i, "recurrent", norm_in, op))
            else:
                op = Attention(cfg.attention, self.w, p + "self_attn.", eps, self.mode, self.device)
                blocks.append(Block(i, "kv", norm_in, op))
            blocks.append(Block(i, "ffn", self._normed(p + "post_attention_layernorm.weight"),
                                SwiGLU.from_prefix(self.w, p + "mlp.", self.mode)))
        return blocks
