"""Mixture of experts of Kimi Linear (DeepSeek-V3 style routing) with shared experts.

Routing per token, all fp32 (router weight kept fp32):
    s = sigmoid(W_r x);  choice = s + e_score_correction_bias
    group score = sum of the top-2 choices in each of n_group groups; keep the topk_group best
    experts = top_k of choice within the kept groups;  weight_e = s_e (not the biased choice)
    ties (equal group scores or choices) go to the lower index, so that every implementation
    picks the same experts (torch.topk leaves the order of equal values unspecified)
    weights /= sum(weights) + 1e-20 (norm_topk_prob);  weights *= routed_scaling_factor
    out = sum_e weight_e * SwiGLU_e(x) + SharedSwiGLU(x)
Experts are accumulated in increasing expert index, then the shared experts are added (as HF does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from megakernel.layers.moe import MoEConfig

from .base import ReferenceLayer, register_layer
from .common import linear
from .swiglu import SwiGLU

if TYPE_CHECKING:
    from megakernel.models.config import Block, ModelConfig


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row of x, largest first, equal values by lower index."""
    return x.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def route(cfg: MoEConfig, logits: torch.Tensor, bias: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, top_k] fp32, expert ids [N, top_k])."""
    n, e = logits.shape
    scores = torch.sigmoid(logits)
    choice = scores + bias
    per_group = e // cfg.n_group
    group_scores = choice.reshape(n, cfg.n_group, per_group).topk(2, dim=-1).values.sum(-1)
    groups = _top(group_scores, cfg.topk_group)  # [N, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep[:, :, None].expand(n, cfg.n_group, per_group).reshape(n, e)
    ids = _top(choice.masked_fill(~keep, float("-inf")), cfg.top_k)
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


@register_layer
class MoE(ReferenceLayer):
    """One Kimi MoE block (weights under `{p}` = `model.layers.{i}.block_sparse_moe.`)."""

    kind = "moe"

    def __init__(self, cfg: MoEConfig, w: dict[str, torch.Tensor], p: str, mode: str):
        self.cfg, self.mode = cfg, mode
        self.router = w[p + "gate.weight"].to(torch.float32)
        self.bias = w[p + "gate.e_score_correction_bias"].to(torch.float32)
        self.experts = [
            SwiGLU(w[f"{p}experts.{e}.w1.weight"], w[f"{p}experts.{e}.w3.weight"],
                   w[f"{p}experts.{e}.w2.weight"], mode)
            for e in range(cfg.num_experts)
        ]
        self.shared = (SwiGLU.from_prefix(w, p + "shared_experts.", mode)
                       if cfg.num_shared_experts else None)

    @classmethod
    def from_block(cls, blk: Block, model: ModelConfig, w: dict[str, torch.Tensor], mode: str,
                   device: torch.device) -> MoE:
        return cls(blk.cfg, w, blk.prefix, mode)

    def forward(self, xn: torch.Tensor, cache: Any = None, lengths: torch.Tensor | None = None,
                replay: bool = False, prefill: bool = False) -> torch.Tensor:
        return self(xn)

    def __call__(self, xn: torch.Tensor) -> torch.Tensor:
        """xn [..., D] (normed, stored) -> [..., D] fp32."""
        shape = xn.shape
        x = xn.reshape(-1, shape[-1])  # [N, D]
        weights, ids = route(self.cfg, linear(x, self.router), self.bias)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, slot, None])
        out = out.reshape(shape)
        if self.shared is not None:
            out = out + self.shared(xn)
        return out
