"""Megatron-style tensor-parallel sharding of a dense model (docs/TP.md), as vLLM shards it.

Rank r of tp keeps query heads [r Hq/tp, (r + 1) Hq/tp) and the kv heads they read (a slice of
Hkv/tp heads, or one replicated kv head when tp > Hkv), MLP columns [r I/tp, (r + 1) I/tp), and
vocabulary rows [r V/tp, (r + 1) V/tp) of the embedding and the LM head. q/k/v and gate/up are
cut along their output rows (column parallel), o_proj and down along their input columns (row
parallel: each rank's product is a partial sum of h, summed by the all-reduce); norms are whole on
every rank. A rank is then an ordinary model, `shard_config`, whose program every rank shares:
only the packed weights differ.
"""

from __future__ import annotations

import torch

from megakernel.isa.stages import PlanError
from megakernel.models.dense import DenseConfig

__all__ = ["kv_heads", "shard_cache", "shard_config", "shard_weights", "vocab_slice"]


def _check(cfg, tp: int) -> None:  # noqa: ANN001 (ModelConfig)
    if not isinstance(cfg, DenseConfig):
        raise PlanError(f"tensor parallelism shards dense models; {cfg.name or cfg.family} is not")
    if tp < 1:
        raise PlanError(f"tp must be >= 1, got {tp}")
    for what, n in (("num_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size),
                    ("vocab_size", cfg.vocab_size)):
        if n % tp:
            raise PlanError(f"{what} = {n} is not a multiple of tp = {tp}")
    hkv = cfg.num_kv_heads
    if hkv % tp and tp % hkv:
        raise PlanError(f"num_kv_heads = {hkv} neither divides nor is a multiple of tp = {tp}")


def shard_config(cfg, tp: int) -> DenseConfig:  # noqa: ANN001 (ModelConfig)
    """The model one rank runs: Hq/tp heads, max(1, Hkv/tp) kv heads, I/tp, V/tp."""
    _check(cfg, tp)
    return cfg.replace(num_heads=cfg.num_heads // tp,
                       num_kv_heads=max(1, cfg.num_kv_heads // tp),
                       intermediate_size=cfg.intermediate_size // tp,
                       vocab_size=cfg.vocab_size // tp, name=f"{cfg.name}/tp{tp}")


def _span(n: int, tp: int, rank: int) -> slice:
    return slice(rank * n // tp, (rank + 1) * n // tp)


def kv_heads(cfg, tp: int, rank: int) -> slice:  # noqa: ANN001
    """The kv heads of rank `rank`: those its query heads read."""
    q = _span(cfg.num_heads, tp, rank)
    group = cfg.num_heads // cfg.num_kv_heads
    return slice(q.start // group, (q.stop - 1) // group + 1)


def vocab_slice(cfg, tp: int, rank: int) -> slice:  # noqa: ANN001
    return _span(cfg.vocab_size, tp, rank)


def shard_weights(cfg, weights: dict[str, torch.Tensor], tp: int,  # noqa: ANN001
                  rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s Hugging Face-named weights (the names `shard_config`'s model packs)."""
    _check(cfg, tp)
    d = cfg.head_dim
    q, kv = _span(cfg.num_heads, tp, rank), kv_heads(cfg, tp, rank)
    rows = {"q": slice(q.start * d, q.stop * d), "kv": slice(kv.start * d, kv.stop * d),
            "mlp": _span(cfg.intermediate_size, tp, rank), "vocab": vocab_slice(cfg, tp, rank)}
    cut = {  # name suffix -> (dimension, span)
        "q_proj.weight": (0, "q"), "q_proj.bias": (0, "q"), "o_proj.weight": (1, "q"),
        "k_proj.weight": (0, "kv"), "k_proj.bias": (0, "kv"),
        "v_proj.weight": (0, "kv"), "v_proj.bias": (0, "kv"),
        "gate_proj.weight": (0, "mlp"), "up_proj.weight": (0, "mlp"),
        "down_proj.weight": (1, "mlp"),
        cfg.embed_name: (0, "vocab"), cfg.lm_head_name: (0, "vocab")}
    out = {}
    for name, t in weights.items():
        key = next((k for k in cut if name.endswith(k)), None)
        if key is None:
            out[name] = t
            continue
        dim, span = cut[key]
        out[name] = t.narrow(dim, rows[span].start, rows[span].stop - rows[span].start)
    return out


def shard_cache(cfg, cache, tp: int, rank: int):  # noqa: ANN001, ANN201 (reference.Cache)
    """Rank `rank`'s view of a reference cache: its kv heads of every attention layer."""
    from megakernel.reference import KVLayerCache

    heads = kv_heads(cfg, tp, rank)
    layers = {i: KVLayerCache(c.k[:, heads], c.v[:, heads]) for i, c in cache.layers.items()}
    return type(cache)(cache.lengths, layers, cache.max_seq_len, cache.replay_window,
                       cache.ring_capacity, cache.pending)
