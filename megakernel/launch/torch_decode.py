"""The torch baseline's decode step (`TorchDecode`): one step (T = 1) of the dense families in
plain torch ops with a static KV cache, what measure.compile_timing times under torch.compile and
the kernel's step is compared with (gpu-check's benchmark, bench/decode.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def serves(cfg) -> bool:  # noqa: ANN001 (ModelConfig)
    """TorchDecode implements the dense stacks (models/dense.py: attention with optional q/k/v
    biases and q/k norm, SwiGLU), whatever family declares one."""
    from megakernel.models.dense import DenseConfig

    return isinstance(cfg, DenseConfig)


class TorchDecode:
    """One decode step (T = 1) of a dense stack (`serves`: Llama, Qwen3, Qwen2) in plain torch ops
    with bf16 weights and a static KV cache [L, B, Hkv, S_max, D] (graph-safe: no host syncs),
    the rounding points of the reference's bf16 mode. The torch.compile baseline's step."""

    def __init__(self, cfg, w: dict[str, torch.Tensor], batch: int, s_max: int,  # noqa: ANN001
                 device: str | torch.device = "cuda"):
        self.cfg, self.b = cfg, batch
        self.w = {k: v.to(device, torch.bfloat16) for k, v in w.items()}
        L, hkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self.k = torch.zeros(L, batch, hkv, s_max, d, dtype=torch.bfloat16, device=device)
        self.v = torch.zeros_like(self.k)
        inv = torch.tensor(cfg.rope.inv_freq(d), dtype=torch.float64)
        ang = torch.arange(s_max, dtype=torch.float64)[:, None] * inv
        self.cos = torch.cat((ang.cos(), ang.cos()), -1).float().to(device)
        self.sin = torch.cat((ang.sin(), ang.sin()), -1).float().to(device)
        self.mask_pos = torch.arange(s_max, device=device)

    def norm(self, x, w):  # noqa: ANN001, ANN201
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
                * w.float()).to(torch.bfloat16)

    def rope(self, x, pos):  # noqa: ANN001, ANN201
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x.chunk(2, -1)
        return x * c + torch.cat((-x2, x1), -1) * s

    def logits(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tok [B] int64, pos [B] int64 (cache position of the new token) -> fp32 [B, V];
        writes this token's k, v into the cache."""
        cfg, w = self.cfg, self.w
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = w["model.embed_tokens.weight"][tok].float()  # [B, H]
        bidx = torch.arange(self.b, device=tok.device)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x = self.norm(h, w[p + "input_layernorm.weight"])
            q = F.linear(x, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
            k = F.linear(x, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
            v = F.linear(x, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
            q, k = q.float().view(self.b, hq, d), k.float().view(self.b, hkv, d)
            v = v.view(self.b, hkv, d)
            if cfg.qk_norm:
                q = self.norm(q, w[p + "self_attn.q_norm.weight"]).float()
                k = self.norm(k, w[p + "self_attn.k_norm.weight"]).float()
            q, k = self.rope(q, pos).to(torch.bfloat16), self.rope(k, pos).to(torch.bfloat16)
            self.k[i, bidx, :, pos] = k
            self.v[i, bidx, :, pos] = v
            mask = self.mask_pos[None, :] <= pos[:, None]  # [B, S]
            o = F.scaled_dot_product_attention(
                q[:, :, None, :], self.k[i], self.v[i], attn_mask=mask[:, None, None, :],
                enable_gqa=True)  # [B, Hq, 1, D]
            h = h + F.linear(o.reshape(self.b, hq * d), w[p + "self_attn.o_proj.weight"]).float()
            x = self.norm(h, w[p + "post_attention_layernorm.weight"])
            g = F.linear(x, w[p + "mlp.gate_proj.weight"]).float()
            u = F.linear(x, w[p + "mlp.up_proj.weight"]).float()
            a = (F.silu(g) * u).to(torch.bfloat16)
            h = h + F.linear(a, w[p + "mlp.down_proj.weight"]).float()
        x = self.norm(h, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return F.linear(x, head).float()

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tok [B], pos [B] -> the greedy next tokens [B]."""
        return torch.argmax(self.logits(tok, pos), dim=-1)
