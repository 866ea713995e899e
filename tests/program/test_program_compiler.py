"""The program compiler: one compiler for every family; dense records pinned across the redesign;
buffers, validation and the shapes real checkpoints have."""

from __future__ import annotations

import dataclasses
import hashlib
import time

import pytest
import torch

from megakernel import isa
from megakernel.isa import Op
from megakernel.models import preset, presets, real_presets
from megakernel.program.compiler import PlanError, compile_program
from megakernel.program.gpus import GPUS, GPUError, gpu
from megakernel.program.verify import check_program
from tests.registries import DENSE_FAMILIES, FAMILIES, HYBRID_TINY, TINY

TOY = gpu("h100").with_sms(8)

# sha256 of the encoded records of dense programs as compiled before the one-stack redesign
# (format 2 records, the dense compiler of that time): the redesign must not change them.
# Re-pinned once since: the cost model calibrated on published GPU measurements (bench/hindcast.py:
# latency, fixed cost, FMA efficiency, read bandwidth) changed the cost-guided schedule of
# qwen3-tiny and llama-mid (the previous parameters still reproduce all six first-pinned digests).
# And once more: the tensor-core attention partial's cost terms (dense_index.attn_tensor_cores)
# changed the cost-guided schedules of llama-mid and qwen3-0.6b (with them planted off they
# give 677a4828... and cf9f81c3... again), and the hindcast refit after it (671 ns, 1.288 us)
# llama-mid's once more.
PINNED = {(n, g, int(b), int(t)): digest for n, g, b, t, digest in map(str.split, """
llama-tiny   h100    1 1 10aaf89140e1ae6b4f9dbd299fc9814c5240fa1d1a859e28c37d54a970964eef
llama-tiny   h100/8  4 1 eeceb47f1e5a9e0c464ce91ccbea462f574e8ee3431604cb34d18c32035bb265
qwen3-tiny   h100/8  2 3 b4a43ae0aca530f66fd1c542c5f41eb4b8b50b219381a69a5dd310cf57e3a856
llama-mid    h100/16 4 2 f485b347351118da491943102cd3e5bec2af6092ec2022a884fe7e95f8e4f427
llama-3.2-1b h200    1 1 2b46752df4ad1db94a95f80b6ecda0221a398bc9bc74e361d5926969746a5da7
qwen3-0.6b   h200    8 1 4dc0dfc6f705d57cd5599a978be62923a82a17039986b8341c5dcebb2704788c
""".strip().splitlines())}


def _gpu(spec: str):  # noqa: ANN202
    name, _, sms = spec.partition("/")
    return gpu(name).with_sms(int(sms)) if sms else gpu(name)


@pytest.mark.parametrize("key", list(PINNED), ids=lambda k: f"{k[0]}-{k[1]}-B{k[2]}-T{k[3]}")
def test_dense_programs_are_pinned(key: tuple) -> None:
    name, g, b, t = key
    prog = compile_program(preset(name), b, _gpu(g), tokens=t)
    digest = hashlib.sha256(prog.records().contiguous().numpy().tobytes()).hexdigest()
    assert digest == PINNED[key]


def test_compile_is_deterministic() -> None:
    for name, kw in (("llama-tiny", {}), ("kimi-linear-tiny", {"replay_window": 3})):
        a = compile_program(preset(name), 3, TOY, tokens=2, **kw)
        b = compile_program(preset(name), 3, TOY, tokens=2, **kw)
        assert torch.equal(a.records(), b.records())
        assert a.header == b.header


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "llama-mid"])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 4), (8, 1)])
def test_small_programs_verify(name: str, batch: int, tokens: int) -> None:
    prog = compile_program(preset(name), batch, TOY, tokens=tokens)
    check_program(prog)
    ops = prog.ops_histogram()
    cfg = prog.cfg
    assert ops["QKV"] == cfg.num_layers * (cfg.num_heads + 2 * cfg.num_kv_heads)
    assert ops["ATTN_PARTIAL"] == cfg.num_layers * batch * cfg.num_kv_heads * prog.n_splits
    assert ops["ARGMAX"] == 1 and ops["EMBED"] >= 1
    assert prog.records()[:, -1, 0].eq(Op.END).all()  # every queue ends with END
    hdr = prog.header
    assert hdr["FORMAT_VERSION"] == isa.FORMAT_VERSION and hdr["N"] == batch * tokens


@pytest.mark.parametrize("name,window",
                         [(n, None) for n in TINY] + [(n, 3) for n in HYBRID_TINY])
def test_every_family_compiles_and_verifies(name: str, window: int | None) -> None:
    cfg = preset(name)
    for batch, tokens in ((1, 1), (3, 2)):
        prog = compile_program(cfg, batch, TOY, tokens=tokens, max_seq_len=64,
                               replay_window=window)
        check_program(prog)
        ops = set(prog.ops_histogram())
        if window:
            assert any(o.endswith("_REPLAY") for o in ops) and not any(
                o.endswith("_CORE") for o in ops)


def test_counter_targets_match_their_producers() -> None:
    for name in ("llama-tiny", "qwen3.5-tiny"):
        prog = compile_program(preset(name), 3, TOY)
        signals = [0] * len(prog.counters)
        for ins in prog.instrs:
            if ins.signal >= 0:
                signals[ins.signal] += 1
            if ins.op == Op.ATTN_PARTIAL and ins.operands["SPLIT"] == 0:
                signals[ins.operands["DONE_CID"]] += 1
        assert signals == [c.total for c in prog.counters]
        for i in range(len(prog.instrs)):
            d = isa.decode(prog.record(i))
            if d["WAIT_CID"] >= 0:
                assert d["WAIT_TARGET"] == d["WAIT_TOTAL"] == prog.counters[d["WAIT_CID"]].total


DENSE_REAL = [n for n in real_presets() if preset(n).family in DENSE_FAMILIES]


@pytest.mark.parametrize("name", DENSE_REAL)
def test_real_plans_are_deadlock_free(name: str) -> None:
    """Every real dense preset x GPU x B in {1, 8, 64}: coverage, counters, dataflow,
    deadlock (Qwen2, which shares the dense structure, on H200)."""
    gpus = ("h200",) if preset(name).family == "qwen2" else GPUS
    checked = []  # H100 and H200 (132 SMs each) get the same program: it is verified once
    for g in gpus:
        for batch in (1, 8, 64):
            prog = compile_program(preset(name), batch, gpu(g), policy="structure")
            if not any(p.queues == prog.queues and p.instrs == prog.instrs
                       and p.counters == prog.counters for p in checked):
                check_program(prog)
                checked.append(prog)
    assert len(checked) >= len({gpu(g).num_sms for g in gpus}) * 3


def test_kimi_plan_is_within_1_55x_of_its_floor() -> None:
    """kimi-linear-48b-a3b at B = 1 on H200: the cost model's step within 1.55x of the bytes /
    read-bandwidth floor (the routed experts charged at their expected bytes), with MLA split
    about once per SM, which beats 16 splits by more than 5%.

    The target was 1.5x (met at 1.38x) while the model charged neither the loader's wait for
    each MoE layer's router nor the handlers' dependent round trips; charging both and refitting
    the latencies puts the same schedule at 1.51x (16 splits: 1.66x). docs/PERFORMANCE.md has
    the numbers."""
    cfg = preset("kimi-linear-48b-a3b")
    prog = compile_program(cfg, 1, gpu("h200"))
    assert prog.n_splits == 64
    assert prog.cost.predicted_s <= 1.55 * prog.cost.floor_s, (prog.cost.predicted_s,
                                                              prog.cost.floor_s)
    sixteen = compile_program(cfg, 1, gpu("h200"), n_splits=16)
    assert sixteen.cost.predicted_s >= 1.05 * prog.cost.predicted_s


@pytest.mark.parametrize("name,batch,window,layers", [
    ("qwen3.5-0.8b", 1, None, None), ("qwen3.5-9b", 64, 16, None), ("nemotron-h-8b", 1, 16, None),
    ("nemotron-h-8b", 64, None, None), ("kimi-linear-48b-a3b", 1, 16, 4)])
def test_real_hybrid_plans_verify(name: str, batch: int, window: int | None,
                                  layers: int | None) -> None:
    """Real hybrid presets on H200, recurrent and ReplaySSM. Kimi keeps its first 4 layers (KDA
    with the dense MLP, KDA and MLA with the MoE, all at the real shapes): the same per layer as
    the whole model (~16k instructions at B = 1: 8 work slots + the shared expert per MoE layer)."""
    cfg = preset(name)
    if layers:
        cfg = cfg.replace(layer_types=cfg.layer_types[:layers])
    prog = compile_program(cfg, batch, gpu("h200"), policy="structure", replay_window=window)
    check_program(prog)


def test_cost_plan_of_8b_at_batch_64_is_fast_and_valid() -> None:
    t0 = time.perf_counter()
    prog = compile_program(preset("llama-3.1-8b"), 64, gpu("h200"))
    elapsed = time.perf_counter() - t0
    check_program(prog)
    assert elapsed < 20, f"planning took {elapsed:.1f} s"
    r = prog.cost
    assert r.floor_s < r.predicted_s and 0 < r.efficiency < 1


def test_hybrid_plans_verify_with_64_bit_state_offsets() -> None:
    """An fp32 state arena past 2^31 elements (qwen3.5-9b's reaches 3.4G at B = 256; here three
    GDN layers with 64 value heads of 256 x 256 states, 3.3G at B = 256, ten times fewer
    records): records carry the state offset in two words and the header its size."""
    c = preset("qwen3.5-9b")
    wide = c.replace(layer_types=("gdn", "gdn", "gdn", "attention"),
                     gdn=dataclasses.replace(c.gdn, num_v_heads=64, k_head_dim=256,
                                             v_head_dim=256))
    prog = compile_program(wide, 256, gpu("h200"), policy="structure", max_seq_len=1024)
    b = prog.buffers
    assert b.state_numel > 2**31
    assert isa.join64(prog.header["STATE_NUMEL_LO"], prog.header["STATE_NUMEL_HI"]) == \
        b.state_numel
    offsets = [isa.decode(r)["STATE"] for q in prog.records().tolist() for r in q
               if r[0] == Op.GDN_CORE]
    assert max(offsets) > 2**31
    assert max(offsets) == max(s["conv"].offset for s in b.state.values())
    check_program(prog)


# ---- shapes real checkpoints have ----------------------------------------------------------------
def test_any_vocab_size_is_served() -> None:
    cfg = preset("llama-tiny").replace(vocab_size=1001)  # not a multiple of 16
    prog = compile_program(cfg, 2, TOY)
    check_program(prog)
    lm = [i for i in prog.instrs if i.op == Op.LMHEAD]
    assert sum(i.operands["NROWS"] for i in lm) == 1008  # the padded head
    assert prog.layout["embed"].shape == (1008, cfg.hidden_size)  # tied: the embedding padded
    untied = compile_program(preset("qwen3-tiny").replace(vocab_size=1001), 1, TOY)
    assert untied.layout["lm_head"].shape[0] == 1008
    assert untied.layout["embed"].shape[0] == 1001


def test_head_dim_256_is_served() -> None:
    prog = compile_program(preset("qwen3-tiny").replace(head_dim=256), 2, TOY)
    check_program(prog)
    assert prog.header["D"] == 256
    check_program(compile_program(preset("qwen3.5-0.8b"), 1, gpu("h200"), policy="structure"))


# ---- bad input -----------------------------------------------------------------------------------
def test_plan_time_errors_name_the_problem() -> None:
    h100 = gpu("h100")
    with pytest.raises(PlanError, match="too many sequences for the cache"):
        compile_program(preset("llama-3.1-8b"), 256, h100, max_seq_len=8192)
    with pytest.raises(PlanError, match="unsupported head_dim 96"):
        compile_program(preset("llama-tiny").replace(head_dim=96), 1, TOY)
    with pytest.raises(PlanError, match="at most 256"):
        compile_program(preset("llama-tiny"), 65, TOY, tokens=4)
    with pytest.raises(PlanError, match="max_position_embeddings"):
        compile_program(preset("llama-tiny"), 1, TOY, max_seq_len=100000)
    with pytest.raises(PlanError, match="hidden_size = 200"):
        compile_program(preset("llama-tiny").replace(hidden_size=200), 1, TOY)
    with pytest.raises(PlanError, match="batch must be >= 1"):
        compile_program(preset("llama-tiny"), 0, TOY)
    with pytest.raises(PlanError, match="does not fit max sequence length"):
        compile_program(preset("llama-tiny"), 1, TOY, max_seq_len=64, context=64)
    with pytest.raises(PlanError, match="replay_window applies to models with recurrent"):
        compile_program(preset("llama-tiny"), 1, TOY, replay_window=4)
    with pytest.raises(PlanError, match="replay_window must be a positive integer"):
        compile_program(preset("qwen3.5-tiny"), 1, TOY, replay_window=0)
    with pytest.raises(GPUError, match="unknown GPU"):
        gpu("a100")


def test_presets_cover_the_tiny_models() -> None:
    """Every family has a tiny preset of all its layer kinds (tests/registries.py TINY)."""
    assert {"llama-tiny", "qwen3-tiny", "llama-mid", *TINY} <= set(presets())
    missing = sorted(set(FAMILIES) - {preset(n).family for n in TINY})
    assert not missing, f"families without a tiny preset of all their layer kinds: {missing}"


@pytest.mark.parametrize("name, tokens, n_splits", [
    ("qwen3-tiny", 1, 1), ("qwen3-tiny", 1, 3), ("qwen3-tiny", 4, 2), ("qwen3-tiny", 4, 5),
    ("qwen3-tiny", 4, 40), ("qwen3.5-tiny", 4, 3)])
def test_attention_splits_cover_every_visible_key_once(name: str, tokens: int,
                                                       n_splits: int) -> None:
    """The ATTN_PARTIAL records of each (sequence, kv head, layer) are splits 0..S-1 once each,
    and by the split rule the executor runs (executor/ops/attention.py split_keys) they cover
    every key a query token sees exactly once and no later key (causal for T > 1), for every
    cached length, including lengths shorter than S (empty splits)."""
    from megakernel.executor.ops.attention import split_keys

    batch, s_max = 2, 40
    prog = compile_program(preset(name), batch, TOY, tokens=tokens, max_seq_len=s_max,
                           n_splits=n_splits)
    recs = [isa.decode(r) for q in prog.records().tolist() for r in q if r[0] == Op.ATTN_PARTIAL]
    units: dict[tuple[int, int, int], list[int]] = {}
    for d in recs:
        assert d["N_SPLITS"] == n_splits
        units.setdefault((d["LAYER"], d["B_IDX"], d["KV_HEAD"]), []).append(d["SPLIT"])
    n_layers = sum(blk.kind == "attention" for blk in prog.cfg.blocks)
    assert len(units) == n_layers * batch * prog.cfg.kind_config("attention").num_kv_heads
    for splits in units.values():
        assert sorted(splits) == list(range(n_splits))
    for length in range(s_max - tokens + 1):
        seen = torch.zeros(tokens, s_max, dtype=torch.int64)  # [T, key]: times covered
        for s in range(n_splits):
            k0, k1, visible = split_keys(s, n_splits, length, tokens)
            assert 0 <= k0 <= k1 <= length + tokens and visible.shape == (tokens, k1 - k0)
            seen[:, k0:k1] += visible.long()
        want = (torch.arange(s_max)[None, :] <= length + torch.arange(tokens)[:, None]).long()
        assert torch.equal(seen, want), f"length {length}: keys covered {seen.tolist()}"


def test_buffer_plan_regions_are_disjoint_and_rope_is_one_region() -> None:
    prog = compile_program(preset("qwen3-tiny"), 3, TOY, tokens=2, max_seq_len=37)
    b = prog.buffers
    for arena, size in ((b.f32, b.f32_numel), (b.bf16, b.bf16_numel), (b.i32, b.i32_numel)):
        spans = sorted((r.offset, r.offset + r.numel) for r in arena.values())
        assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))
        assert spans[-1][1] <= size
    rope = b.f32["rope"]  # cos [S_max, D/2] then sin: one ROPE_OFF operand
    assert rope.shape == (2, 37, prog.cfg.head_dim // 2)
    assert prog.header["F32_ROPE_OFF"] == rope.offset
    qkv = next(i for i in prog.instrs if i.op == Op.QKV)
    assert qkv.operands["ROPE_OFF"] == rope.offset
    assert set(b.constants) == {"rope"}


def test_blocks_share_regions_sized_to_the_largest() -> None:
    """Kimi Linear: KDA and MLA blocks share the fp32 projection buffer, one per-layer table row
    each for the SSM parameters (KDA) and the routers (MoE)."""
    prog = compile_program(preset("kimi-linear-tiny"), 2, TOY)
    cfg, b = prog.cfg, prog.buffers
    from megakernel.layers.kda import KimiDeltaAttention
    from megakernel.layers.mla import MultiLatentAttention

    widths = (KimiDeltaAttention.proj_width(cfg.kda),
              -(-MultiLatentAttention.proj_rows(cfg.mla) // 16) * 16)
    assert b.f32["proj"].shape == (2, max(widths))
    assert b.f32["ssm_params"].shape[0] == len(cfg.recurrent_layers())
    assert b.f32["router"].shape[0] == sum(1 for blk in cfg.blocks if blk.kind == "moe")
    assert set(b.kv_slot) == {i for i, t in enumerate(cfg.layer_types) if t == "mla"}


@pytest.mark.parametrize("drafts", [0, 3])
def test_the_step_end_is_priced_for_the_slots_it_reads(drafts: int) -> None:
    """ARGMAX / ACCEPT read one (max, index) pair per LM-head slab and row: its cost carries the
    scheduled slab count, not the stage's upper bound of one slot per 16 head rows."""
    from megakernel.layers.base import partial_argmax_bytes

    batch, tokens = 6, 1 + drafts
    prog = compile_program(preset("llama-tiny"), batch, TOY, tokens=tokens, drafts=drafts)
    (end,) = [i for i in prog.instrs if isa.spec(i.op).ends_step]
    slabs = sum(1 for i in prog.instrs if i.op == Op.LMHEAD)
    n = batch * tokens
    assert end.operands["N_TILES"] == slabs < prog.cfg.vocab_size // 16
    extra = n * 4 + batch * 4 if drafts else 0  # ACCEPT also reads the inputs and lengths
    assert end.l2_bytes == partial_argmax_bytes(slabs, n) + extra
