"""Nemotron-H reference: one block per layer, h += mixer(RMSNorm(h)), the mixer being Mamba2 (M),
grouped-query attention without RoPE (*) or a relu^2 MLP (-). Weights under `backbone.`.
"""

from __future__ import annotations

from megakernel.hybrid.config import NemotronHConfig

from .attention import Attention
from .mamba2 import Mamba2Mixer
from .mlp import Relu2MLP
from .model import Block, HybridModel


class NemotronHModel(HybridModel):
    cfg: NemotronHConfig

    def build_blocks(self) -> list[Block]:
        cfg = self.cfg
        blocks = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"backbone.layers.{i}."
            norm = self._normed(p + "norm.weight")
            if kind == "mamba2":
                op = Mamba2Mixer(cfg.mamba2, self.w, p + "mixer.", cfg.rms_norm_eps, self.mode)
                blocks.append(Block(i, "recurrent", norm, op))
            elif kind == "attention":
                op = Attention(cfg.attention, self.w, p + "mixer.", cfg.rms_norm_eps, self.mode,
                               self.device)
                blocks.append(Block(i, "kv", norm, op))
            else:
                blocks.append(Block(i, "ffn", norm, Relu2MLP(self.w, p + "mixer.", self.mode)))
        return blocks
