"""MLA (layers/mla.py): one (sequence, head) of latent attention over the latent cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel.executor.core import Executor, op
from megakernel.layers.frame import round_rows
from megakernel.layers.mla import LATENT_NORM_EPS
from megakernel.layers.mla import MultiLatentAttention as Kind
from megakernel.reference.layers.common import rms_norm


@op("MLA")
def mla(ex: Executor, d: dict, epoch: int) -> None:
    blk = ex.block(d, "mla")
    m, p = blk.cfg, ex.prog
    n, t_ = p.rows, p.tokens
    hh, dqk, dn, dv, r, dr = (m.num_heads, m.qk_head_dim, m.qk_nope_head_dim, m.v_head_dim,
                              m.kv_lora_rank, m.qk_rope_head_dim)
    pw = round_rows(Kind.proj_rows(m))  # the block's own projection width
    b, h, slot = d["B_IDX"], d["HEAD"], p.buffers.kv_slot[d["LAYER"]]
    rows = slice(b * t_, (b + 1) * t_)
    length = int(ex.read("i32", d["LEN_OFF"], (p.batch,), b, scratch=False))
    q = ex.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(h * dqk, (h + 1) * dqk)))
    q = q.to(torch.bfloat16).float()  # [T, dn + dr]
    lat = ex.read("f32", d["PROJ_OFF"], (n, pw), (rows, slice(hh * dqk, hh * dqk + r + dr)))
    k_rope = lat[:, r:].to(torch.bfloat16)
    c = rms_norm(lat[:, :r], ex.weights[d["NORM_W"] : d["NORM_W"] + r], LATENT_NORM_EPS)
    c = c.to(torch.bfloat16)
    kc, vc = p.buffers.kv_shape, p.buffers.v_shape
    new, old = slice(length, length + t_), slice(0, length)
    if h == 0:  # every head computes the same latent; head 0 stores it
        ex.write("k", 0, kc, (slot, b, 0, new), c)
        ex.write("v", 0, vc, (slot, b, 0, new), k_rope)
    # cached positions, then this step's (as stored: bf16)
    c_all = torch.cat((ex.read("k", 0, kc, (slot, b, 0, old), scratch=False), c)).float()
    kr = torch.cat((ex.read("v", 0, vc, (slot, b, 0, old), scratch=False), k_rope)).float()
    w0 = d["KVB_W"] + h * (dn + dv) * r
    kv = F.linear(c_all, ex.weights[w0 : w0 + (dn + dv) * r].view(-1, r).float())
    keys = torch.cat((kv[:, :dn], kr), dim=-1)  # [S, dn + dr]
    scores = (q @ keys.T) * dqk**-0.5  # [T, S]
    visible = torch.arange(length + t_)[None, :] <= (length + torch.arange(t_))[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    ex.write("bf16", d["OUT_OFF"], (n, hh * dv), (rows, slice(h * dv, (h + 1) * dv)),
             probs @ kv[:, dn:])
