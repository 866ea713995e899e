"""MLA_Q, MLA and MLA_O (layers/mla.py): latent attention with weight absorption. W_UK goes into
the query (per head), all heads attend over the latent cache of one (sequence, split) read once,
W_UV follows the merge of the splits (per head); kv_b is never expanded over the cache."""

from __future__ import annotations

import torch

from megakernel.executor.core import Executor, op
from megakernel.executor.ops.attention import merge_splits, split_keys
from megakernel.kernel.host.mla_index import LATENT_NORM_EPS
from megakernel.layers.frame import round_rows
from megakernel.layers.mla import MLAConfig
from megakernel.layers.mla import MultiLatentAttention as Kind
from megakernel.reference.layers.common import rms_norm


def proj_view(ex: Executor, d: dict, m: MLAConfig) -> tuple[int, tuple[int, int]]:
    """(PROJ_OFF, the [N, P] shape of the fp32 projection) of record `d`."""
    return d["PROJ_OFF"], (ex.prog.rows, round_rows(Kind.proj_rows(m)))


def kv_b(ex: Executor, d: dict, m: MLAConfig, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head h's rows of kv_b as fp32: W_UK [dn, r] and W_UV [dv, r]."""
    dn, dv, r = m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
    w0 = d["KVB_W"] + h * (dn + dv) * r
    return ex.weights[w0 : w0 + (dn + dv) * r].view(dn + dv, r).float().split([dn, dv])


@op("MLA_Q")
def mla_q(ex: Executor, d: dict, epoch: int) -> None:
    m, n, h = ex.block(d, "mla").cfg, ex.prog.rows, d["HEAD"]
    dqk, hh = m.qk_head_dim, m.num_heads
    q_nope = ex.read("f32", *proj_view(ex, d, m), (slice(None), slice(h * dqk, h * dqk
                                                                      + m.qk_nope_head_dim)))
    w_uk, _ = kv_b(ex, d, m, h)
    ex.write("f32", d["QLAT_OFF"], (n, hh, m.kv_lora_rank), (slice(None), h),
             q_nope.to(torch.bfloat16).float() @ w_uk)  # [N, r]


@op("MLA")
def mla(ex: Executor, d: dict, epoch: int) -> None:
    m, p = ex.block(d, "mla").cfg, ex.prog
    n, t_, hh, r, dqk = p.rows, p.tokens, m.num_heads, m.kv_lora_rank, m.qk_head_dim
    b, s, ns, slot = d["B_IDX"], d["SPLIT"], d["N_SPLITS"], p.buffers.kv_slot[d["LAYER"]]
    rows = slice(b * t_, (b + 1) * t_)
    length = int(ex.read("i32", d["LEN_OFF"], (p.batch,), b, scratch=False))
    k0, k1, visible = split_keys(s, ns, length, t_)  # visible [T, nk]
    mid = min(max(k0, length), k1)  # keys below `length` are cached by earlier steps
    kc, vc = p.buffers.kv_shape, p.buffers.v_shape
    # this split's new positions [mid, k1): the normed latent and k_rope, stored as bf16
    t0, t1 = (b * t_ + max(0, k - length) for k in (mid, k1))  # their rows (t0 = t1: none)
    lat = ex.read("f32", *proj_view(ex, d, m),
                  (slice(t0, t1), slice(hh * dqk, hh * dqk + m.latent)))  # [new, r + dr]
    c_new = rms_norm(lat[:, :r], ex.weights[d["NORM_W"] : d["NORM_W"] + r], LATENT_NORM_EPS)
    c_new, kr_new = c_new.to(torch.bfloat16), lat[:, r:].to(torch.bfloat16)
    if k1 > mid:
        ex.write("k", 0, kc, (slot, b, 0, slice(mid, k1)), c_new)
        ex.write("v", 0, vc, (slot, b, 0, slice(mid, k1)), kr_new)
    c_s = torch.cat((ex.read("k", 0, kc, (slot, b, 0, slice(k0, mid)), scratch=False),
                     c_new)).float()  # [nk, r]
    kr = torch.cat((ex.read("v", 0, vc, (slot, b, 0, slice(k0, mid)), scratch=False),
                    kr_new)).float()  # [nk, dr]
    q_rope = ex.read("f32", *proj_view(ex, d, m), (rows, slice(0, hh * dqk))).view(
        t_, hh, dqk)[..., m.qk_nope_head_dim :].to(torch.bfloat16).float()
    q = torch.cat((ex.read("f32", d["QLAT_OFF"], (n, hh, r), rows), q_rope), -1)  # [T, H, r+dr]
    scores = torch.einsum("thd,sd->ths", q, torch.cat((c_s, kr), -1)) * dqk**-0.5
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))  # [T, H, nk]
    mx = scores.amax(dim=-1) if k1 > k0 else torch.full((t_, hh), float("-inf"))
    pr = torch.exp(scores - torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))[..., None])
    ex.write("f32", d["PO_OFF"], (ns, n, hh, r), (s, rows), torch.einsum("ths,sr->thr", pr, c_s))
    ex.write("f32", d["PML_OFF"], (ns, n, hh, 2), (s, rows), torch.stack((mx, pr.sum(-1)), -1))


@op("MLA_O")
def mla_o(ex: Executor, d: dict, epoch: int) -> None:
    m, n, h, ns = ex.block(d, "mla").cfg, ex.prog.rows, d["HEAD"], d["N_SPLITS"]
    hh, r, dv = m.num_heads, m.kv_lora_rank, m.v_head_dim
    everything = (slice(None), slice(None), h)
    o_lat = merge_splits(ex.read("f32", d["PO_OFF"], (ns, n, hh, r), everything),
                         ex.read("f32", d["PML_OFF"], (ns, n, hh, 2), everything))  # [N, r]
    _, w_uv = kv_b(ex, d, m, h)
    ex.write("bf16", d["OUT_OFF"], (n, hh * dv), (slice(None), slice(h * dv, (h + 1) * dv)),
             o_lat @ w_uv.T)
