"""What every layer kind answers for, checked over every (kind, block) of the tiny presets (and
the block configs no preset has, tests/layers/helpers.py VARIANTS) against the per-kind expected
values below: the refusals of configs and blocks the kernel cannot run, checkpoint shapes
against transformers, init roles, the packed keys, vectors and fp32 tables, the buffers, the KV
cache or the recurrent state (and the recurrent kinds' stages and ReplaySSM bytes), the flow,
the compiled programs' records and bytes, and one executor run per kind (and mode) against the
bf16 reference.

What only one kind does (its packed row order, its stages' operands, its header) is in its own
module, tests/layers/test_layer_<kind>.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megakernel import isa
from megakernel.layers import kind
from megakernel.layers.attention import AttentionConfig
from megakernel.layers.base import CONST, SCRATCH, StepShape
from megakernel.layers.gdn import GDNConfig
from megakernel.layers.kda import KDAConfig
from megakernel.layers.mamba2 import Mamba2Config
from megakernel.layers.mla import MLAConfig
from megakernel.layers.moe import MoEConfig
from megakernel.layers.relu2 import Relu2Config
from megakernel.layers.swiglu import SwiGLUConfig
from megakernel.models import Block, ConfigError, ModelConfig, preset
from megakernel.models.weights import random_tensor, random_weights
from megakernel.program.buffers import plan_buffers
from megakernel.program.pack import pack_weights
from megakernel.program.verify import check_program
from tests.layers.helpers import (
    LOGIT_TOL,
    TINY,
    VARIANTS,
    block_records,
    blocks_of,
    build_context,
    cases,
    executor_vs_reference,
    hf_block_tensors,
    pack_tagged,
    tiny_program,
)
from tests.registries import KINDS, KV_KINDS, RECURRENT_KINDS

TINY_BLOCKS = {  # tiny preset -> kind -> how many blocks of it
    "llama-tiny": {"attention": 2, "swiglu": 2},
    "qwen3-tiny": {"attention": 2, "swiglu": 2},
    "qwen2-tiny": {"attention": 2, "swiglu": 2},
    "qwen3.5-tiny": {"gdn": 3, "attention": 1, "swiglu": 4},
    "kimi-linear-tiny": {"kda": 2, "swiglu": 1, "mla": 1, "moe": 2},
    "nemotron-h-tiny": {"mamba2": 2, "relu2": 2, "attention": 1},
}


# ---- the per-kind expected values ----------------------------------------------------------------
# kind -> init role of each checkpoint tensor (what a block's config adds or drops: `roles_of`)
ROLES: dict[str, dict[str, str]] = {
    "attention": {"q_proj.weight": "qk_proj", "k_proj.weight": "qk_proj",
                  "v_proj.weight": "proj", "o_proj.weight": "out"},
    "swiglu": {"gate_proj.weight": "proj", "up_proj.weight": "proj", "down_proj.weight": "out"},
    "relu2": {"up_proj.weight": "proj", "down_proj.weight": "out"},
    "gdn": {"in_proj_qkv.weight": "proj", "in_proj_z.weight": "proj", "in_proj_b.weight": "proj",
            "in_proj_a.weight": "proj", "conv1d.weight": "conv", "dt_bias": "dt_bias",
            "A_log": "A_log", "norm.weight": "norm_plain", "out_proj.weight": "out"},
    "kda": {**{f"{n}_proj.weight": "proj" for n in ("q", "k", "v", "f_a", "f_b", "b", "g_a",
                                                    "g_b")},
            **{f"{n}_conv1d.weight": "conv" for n in "qkv"},
            "dt_bias": "dt_bias", "A_log": "A_log", "o_norm.weight": "norm_plain",
            "o_proj.weight": "out"},
    "mamba2": {"in_proj.weight": "proj", "conv1d.weight": "conv", "conv1d.bias": "bias",
               "dt_bias": "dt_bias", "A_log": "A_log", "D": "D", "norm.weight": "norm_plain",
               "out_proj.weight": "out"},
    "mla": {"q_proj.weight": "proj", "kv_a_proj_with_mqa.weight": "proj",
            "kv_a_layernorm.weight": "norm_plain", "kv_b_proj.weight": "proj",
            "o_proj.weight": "out"},
    "moe": {"gate.weight": "proj", "gate.e_score_correction_bias": "bias",
            "shared_experts.gate_proj.weight": "proj", "shared_experts.up_proj.weight": "proj",
            "shared_experts.down_proj.weight": "out"},
}
RECURRENT_FP32 = {"A_log", "D", "dt_bias"}
ROUTER_FP32 = {"gate.weight", "gate.e_score_correction_bias"}
# kind -> (the tensors transformers keeps in fp32, the kind's fp32_params); none when not listed
FP32 = {"gdn": (set(), RECURRENT_FP32), "kda": ({"dt_bias"}, RECURRENT_FP32),
        "mamba2": (set(), RECURRENT_FP32), "moe": (ROUTER_FP32, ROUTER_FP32)}
# kind -> its packed vectors, in order (an attention block with q/k norms adds qk_norm)
VECTORS = {"attention": [], "swiglu": [], "relu2": [], "gdn": ["out_norm", "conv"],
           "kda": ["out_norm", "conv"], "mamba2": ["out_norm", "conv"],
           "mla": ["lat_norm", "kvb"], "moe": []}
# kind -> (its fp32 table region, the checkpoint tensors it holds in order); none when not listed
TABLES = {"gdn": ("ssm_params", ["A_log", "dt_bias"]), "kda": ("ssm_params", ["A_log", "dt_bias"]),
          "mamba2": ("ssm_params", ["A_log", "D", "dt_bias"]),
          "moe": ("router", ["gate.weight", "gate.e_score_correction_bias"])}
# kind -> per sequence, its K and V cache entries' [heads, width] (a position is the third dim)
KV: dict[str, Callable[[Any], tuple[tuple[int, int], tuple[int, int]]]] = {
    "attention": lambda c: ((c.num_kv_heads, c.head_dim),) * 2,
    "mla": lambda c: ((1, c.kv_lora_rank), (1, c.qk_rope_head_dim)),
}


@dataclass(frozen=True)
class Recurrent:
    """A recurrent kind: its tiny preset, the block kinds of that preset cut to one layer of the
    kind, the prefix of its core opcodes, the step token counts its ReplaySSM bytes are checked
    at; from its config, (proj rows, out dim, fp32 parameters, units) and (conv channels, state
    shape per sequence, ReplaySSM ring entries)."""

    preset: str
    one_layer: str
    core: str
    tokens: tuple[int, ...]
    sizes: Callable[[Any], tuple[int, int, int, int]]
    state: Callable[[Any], tuple[int, tuple[int, ...], list[tuple[str, tuple[int, ...]]]]]


RECURRENT = {
    "gdn": Recurrent(
        "qwen3.5-tiny", "gdn swiglu", "GDN", (1, 2),
        lambda c: (c.conv_dim + c.value_dim + 2 * c.num_v_heads, c.value_dim, 2 * c.num_v_heads,
                   c.num_k_heads),
        lambda c: (c.conv_dim, (c.num_v_heads, c.k_head_dim, c.v_head_dim),
                   [("k", (c.num_k_heads, c.k_head_dim)), ("u", (c.num_v_heads, c.v_head_dim)),
                    ("g", (c.num_v_heads,))])),
    "kda": Recurrent(
        "kimi-linear-tiny", "kda swiglu", "KDA", (1,),
        lambda c: (3 * c.num_heads * c.head_dim + 2 * c.head_dim + c.num_heads,
                   c.num_heads * c.head_dim, c.num_heads + c.num_heads * c.head_dim, c.num_heads),
        lambda c: (3 * c.num_heads * c.head_dim, (c.num_heads, c.head_dim, c.head_dim),
                   [(n, (c.num_heads, c.head_dim)) for n in "kug"])),
    "mamba2": Recurrent(
        "nemotron-h-tiny", "mamba2", "MAMBA", (1,),
        lambda c: (c.in_proj_size, c.d_inner, 3 * c.num_heads, c.n_groups),
        lambda c: (c.conv_dim, (c.num_heads, c.head_dim, c.state_size),
                   [("x", (c.num_heads, c.head_dim)), ("B", (c.n_groups, c.state_size)),
                    ("dt", (c.num_heads,))])),
}


def mode_op(kind_name: str, window: int | None) -> str:
    """The core opcode of a recurrent kind: its recurrent update, or with a window its replay."""
    return RECURRENT[kind_name].core + ("_REPLAY" if window else "_CORE")


def flow_of(kind_name: str) -> tuple[dict[str, Any], str]:
    """(the kind's flow: opcode -> what it waits on, its out_op), as documented."""
    if kind_name in RECURRENT:
        core, replay = mode_op(kind_name, None), mode_op(kind_name, 4)
        return {"PROJ": None, core: "PROJ", replay: "PROJ", "OPROJ": (core, replay)}, "OPROJ"
    return {
        "attention": ({"QKV": None, "ATTN_PARTIAL": "QKV", "OPROJ": "ATTN_PARTIAL"}, "OPROJ"),
        "swiglu": ({"GATEUP": None, "DOWN": "GATEUP"}, "DOWN"),
        "relu2": ({"UP_RELU2": None, "DOWN": "UP_RELU2"}, "DOWN"),
        "mla": ({"PROJ": None, "MLA_Q": "PROJ", "MLA": "MLA_Q", "MLA_O": "MLA",
                 "OPROJ": "MLA_O"}, "OPROJ"),
        "moe": ({"ROUTER_SCORE": None, "ROUTER": "ROUTER_SCORE", "EXPERT_GATEUP": "ROUTER",
                 "EXPERT_DOWN": "EXPERT_GATEUP", "MOE_COMBINE": "EXPERT_DOWN"}, "MOE_COMBINE"),
    }[kind_name]


def roles_of(blk: Block) -> dict[str, str]:
    """ROLES of the block's kind, with what its config adds (q/k norms, biases, experts) or
    drops (a conv bias, the shared expert)."""
    c, want = blk.cfg, dict(ROLES[blk.kind])
    if blk.kind == "attention":
        want.update({f"{p}_norm.weight": "qk_norm" for p in "qk"} if c.qk_norm else {})
        want.update({f"{p}_proj.bias": "bias" for p in "qkv"} if c.qkv_bias else {})
    elif blk.kind == "mamba2" and not c.use_conv_bias:
        del want["conv1d.bias"]
    elif blk.kind == "moe":
        want = {k: v for k, v in want.items()
                if c.num_shared_experts or not k.startswith("shared_experts.")}
        for x in range(c.num_experts):
            want.update({f"experts.{x}.w1.weight": "proj", f"experts.{x}.w3.weight": "proj",
                         f"experts.{x}.w2.weight": "out"})
    return want


def needs_of(blk: Block, model: ModelConfig, shape: StepShape
             ) -> dict[tuple[str, str], tuple[tuple[int, ...], str, bool, bool, str | None]]:
    """(arena, name) -> (shape, group, const, persistent, table) of each buffer the block needs
    at `shape` (N = 6 rows, B = 3 sequences, S = 40, 5 splits)."""
    c, k, n, h = blk.cfg, blk.kind, shape.rows, model.hidden_size
    if k == "attention":
        hq, d = c.num_heads, c.head_dim
        want = {("f32", "part_o"): ((5, n, hq, d), SCRATCH, False, False, None),
                ("f32", "part_ml"): ((5, n, hq, 2), SCRATCH, False, False, None),
                ("bf16", "q"): ((n, hq, d), SCRATCH, False, False, None),
                ("bf16", "attn"): ((n, hq * d), SCRATCH, False, False, None)}
        if c.output_gate:
            want["f32", "gate"] = ((n, hq, d), SCRATCH, False, False, None)
        if c.rotary_dim:
            want["f32", "rope"] = ((2, 40, c.rotary_dim // 2), CONST, True, False, None)
        return want
    if k in ("swiglu", "relu2"):
        return {("bf16", "act"): ((n, c.intermediate_size), SCRATCH, False, False, None)}
    if k in RECURRENT:
        proj_rows, out_dim, n_params, units = RECURRENT[k].sizes(c)
        return {("f32", "proj"): ((n, -(-proj_rows // 16) * 16), SCRATCH, False, False, None),
                ("bf16", "ssm_out"): ((n, out_dim), SCRATCH, False, False, None),
                ("f32", "ssm_params"): ((n_params,), CONST, True, False, "rec"),
                ("i32", "ring_count"): ((3, units), SCRATCH, False, True, "rec")}
    if k == "mla":
        width = -(-(c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim) + c.kv_lora_rank
                    + c.qk_rope_head_dim) // 16) * 16
        hr, s = (c.num_heads, c.kv_lora_rank), shape.n_splits  # absorbed decode's scratch
        return {("f32", "proj"): ((n, width), SCRATCH, False, False, None),
                ("f32", "qlat"): ((n, *hr), SCRATCH, False, False, None),
                ("f32", "part_o"): ((s, n, *hr), SCRATCH, False, False, None),
                ("f32", "part_ml"): ((s, n, c.num_heads, 2), SCRATCH, False, False, None),
                ("bf16", "attn"): ((n, c.num_heads * c.v_head_dim), SCRATCH, False, False, None)}
    return {("f32", "router"): ((c.num_experts * h + c.num_experts,), CONST, True, False, "moe"),
            ("f32", "moe_scores"): ((n, c.num_experts), SCRATCH, False, False, None),
            ("f32", "moe_w"): ((n, c.top_k), SCRATCH, False, False, None),
            ("f32", "moe_y"): ((n, c.slots, h), SCRATCH, False, False, None),
            ("bf16", "act_moe"): ((n, c.slots, c.intermediate_size), SCRATCH, False, False, None),
            ("i32", "moe_ids"): ((n, c.top_k), SCRATCH, False, False, None),
            ("i32", "moe_work"): ((min(c.num_experts, n * c.top_k), 2 + n), SCRATCH, False,
                                  False, None)}


def coverage_of(blk: Block, prog: Any) -> dict[str, int]:
    """The units each `coverage` opcode of the block covers once: (sequence, kv head, split)
    partials, (sequence, unit) cores, MLA's heads (MLA_Q, MLA_O) and (sequence, split) partials,
    the router logits' experts, the router once and the combine's columns of h."""
    c, k, b = blk.cfg, blk.kind, prog.batch
    if k in RECURRENT:
        return {mode_op(k, prog.replay_window): b * RECURRENT[k].sizes(c)[3]}
    return {"attention": lambda: {"ATTN_PARTIAL": b * c.num_kv_heads * prog.n_splits},
            "mla": lambda: {"MLA_Q": c.num_heads, "MLA": b * prog.n_splits,
                            "MLA_O": c.num_heads},
            "moe": lambda: {"ROUTER_SCORE": c.num_experts, "ROUTER": 1,
                            "MOE_COMBINE": prog.cfg.hidden_size}}.get(k, dict)()


def step_bytes_of(blk: Block, prog: Any) -> dict[str, int]:
    """The block's bytes besides its slabs: KV read over the context and written for the N new
    positions (bf16), MLA's kv_b once per step (absorbed: W_UK by MLA_Q, W_UV by MLA_O), MoE's
    fp32 router row (the recurrent kinds': test_replay_writes_the_state_once_per_window)."""
    c, k, b = blk.cfg, blk.kind, prog.batch
    if k == "attention":
        row = c.num_kv_heads * c.head_dim * 2 * 2
        return {"kv_read": b * prog.context * row, "kv_written": prog.rows * row}
    if k == "mla":
        kvb = c.num_heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank * 2
        row = (c.kv_lora_rank + c.qk_rope_head_dim) * 2
        return {"weights": kvb, "kv_read": b * prog.context * row,
                "kv_written": prog.rows * row}
    if k == "moe":
        return {"weights": (c.num_experts * prog.cfg.hidden_size + c.num_experts) * 4}
    return {}


# config -> the message it is refused with: shapes no kind can hold
CONFIG_REFUSALS: dict[str, tuple[Callable[[], Any], str]] = {
    "attention-heads": (lambda: AttentionConfig(6, 4, 64), "multiple of num_kv_heads"),
    "attention-rotary-66": (lambda: AttentionConfig(4, 2, 64, rotary_dim=66), "rotary_dim"),
    "attention-rotary-15": (lambda: AttentionConfig(4, 2, 64, rotary_dim=15), "rotary_dim"),
    "swiglu-size": (lambda: SwiGLUConfig(0), "intermediate_size"),
    "relu2-size": (lambda: Relu2Config(-16), "intermediate_size"),
    "gdn-heads": (lambda: GDNConfig(3, 4, 16, 16), "multiple of"),
    "gdn-conv": (lambda: GDNConfig(2, 4, 16, 16, conv_kernel=1), "conv.kernel must be"),
    "kda-conv": (lambda: KDAConfig(2, 16, conv_kernel=1), "conv.kernel must be"),
    "kda-head-dim": (lambda: KDAConfig(2, 0), "head_dim"),
    "mamba2-groups": (lambda: Mamba2Config(6, 8, 16, 4), "multiple of n_groups"),
    "mamba2-conv": (lambda: Mamba2Config(8, 8, 16, 2, conv_kernel=1), "conv.kernel must be"),
    "mla-lora": (lambda: MLAConfig(4, 32, 16, 8, 16, q_lora_rank=0), "q_lora_rank"),
    "moe-groups": (lambda: MoEConfig(7, 2, 32, n_group=2), "multiple of n_group"),
    "moe-group-size": (lambda: MoEConfig(4, 1, 32, n_group=4), "at least 2 experts per group"),
    "moe-topk-group": (lambda: MoEConfig(8, 2, 32, n_group=2, topk_group=3), "topk_group"),
    "moe-topk": (lambda: MoEConfig(8, 5, 32, n_group=2, topk_group=1), "exceeds"),
    "moe-shared": (lambda: MoEConfig(8, 2, 32, num_shared_experts=-1), "num_shared_experts"),
}
# kind -> block configs its `check` refuses in the tiny preset's model: what the kernel cannot run
CHECK_REFUSALS: dict[str, list[tuple[Any, str]]] = {
    "attention": [(AttentionConfig(4, 2, 96), "head_dim 96")],
    "swiglu": [(SwiGLUConfig(40), "multiple of 16")],
    "relu2": [(Relu2Config(24), "multiple of 16")],
    "moe": [(MoEConfig(8, 2, 32, 2), "at most one"), (MoEConfig(8, 2, 40), "multiple of 16")],
}


def test_every_kind_and_tiny_preset_has_its_expected_values() -> None:
    """The tables above have an entry for every registered kind (RECURRENT for every recurrent
    kind, KV for every kind with a KV cache), TINY_BLOCKS for every tiny preset, and the
    executor runs every kind."""
    for table, what in ((ROLES, "ROLES"), (VECTORS, "VECTORS")):
        assert sorted(table) == sorted(KINDS), f"{what}: one entry per layer kind {KINDS}"
    assert sorted(RECURRENT) == sorted(RECURRENT_KINDS), (
        f"RECURRENT: one entry per recurrent kind {RECURRENT_KINDS}")
    assert sorted(KV) == sorted(KV_KINDS), f"KV: one entry per KV-cache kind {KV_KINDS}"
    assert set(FP32) | set(TABLES) <= set(KINDS)
    assert sorted(TINY_BLOCKS) == sorted(TINY), f"TINY_BLOCKS: one entry per tiny preset {TINY}"
    for name in TINY:
        assert Counter(b.kind for b in preset(name).blocks) == TINY_BLOCKS[name], name
    for k, r in RECURRENT.items():
        assert r.preset in TINY and preset(r.preset).has_kind(k), (k, r.preset)
    ran = {k for case in EXECUTOR.values() for k in case[2].split()}
    assert set(KINDS) <= ran, f"kinds without an EXECUTOR case: {sorted(set(KINDS) - ran)}"


# ---- checkpoint ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "blk"), cases(*KINDS, variants=False))
def test_shapes_match_transformers(cfg: ModelConfig, blk: Block) -> None:
    """The kind accepts the block; its checkpoint shapes are the transformers module's; the
    tensors transformers keeps in fp32 are the listed ones, all of them fp32 parameters of the
    kind."""
    kd, hf = kind(blk.kind), hf_block_tensors(cfg, blk)
    kd.check(blk, cfg)  # the kernel runs the preset's block
    assert kd.shapes(blk, cfg) == {n: s for n, (s, _) in hf.items()}
    hf32, ours = FP32.get(blk.kind, (set(), set()))
    assert {n for n, (_, dt) in hf.items() if dt == torch.float32} == hf32
    assert hf32 <= set(kd.fp32_params) and set(kd.fp32_params) == ours


@pytest.mark.parametrize("case", sorted(CONFIG_REFUSALS))
def test_config_refuses_unsupported_shapes(case: str) -> None:
    make, needle = CONFIG_REFUSALS[case]
    with pytest.raises(ConfigError, match=needle):
        make()


@pytest.mark.parametrize(("kind_name", "bad", "needle"),
                         [(k, c, n) for k, refused in CHECK_REFUSALS.items() for c, n in refused])
def test_check_refuses_what_the_kernel_does_not_run(kind_name: str, bad: Any, needle: str
                                                    ) -> None:
    cfg, blk = blocks_of(kind_name)[0]
    with pytest.raises(ConfigError, match=needle):
        kind(kind_name).check(dataclasses.replace(blk, cfg=bad), cfg)


@pytest.mark.parametrize(("cfg", "blk"), cases(*KINDS))
def test_init_roles(cfg: ModelConfig, blk: Block) -> None:
    """Every checkpoint tensor of the block has a role `random_tensor` draws, the listed tensors
    the listed roles."""
    kd = kind(blk.kind)
    gen = torch.Generator().manual_seed(0)
    roles = {}
    for local, shape in kd.shapes(blk, cfg).items():
        roles[local] = kd.init_role(local, blk)
        t = random_tensor(cfg, roles[local], shape, gen)  # raises on an unknown role
        assert tuple(t.shape) == tuple(shape) and bool(torch.isfinite(t).all()), local
    want = roles_of(blk)
    assert {k: roles[k] for k in want} == want


@pytest.mark.parametrize(("cfg", "blk"), cases(*KINDS))
def test_pack_produces_the_declared_keys(cfg: ModelConfig, blk: Block) -> None:
    """Every key of `vectors` + `matrices` is packed, with the declared shape, and nothing else;
    the vectors and the fp32 tables are the kind's."""
    kd = kind(blk.kind)
    declared = {item[0]: tuple(item[1]) for item in kd.vectors(blk, cfg) + kd.matrices(blk, cfg)}
    w, packed = pack_tagged(blk, cfg)
    assert {k: tuple(t.shape) for k, t in packed.items()} == declared
    qk_norm = ["qk_norm"] if blk.kind == "attention" and blk.cfg.qk_norm else []
    assert [v[0] for v in kd.vectors(blk, cfg)] == VECTORS[blk.kind] + qk_norm
    region = [TABLES[blk.kind][0]] if blk.kind in TABLES else []
    assert list(kd.tables(blk, cfg, w.__getitem__)) == region


def _fine_fp32(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """fp32 tensors of `shapes` holding values bf16 cannot represent (1 + k 2^-20): a table that
    went through bf16 on the way would lose them."""
    out = {}
    for i, (name, s) in enumerate(shapes.items()):
        k = torch.arange(math.prod(s), dtype=torch.float32) + 1 + 100 * i
        out[name] = (1.0 + k * 2.0 ** -20).view(s)
    return out


@pytest.mark.parametrize("kind_name", sorted(TABLES))
def test_tables_are_fp32_in_order(kind_name: str) -> None:
    """pack_weights keeps the layer's table in fp32: the named checkpoint tensors, flattened, in
    order (values bf16 cannot hold survive); one table per block of the kind."""
    region, order = TABLES[kind_name]
    cfg = preset(RECURRENT[kind_name].preset if kind_name in RECURRENT else "kimi-linear-tiny")
    w = random_weights(cfg, seed=1, dtype=torch.float32)
    blocks = [b for b in cfg.blocks if b.kind == kind_name]
    for blk in blocks:
        w.update(_fine_fp32({blk.prefix + n: tuple(w[blk.prefix + n].shape) for n in order}))
    packed = pack_weights(cfg, w)
    for blk in blocks:
        t = packed.tables[(region, blk.layer)]
        want = torch.cat([w[blk.prefix + n].reshape(-1) for n in order])
        assert t.dtype == torch.float32 and torch.equal(t, want), blk.key
    assert sorted(k for k in packed.tables if k[0] == region) == sorted(
        (region, b.layer) for b in blocks)


# ---- buffers -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "blk"), cases(*KINDS))
def test_needs(cfg: ModelConfig, blk: Block) -> None:
    shape = StepShape(3, 2, 40, 5, 8, 0)
    got = {(nd.arena, nd.name): (nd.shape, nd.group, nd.const, nd.persistent, nd.table)
           for nd in kind(blk.kind).needs(blk, cfg, shape)}
    assert got == needs_of(blk, cfg, shape)


@pytest.mark.parametrize(("cfg", "blk"), cases(*KINDS))
def test_cache_and_state_kinds(cfg: ModelConfig, blk: Block) -> None:
    """A KV-cache kind keeps no state, a recurrent kind no cache, an MLP neither; only attention
    has constants (its RoPE tables: test_layer_attention.py)."""
    kd = kind(blk.kind)
    assert (kd.kv_cache, kd.recurrent) == (blk.kind in KV, blk.kind in RECURRENT)
    if not kd.recurrent:
        assert all(kd.state(blk, cfg, 3, cap) == [] for cap in (0, 4, 5))
    if blk.kind != "attention":
        assert kd.constants(blk, cfg, StepShape(3, 2, 40, 2, 8, 0)) == {}


@pytest.mark.parametrize(("cfg", "blk"), cases(*KV_KINDS, variants=False))
def test_kv_cache_one_slot_per_layer(cfg: ModelConfig, blk: Block) -> None:
    """The kind's K and V entries [B, heads, S, width]; the buffer plan gives each of its layers
    one slot, in order."""
    (kh, kw), (vh, vw) = KV[blk.kind](blk.cfg)
    assert kind(blk.kind).kv(blk, cfg, 3, 40) == ((3, kh, 40, kw), (3, vh, 40, vw))
    buf = plan_buffers(cfg, StepShape(3, 2, 40, 2, 8, 0))
    layers = [b.layer for b in cfg.blocks if b.kind == blk.kind]
    assert buf.kv_slot == {layer: i for i, layer in enumerate(layers)}
    assert buf.kv_shape == (len(layers), 3, kh, 40, kw)
    assert buf.v_shape == (len(layers), 3, vh, 40, vw)


@pytest.mark.parametrize(("cfg", "blk"), cases(*RECURRENT_KINDS, variants=False))
def test_recurrent_state(cfg: ModelConfig, blk: Block) -> None:
    """conv [B, C, K-1], state [B, ...], and only with a ReplaySSM ring its entries
    [B, cap, ...]; the buffer plan lays them out layer by layer, contiguously."""
    kd, k = kind(blk.kind), blk.cfg.conv_kernel
    conv_dim, state, ring = RECURRENT[blk.kind].state(blk.cfg)
    base = [("conv", (3, conv_dim, k - 1)), ("state", (3, *state))]
    assert kd.state(blk, cfg, 3, 0) == base
    assert kd.state(blk, cfg, 3, 5) == base + [(n, (3, 5, *s)) for n, s in ring]
    assert kd.ring_shapes(blk.cfg) == ring
    for cap in (0, 5):
        buf = plan_buffers(cfg, StepShape(3, 1, 40, 2, 8, cap))
        off = 0
        assert list(buf.state) == cfg.recurrent_layers()
        for layer, regs in buf.state.items():
            b = next(x for x in cfg.blocks if x.layer == layer and kind(x.kind).recurrent)
            assert [(n, r.shape) for n, r in regs.items()] == kind(b.kind).state(b, cfg, 3, cap)
            for r in regs.values():
                assert r.offset == off
                off += r.numel
        assert buf.state_numel == off and buf.ring_cap == cap


# ---- program -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind_name", KINDS)
def test_flow_is_registered_to_the_kind_or_the_frame(kind_name: str) -> None:
    """The kind's flow as documented; every opcode in it registered, owned by the kind or the
    frame; its out_op in it."""
    kd, (flow, out_op) = kind(kind_name), flow_of(kind_name)
    assert kd.flow == flow and kd.out_op == out_op and out_op in flow
    for name in flow:
        assert isa.spec(getattr(isa.Op, name)).kind in (kind_name, "frame"), name


@pytest.mark.parametrize(("window", "kind_name"),
                         [(w, k) for k in RECURRENT_KINDS for w in (None, 4)],
                         ids=[f"{k}-{m}" for k in RECURRENT_KINDS
                              for m in ("recurrent", "replay4")])
def test_recurrent_stages(window: int | None, kind_name: str) -> None:
    """The last block of the kind (its rows of the per-layer tables are not the first): PROJ (its
    rows in slabs of 16, OUT_W the padded width), one core record per (sequence, unit) naming the
    layer's buffers, then out_proj."""
    model = preset(RECURRENT[kind_name].preset)
    blk = [b for b in model.blocks if b.kind == kind_name][-1]
    kd, c = kind(kind_name), blk.cfg
    ctx = build_context(model, batch=3, window=window)
    (proj, cr, o), end = kd.stages(blk, ctx, wait=-1)
    width = kd.proj_width(c)
    assert width % 16 == 0 and width - 16 < kd.proj_rows(c) <= width
    assert (proj.op, proj.units, proj.divisible) == (isa.Op.PROJ, width // 16, True)
    p = proj.make(0, proj.units).operands
    assert p["OUT_W"] == width and p["NORM_OFF"] == ctx.lay[f"{blk.key}.norm"].offset
    assert p["OUT_OFF"] == ctx.buf.f32["proj"].offset
    units = kd.units(c)
    assert (cr.op, cr.units, cr.divisible) == (getattr(isa.Op, mode_op(kind_name, window)),
                                               3 * units, False)
    buf, row = ctx.buf, ctx.buf.row("rec", blk.layer)
    assert row == model.recurrent_layers().index(blk.layer)  # rows in block order
    for u in (0, 3 * units - 1):
        d = cr.make(u, u + 1).operands
        assert (d["B_IDX"], d[kd.unit_name]) == divmod(u, units)
        assert d["PROJ_OFF"] == buf.f32["proj"].offset
        assert d["CONV_W"] == ctx.lay[f"{blk.key}.conv"].offset
        assert d["NORM_W"] == ctx.lay[f"{blk.key}.out_norm"].offset
        assert d["PARAM_OFF"] == buf.f32["ssm_params"].offset + row * kd.n_params(c)
        assert d["STATE"] == buf.state[blk.layer]["conv"].offset
        assert d["OUT_OFF"] == buf.bf16["ssm_out"].offset
        cnt = buf.i32["ring_count"]
        assert d.get("COUNT_OFF") == (cnt.offset + row * 3 * cnt.shape[2] if window else None)
    assert (o.op, o.units) == (isa.Op.OPROJ, model.hidden_size // 16)
    assert o.make(0, 1).operands["K"] == kd.out_dim(c)
    assert end == ctx.ctr.ids[f"L{blk.layer}.oproj"]


PROGRAMS = [(n, k, None) for n in TINY for k in dict.fromkeys(b.kind for b in preset(n).blocks)
            ] + [(r.preset, k, 4) for k, r in RECURRENT.items()]


@pytest.mark.parametrize(("name", "kind_name", "window"), PROGRAMS,
                         ids=[f"{n}-{k}" + ("-replay4" if w else "") for n, k, w in PROGRAMS])
def test_program_records_and_bytes(name: str, kind_name: str, window: int | None) -> None:
    """The program verifies; every block of the kind runs its flow (a recurrent kind the core
    opcode of its mode); each `coverage` opcode covers its units once; the bytes are the
    expected ones and agree with the records."""
    prog = tiny_program(name, window=window)
    check_program(prog)
    kd = kind(kind_name)
    blocks = [b for b in prog.cfg.blocks if b.kind == kind_name]
    assert len(blocks) == TINY_BLOCKS[name][kind_name]
    ops = {"PROJ", mode_op(kind_name, window), "OPROJ"} if kind_name in RECURRENT else set(kd.flow)
    for blk in blocks:
        recs = block_records(prog, blk)
        assert {d["OPCODE"].name for d in recs} == ops
        want = coverage_of(blk, prog)
        assert kd.coverage(blk, prog) == want
        got: dict[str, list[tuple[int, int]]] = {op: [] for op in want}
        for d in recs:
            if d["OPCODE"].name in want:
                got[d["OPCODE"].name].append(kd.cover(d, blk, prog))
        for op, units in want.items():  # `cover` maps the records onto [0, units) once
            spans = sorted(got[op])
            assert spans and all(hi > lo for lo, hi in spans), op
            flat = [u for lo, hi in spans for u in range(lo, hi)]
            assert flat == list(range(units)), f"{op}: units {flat}, expected 0..{units - 1} once"
        cats = kd.step_bytes(blk, prog)
        if kind_name not in RECURRENT:
            assert cats == step_bytes_of(blk, prog)
        # the read side of step_bytes is what the block's instructions without a slab stream
        ours = [i for i in prog.instrs if i.layer == blk.layer and isa.spec(i.op).name in kd.flow]
        read = sum(v for k, v in cats.items() if not k.endswith("_written"))
        assert read == pytest.approx(sum(i.w_bytes + i.hbm_bytes for i in ours
                                         if not isa.spec(i.op).slab), abs=1.0)
        if kind_name != "moe":  # the slabs stream each packed matrix once (MoE: test_layer_moe)
            want_slabs = sum(2 * math.prod(m[1]) for m in kd.matrices(blk, prog.cfg)
                             if not (len(m) > 2 and m[2]))  # an entry after its matrix: a bias
            assert sum(i.w_bytes for i in ours if isa.spec(i.op).slab) == want_slabs


@pytest.mark.parametrize(("kind_name", "tokens"),
                         [(k, t) for k, r in RECURRENT.items() for t in r.tokens])
def test_replay_writes_the_state_once_per_window(kind_name: str, tokens: int) -> None:
    """ReplaySSM (window 4): the state is read as often as by the recurrent update and written at
    one step in 4 / T; T ring entries are appended per step; the conv window moves alike; a core
    streams its share of the packed conv vector (the whole vector once per sequence). The core
    records' stores add up to the same."""
    window, name = 4, RECURRENT[kind_name].preset
    rec, rep = (tiny_program(name, tokens=tokens, window=w) for w in (None, window))
    kd = kind(kind_name)
    for blk in (b for b in rec.cfg.blocks if b.kind == kind_name):
        a, b = kd.step_bytes(blk, rec), kd.step_bytes(blk, rep)
        conv = math.prod(rec.layout[f"{blk.key}.conv"].shape)
        assert a["weights"] == b["weights"] == rec.batch * conv * 2
        assert a["state_read"] == b["state_read"] > 0
        assert a["state_written"] == a["state_read"]
        assert b["state_written"] == int(a["state_written"] * tokens / window)
        assert a["conv_read"] == a["conv_written"] == b["conv_read"] == b["conv_written"] > 0
        units, entry = kd.units(blk.cfg), kd.entry_bytes(blk.cfg)
        assert b["ring_written"] == rep.rows * units * entry
        # the count before a step runs 0, 1, 2, 3 (T = 1) or 0, 2 (T = 2): committed entries read
        held = {1: 1.5, 2: 1.0}[tokens]
        assert b["ring_read"] == rep.batch * units * int(held * entry)
        assert "ring_read" not in a and "ring_written" not in a
        for prog, cats in ((rec, a), (rep, b)):
            core = [i for i in prog.instrs if i.layer == blk.layer
                    and isa.spec(i.op).name.endswith(("_CORE", "_REPLAY"))]
            want = (cats["state_written"] + cats["conv_written"] + cats.get("ring_written", 0)
                    + prog.rows * kd.out_dim(blk.cfg) * 2)
            assert sum(i.store_bytes for i in core) == pytest.approx(want, abs=len(core))


# ---- executor ------------------------------------------------------------------------------------
EXECUTOR = {  # id -> (preset or VARIANTS model, changes, the model's block kinds, tokens, window)
    "attention-qwen2": ("qwen2-tiny", {"num_layers": 1}, "attention swiglu", 2, None),  # biases
    "attention-qwen3.5": ("qwen3.5-tiny", {"layer_types": ("attention",)}, "attention swiglu", 1,
                          None),  # gate, partial RoPE, (1 + w) norms
    "attention-nemotron-h": ("nemotron-h-tiny", {"layer_types": ("attention", "mlp")},
                             "attention relu2", 1, None),  # no RoPE
    "attention-gated-biased": ("gated-biased", {}, "attention swiglu", 2, None),
    "swiglu": ("llama-tiny", {"num_layers": 1}, "attention swiglu", 1, None),
    "relu2": ("nemotron-h-tiny", {"layer_types": ("mlp",)}, "relu2", 1, None),
    "mla": ("kimi-linear-tiny", {"layer_types": ("mla",)}, "mla swiglu", 2, None),
    "moe": ("kimi-linear-tiny", {"layer_types": ("mla",), "first_k_dense": 0}, "mla moe", 2, None),
    **{f"{k}-{mode}": (r.preset, {"layer_types": (k,)}, r.one_layer, 1, window)
       for k, r in RECURRENT.items() for mode, window in (("recurrent", None), ("replay2", 2))},
}


@pytest.mark.parametrize("case", sorted(EXECUTOR))
def test_executor_matches_the_reference(case: str) -> None:
    """One or two steps on the executor give the bf16 reference's logits and greedy tokens (the
    attention flavours, T = 2 causal among themselves, the ReplaySSM modes)."""
    name, changes, kinds, tokens, window = EXECUTOR[case]
    cfg = VARIANTS[name]()[0] if name in VARIANTS else preset(name).replace(**changes)
    assert [b.kind for b in cfg.blocks] == kinds.split()
    assert executor_vs_reference(cfg, window=window, tokens=tokens) <= LOGIT_TOL
