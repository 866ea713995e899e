"""QKV and ATTN_PARTIAL (layers/attention.py): every attention variant, by the program header
(q/k norm form, rotary dims, output gate, q/k/v bias)."""

from __future__ import annotations

import torch

from megakernel.executor.core import Executor, op
from megakernel.program.paged import page_runs


def rope(ex: Executor, x: torch.Tensor, pos: torch.Tensor, rope_off: int) -> torch.Tensor:
    """Rotate-half RoPE on the first R (header ROTARY_DIM) dims of x [N, D] at positions [N],
    with the fp32 tables cos, sin [S_max, R/2] at `rope_off` (-1: no RoPE)."""
    r = ex.prog.header["ROTARY_DIM"]
    if rope_off < 0 or r == 0:
        return x
    half, s = r // 2, ex.prog.max_seq_len
    cos_h = ex.f32[rope_off : rope_off + s * half].view(s, half)
    sin_h = ex.f32[rope_off + s * half : rope_off + 2 * s * half].view(s, half)
    cos = torch.cat((cos_h[pos], cos_h[pos]), dim=-1)  # [N, R]
    sin = torch.cat((sin_h[pos], sin_h[pos]), dim=-1)
    rot, rest = x[:, :r], x[:, r:]
    rotated = torch.cat((-rot[:, half:], rot[:, :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def split_keys(split: int, n_splits: int, length: int, tokens: int
               ) -> tuple[int, int, torch.Tensor]:
    """ATTN_PARTIAL's split rule (layers/attention.py): split s of a sequence with `length`
    cached keys covers keys [k0, k1) = [floor(s ctx / S), floor((s + 1) ctx / S)), ctx = length
    + T, and query token t sees those <= length + t. Returns k0, k1 and visible [T, k1 - k0]."""
    ctx = length + tokens
    k0, k1 = split * ctx // n_splits, (split + 1) * ctx // n_splits
    qpos = length + torch.arange(tokens)
    return k0, k1, torch.arange(k0, k1)[None, :] <= qpos[:, None]


def merge_splits(po: torch.Tensor, pml: torch.Tensor) -> torch.Tensor:
    """Splits 0..S-1 merged in order: po [S, ..., D], pml [S, ..., 2] (m, l) -> [..., D] =
    sum(o_s e^(m_s - M)) / sum(l_s e^(m_s - M)), M = max m_s (empty splits weigh 0)."""
    ms, ls = pml[..., 0], pml[..., 1]
    wgt = torch.exp(ms - ms.amax(dim=0))
    return (po * wgt[..., None]).sum(0) / (ls * wgt).sum(0)[..., None]


@op("QKV")
def qkv(ex: Executor, d: dict, epoch: int) -> None:
    p, hdr = ex.prog, ex.prog.header
    n, t_, dh, hq, g = p.rows, p.tokens, hdr["D"], hdr["HQ"], hdr["HQ"] // hdr["HKV"]
    ng = g if hdr["OUTPUT_GATE"] else 0  # gate head slots per group
    acc = ex.matvec(d)  # [N, NROWS]
    if hdr["QKV_BIAS"]:
        qkv = ex.packed.layout.entry_at(d["W"])  # the bias follows the (bf16 or fp8) matrix
        b0 = qkv.offset + qkv.span + d["ROW0"]
        acc = acc + ex.weights[b0 : b0 + d["NROWS"]].float()
    acc = acc.view(n, -1, dh)  # [N, head slots, D]
    lengths = ex.read("i32", p.buffers.i32["lengths"].offset, (p.batch,), scratch=False)
    pos = (lengths.long()[:, None] + torch.arange(t_)).reshape(-1)  # [N]
    slot_kv = p.buffers.kv_slot[d["LAYER"]]
    for j in range(acc.shape[1]):
        grp, jj = divmod(d["ROW0"] // dh + j, g + ng + 2)
        x = acc[:, j]  # [N, D]
        if jj < g or jj == g + ng:  # q or k: q/k norm, RoPE
            if d["QK_NORM_OFF"] >= 0:
                w = ex.norm_weight(d["QK_NORM_OFF"] + (0 if jj < g else dh), dh)
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ex.eps) * w
            x = rope(ex, x, pos, d["ROPE_OFF"])
        if jj < g:
            ex.write("bf16", d["OUT_OFF"], (n, hq, dh), (slice(None), grp * g + jj), x)
        elif jj < g + ng:
            ex.write("f32", hdr["F32_GATE_OFF"], (n, hq, dh), (slice(None), grp * g + jj - g), x)
        else:
            write_kv(ex, "k" if jj == g + ng else "v", slot_kv, grp, x, pos)


def step_meta(ex: Executor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A region of the caller's step metadata (lengths, block_table, slot_mapping), as int64."""
    r = ex.prog.buffers.i32[name]
    return ex.read("i32", r.offset, shape, scratch=False).long()


def write_kv(ex: Executor, buf: str, slot_kv: int, grp: int, x: torch.Tensor,
             pos: torch.Tensor) -> None:
    """Store k or v [N, D] of kv head `grp` for the N rows: at position pos[n] of sequence
    n // T (contiguous cache), or through slot_mapping[n] (paged; a negative slot is padding)."""
    p = ex.prog
    shape = p.buffers.kv_shape if buf == "k" else p.buffers.v_shape
    paged = p.buffers.paged
    slots = step_meta(ex, "slot_mapping", (p.rows,)) if paged else None
    for row in range(p.rows):
        if paged is None:
            ex.write(buf, 0, shape, (slot_kv, row // p.tokens, grp, int(pos[row])), x[row])
            continue
        if slots[row] < 0:
            continue
        blk, o = divmod(int(slots[row]), paged.block_size)
        idx = (slot_kv, blk, grp, slice(None), o) if buf == "k" else (slot_kv, blk, grp, o)
        ex.write(buf, 0, shape, idx, x[row])


def read_kv(ex: Executor, buf: str, slot_kv: int, b: int, grp: int, j0: int, j1: int,
            scratch: bool) -> torch.Tensor:
    """Keys or values [j1 - j0, D] at positions [j0, j1) of sequence b, kv head `grp`: from the
    contiguous cache, or page run by page run through the block table (paged)."""
    p = ex.prog
    shape = p.buffers.kv_shape if buf == "k" else p.buffers.v_shape
    paged = p.buffers.paged
    if paged is None:
        return ex.read(buf, 0, shape, (slot_kv, b, grp, slice(j0, j1)), scratch=scratch)
    table = step_meta(ex, "block_table", (p.batch, paged.max_blocks))[b]
    parts = [torch.empty(0, shape[-1] if buf == "v" else shape[-2], dtype=torch.bfloat16)]
    for blk, o0, o1, _ in page_runs(table, paged.block_size, j0, j1):
        if buf == "k":  # a K page is [D, block_size]
            parts.append(ex.read(buf, 0, shape, (slot_kv, blk, grp, slice(None), slice(o0, o1)),
                                 scratch=scratch).t())
        else:
            parts.append(ex.read(buf, 0, shape, (slot_kv, blk, grp, slice(o0, o1)),
                                 scratch=scratch))
    return torch.cat(parts)


@op("ATTN_PARTIAL")
def attn_partial(ex: Executor, d: dict, epoch: int) -> None:
    p, hdr = ex.prog, ex.prog.header
    n, t_, dh, hq = p.rows, p.tokens, hdr["D"], hdr["HQ"]
    g = hq // hdr["HKV"]
    b, grp, s, ns = d["B_IDX"], d["KV_HEAD"], d["SPLIT"], d["N_SPLITS"]
    slot = p.buffers.kv_slot[d["LAYER"]]
    length = int(ex.read("i32", d["LEN_OFF"], (p.batch,), b, scratch=False))
    pad = p.buffers.paged is not None and bool(
        step_meta(ex, "slot_mapping", (p.rows,))[b * t_] < 0)  # a padding row: no keys
    if pad:
        k0, k1, visible = 0, 0, torch.zeros(t_, 0, dtype=torch.bool)
    else:
        k0, k1, visible = split_keys(s, ns, length, t_)  # visible [T, nk]
    rows = slice(b * t_, (b + 1) * t_)
    heads = slice(grp * g, (grp + 1) * g)
    q = ex.read("bf16", d["Q_OFF"], (n, hq, dh), (rows, heads)).float()  # [T, G, D]
    mid = min(max(k0, length), k1)  # keys below `length` are from earlier steps
    kk, vv = (torch.cat((read_kv(ex, buf, slot, b, grp, k0, mid, False),
                         read_kv(ex, buf, slot, b, grp, mid, k1, True))).float()
              for buf in ("k", "v"))
    scores = torch.einsum("tgd,sd->tgs", q, kk) * dh**-0.5  # [T, G, nk]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    m = scores.amax(dim=-1) if k1 > k0 else torch.full((t_, g), float("-inf"))
    safe_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    pr = torch.exp(scores - safe_m[..., None])  # exp(-inf) = 0 for masked keys
    o = torch.einsum("tgs,sd->tgd", pr, vv)
    ex.write("f32", d["PO_OFF"], (ns, n, hq, dh), (s, rows, heads), o)
    ex.write("f32", d["PML_OFF"], (ns, n, hq, 2), (s, rows, heads),
             torch.stack((m, pr.sum(-1)), dim=-1))
    old = ex.release(d["SIGNAL_CID"], acquire=True)  # the (b, g) ticket
    if not ex.last_of(old, epoch, ns):
        return
    # the last split of (b, grp): merge splits 0..S-1 in order
    po = ex.read("f32", d["PO_OFF"], (ns, n, hq, dh), (slice(None), rows, heads))
    pml = ex.read("f32", d["PML_OFF"], (ns, n, hq, 2), (slice(None), rows, heads))
    out = merge_splits(po, pml)  # [T, G, D]
    if pad:  # no keys anywhere: the output of a padding row is zero
        out = torch.zeros_like(out)
    if hdr["OUTPUT_GATE"]:
        out = out * torch.sigmoid(ex.read("f32", hdr["F32_GATE_OFF"], (n, hq, dh),
                                          (rows, heads)))
    ex.write("bf16", d["OUT_OFF"], (n, hq, dh), (rows, heads), out)
    ex.release(d["DONE_CID"])
