"""Kimi Linear reference: KDA and MLA layers; a dense SwiGLU in the first `first_k_dense` layers and
an MoE with shared experts after that.

Block order per layer: h += mixer(norm_in(h)); h += ffn(norm_post(h)); plain RMSNorms (w * x).
"""

from __future__ import annotations

from megakernel.hybrid.config import KimiLinearConfig

from .kda import KimiDeltaAttention
from .mla import MLA
from .mlp import SwiGLU
from .model import Block, HybridModel
from .moe import MoE


class KimiLinearModel(HybridModel):
    cfg: KimiLinearConfig

    def build_blocks(self) -> list[Block]:
        cfg = self.cfg
        blocks = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"model.layers.{i}."
            norm_in = self._normed(p + "input_layernorm.weight")
            if kind == "kda":
                op = KimiDeltaAttention(cfg.kda, self.w, p + "self_attn.", cfg.rms_norm_eps,
                                        self.mode)
                blocks.append(Block(i, "recurrent", norm_in, op))
            else:
                blocks.append(Block(i, "kv", norm_in, MLA(cfg.mla, self.w, p + "self_attn.",
                                                           self.mode)))
            if cfg.ffn_type(i) == "mlp":
                ffn = SwiGLU.from_prefix(self.w, p + "mlp.", self.mode)
            else:
                ffn = MoE(cfg.moe, self.w, p + "block_sparse_moe.", self.mode)
            blocks.append(Block(i, "ffn", self._normed(p + "post_attention_layernorm.weight"), ffn))
        return blocks
