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
    # qwen3-tiny (D = 128): the tensor-core partial, a wait per 16 keys of a warp's share: its
    # chain grows with the keys
    prog = _prog("qwen3-tiny")
    parts = [i for i in prog.instrs if i.op == Op.ATTN_PARTIAL]
    assert parts and all(i.round_trips > 0 and i.merge_round_trips > 0 for i in parts)
    short = [i for i in _prog("qwen3-tiny", context=1024).instrs if i.op == Op.ATTN_PARTIAL]
    assert max(i.round_trips for i in parts) > 4 * max(i.round_trips for i in short)
    keys = -(-(CTX + 1) // prog.n_splits)
    assert max(i.round_trips for i in parts) == attn_round_trips(keys, 128, 4, 1) \
        == 2 + -(-keys // 8 // 16) + 1


def test_tensor_core_partial_round_trips() -> None:
    """The tensor-core partial (llama-tiny, D = 64) waits for q, once per 32 keys of a warp's
    1 / 8 share, once for the warps' merge, once for the stores; the FMA loop once per chunk of
    its share (4 warps a query at G = 2), per value batch too."""
    assert dense_index.attn_tensor_cores(64, 2, 1) and dense_index.attn_tensor_cores(128, 4, 2)
    assert not dense_index.attn_tensor_cores(64, 1, 1, tight=True)
    assert not dense_index.attn_tensor_cores(64, 2, 1, recurrent=True)
    assert not dense_index.attn_tensor_cores(256, 1, 1)
    assert not dense_index.attn_tensor_cores(128, 4, 4) and dense_index.attn_tensor_cores(64, 4, 4)
    long_, short = _prog(), _prog(context=1024)
    for prog, ctx in ((long_, CTX), (short, 1024)):
        keys = -(-(ctx + 1) // prog.n_splits)
        trips = {i.round_trips for i in prog.instrs if i.op == Op.ATTN_PARTIAL}
        assert trips == {2 + -(-keys // 8 // 32) + 1}
    # the FMA loop (the paged build): 4 warps a query, 16 chunks, 1 + 3 value batches each
    assert attn_round_trips(64 * LANES, 64, 2, 1, tight=True) == 2 + 16 * 4
    assert attn_round_trips(64 * LANES, 64, 2, 1) == 2 + 8 + 1


def test_the_tensor_core_partial_predicts_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-3.2-1b at B = 8 and 32K (attn_tensor_cores): the FMA loop planted in its place
    predicts a slower step, its work then the partial's FMA flops; the tensor-core partial's
    records carry tensor flops and its round trips."""
    cfg = preset("llama-3.2-1b")

    def step() -> tuple[float, list]:
        prog = compile_program(cfg, 8, gpu("h200"), context=CTX, max_seq_len=CTX + 64)
        parts = [i for i in prog.instrs if i.op == Op.ATTN_PARTIAL]
        return prog.cost.predicted_s, parts

    base, parts = step()
    assert all(i.tensor_flops > 0 for i in parts)
    keys = -(-(CTX + 1) // parts[0].operands["N_SPLITS"])
    assert {i.round_trips for i in parts} == {2 + -(-keys // 8 // 32) + 1}
    monkeypatch.setattr(dense_index, "attn_tensor_cores", lambda *a, **k: False)
    monkeypatch.setattr(attention_kind, "attn_tensor_cores", lambda *a, **k: False)
    slower, planted = step()
    assert all(i.tensor_flops == 0 and i.fp32_flops > 0 for i in planted)
    assert slower > 1.2 * base


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
    vb, vt = attn_value_batch(d), attn_value_batch(d, tight=True)
    assert LANES % vb == 0 and vb * d // LANES <= dense_index.ATTN_VALUES_IN_FLIGHT
    per_chunk = (attn_round_trips(65 * LANES, d, 8, 1, tight=True)  # the paged build's loop
                 - attn_round_trips(64 * LANES, d, 8, 1, tight=True))
    assert per_chunk == LANES // vt <= 4
    if d == 256:  # the contiguous loop (neither pipelined nor on tensor cores at D = 256)
        assert (attn_round_trips(65 * LANES, d, 8, 1) - attn_round_trips(64 * LANES, d, 8, 1)
                == LANES // vb)
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
