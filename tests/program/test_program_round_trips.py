"""The cost model's latency chains: each handler record's dependent global round trips, counted
by a function next to the handler's index arithmetic (kernel/*_index.py), priced one L2 hit
latency each (cost.Rates.work); attention's value batches and its bounded K/V prefetch."""

from __future__ import annotations

import dataclasses

import pytest

from megakernel.isa import Op
from megakernel.kernel.host import dense_index
from megakernel.kernel.host.dense_index import (
    ATTN_KV_LEAD_BYTES,
    ATTN_MERGE_IN_FLIGHT,
    attn_kv_lead,
    attn_merge_batch,
    attn_merge_round_trips,
    attn_round_trips,
    attn_value_batch,
)
from megakernel.kernel.host.limits import L2_PREFETCH_SHARE, LANES
from megakernel.layers import attention as attention_kind
from megakernel.models import preset
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from megakernel.program.replay import replay

TOY = gpu("h200").with_sms(16)
CTX = 32768


def _prog(model: str = "llama-tiny", context: int = CTX):  # noqa: ANN202
    cfg = dataclasses.replace(preset(model), max_position_embeddings=context + 1)
    return compile_program(cfg, 1, TOY, context=context, max_seq_len=context + 1)


def test_attention_records_carry_their_round_trips() -> None:
    prog = _prog()
    parts = [i for i in prog.instrs if i.op == Op.ATTN_PARTIAL]
    assert parts and all(i.round_trips > 0 and i.merge_round_trips > 0 for i in parts)
    # long context: the chain grows with the keys of a split
    short = [i for i in _prog(context=1024).instrs if i.op == Op.ATTN_PARTIAL]
    assert max(i.round_trips for i in parts) > 8 * max(i.round_trips for i in short)


def test_a_planted_round_trip_moves_the_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    """One more dependent round trip per chunk of keys (as one unbatched value load would add)
    makes the 32K step slower by about its latency chain; none makes it faster."""
    base = _prog().cost.predicted_s

    def planted(keys: int, *a: int, **k: int) -> int:
        return attn_round_trips(keys, *a, **k) + -(-keys // LANES)

    monkeypatch.setattr(attention_kind, "attn_round_trips", planted)
    slower = _prog().cost.predicted_s
    monkeypatch.setattr(attention_kind, "attn_round_trips", lambda *a, **k: 0)
    monkeypatch.setattr(attention_kind, "attn_merge_round_trips", lambda *a, **k: 0)
    blind = _prog().cost.predicted_s
    assert slower > base > blind
    # the planted trips of one layer's split (keys / 32 of them, 200 ns each) at least
    prog = _prog()
    split = max(i.round_trips for i in prog.instrs if i.op == Op.ATTN_PARTIAL)
    assert slower - base > 0.5 * split * 200e-9


def test_replay_charges_the_records_round_trips() -> None:
    prog = _prog()
    t0 = replay(prog).predicted_s
    for i in prog.instrs:
        if i.op == Op.ATTN_PARTIAL:
            i.round_trips += 1000
    assert replay(prog).predicted_s > t0 + 1000 * 200e-9


def test_recurrent_core_records_carry_round_trips() -> None:
    for model, op in (("qwen3.5-tiny", Op.GDN_CORE), ("nemotron-h-tiny", Op.MAMBA_CORE)):
        prog = compile_program(preset(model), 1, TOY)
        cores = [i for i in prog.instrs if i.op == op]
        assert cores and all(i.round_trips > 0 for i in cores), model


@pytest.mark.parametrize("d", [64, 128, 256])
def test_value_loads_are_batched(d: int) -> None:
    """At most 1 + 32 / VB round trips per chunk of 32 keys (one per key before), and 64 bf16
    values (32 registers) in flight per lane."""
    vb = attn_value_batch(d)
    assert LANES % vb == 0 and vb * d // LANES <= dense_index.ATTN_VALUES_IN_FLIGHT
    per_chunk = attn_round_trips(65 * LANES, d, 8, 1) - attn_round_trips(64 * LANES, d, 8, 1)
    assert per_chunk == LANES // vb <= 4
    assert attn_value_batch(d, tight=True) <= dense_index.ATTN_PAGED_VALUE_BATCH


def test_merge_loads_are_batched() -> None:
    """Attention.merge loads its partials a batch of splits at a time (attn_merge_batch): per
    query one round trip per batch of the maximum's loads, one per batch of the sums', one for
    the store (2 S + 1 before: one per split each). At the default 16 splits a query takes 4
    up to D = 128 (33 before), within ATTN_MERGE_IN_FLIGHT fp32 registers a lane."""
    for d in (64, 128, 256):
        mb, sb = attn_merge_batch(d)
        assert mb == 16 and 1 <= sb <= 8 and sb * (d // LANES + 2) <= ATTN_MERGE_IN_FLIGHT
        assert attn_merge_round_trips(16, d, 4, 1) == 1 + -(-16 // sb) + 1
    assert attn_merge_round_trips(16, 64, 4, 1) == attn_merge_round_trips(16, 128, 8, 1) == 4
    assert attn_merge_round_trips(17, 64, 4, 1) == 6
    # the records: llama-3.2-1b's 16 splits at 1K, a query a warp
    prog = compile_program(preset("llama-3.2-1b"), 1, gpu("h200"), context=1024)
    parts = [i for i in prog.instrs if i.op == Op.ATTN_PARTIAL]
    assert prog.n_splits == 16 and {i.merge_round_trips for i in parts} == {4}


def test_kv_prefetch_is_bounded_at_any_context() -> None:
    """What prefetch_kv requests before a wait (each warp share's first attn_kv_lead keys, K and
    V) fits the L2 the weights' lookahead leaves, on every SM at once, at 128K keys."""
    for d in (64, 128, 256):
        lead = attn_kv_lead(d)
        assert lead % LANES == 0 and lead * d * 2 <= max(ATTN_KV_LEAD_BYTES, LANES * d * 2)
        if lead * d * 2 <= ATTN_KV_LEAD_BYTES:  # (D = 256: one chunk, the least there is)
            per_record = 8 * 2 * lead * d * 2  # WQ <= 8 warp shares, K and V
            assert per_record * 132 <= (1 - L2_PREFETCH_SHARE) * 50e6
