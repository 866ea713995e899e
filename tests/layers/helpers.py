"""Helpers of the layer-kind tests (one module per kind of megakernel/layers/): the tiny presets'
blocks of a kind, tagged checkpoint tensors, the Hugging Face modules' parameter shapes, compiled
tiny programs and build contexts, and a one-model executor-vs-reference check.

Everything expensive is cached for the session: a program or a transformers model is built once
however many tests read it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megakernel.layers import kind
from megakernel.layers.base import StepShape
from megakernel.models import Block, ModelConfig, preset
from megakernel.models.weights import random_tensor, random_weights

TINY = ("llama-tiny", "qwen3-tiny", "qwen2-tiny", "qwen3.5-tiny", "kimi-linear-tiny",
        "nemotron-h-tiny")
HF_CLASSES = {  # family -> transformers (config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
}
TAG = 10_000_000  # tagged tensors: element j of tensor i holds (i + 1) * TAG + j
SMS = 8  # SMs of the GPU description the test programs are compiled for
LOGIT_TOL = 1e-3  # executor vs bf16 reference (measured: bit-identical)


@dataclass(frozen=True, kw_only=True)
class CustomModel(ModelConfig):
    """A model of any blocks (no family): for block configs no preset has."""

    custom_blocks: tuple[Block, ...]

    @property
    def num_layers(self) -> int:
        return len({b.layer for b in self.custom_blocks})

    def make_blocks(self) -> tuple[Block, ...]:
        return self.custom_blocks


def custom_model(*blocks: Block, hidden: int = 64, vocab: int = 256) -> CustomModel:
    return CustomModel(vocab_size=vocab, hidden_size=hidden, max_position_embeddings=512,
                       custom_blocks=tuple(blocks), name="custom")


def presets_with(kind_name: str) -> list[str]:
    """The tiny presets that have a block of `kind_name`."""
    return [n for n in TINY if preset(n).has_kind(kind_name)]


def blocks_of(kind_name: str) -> list[tuple[ModelConfig, Block]]:
    """(model, block) for every distinct block config of `kind_name` in the tiny presets (the
    first block of each config per preset)."""
    out = []
    for n in presets_with(kind_name):
        cfg, seen = preset(n), []
        for blk in cfg.blocks:
            if blk.kind == kind_name and blk.cfg not in seen:
                seen.append(blk.cfg)
                out.append((cfg, blk))
    return out


def block_ids(kind_name: str) -> list[str]:
    return [f"{cfg.name}-L{blk.layer}" for cfg, blk in blocks_of(kind_name)]


def tagged(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """float64 tensors of `shapes` whose elements name themselves: element j (flat) of the i-th
    tensor holds (i + 1) * TAG + j, so a packed tensor shows where each element came from (and
    zero padding reads 0)."""
    return {name: ((i + 1) * TAG + torch.arange(math.prod(s), dtype=torch.float64)).view(s)
            for i, (name, s) in enumerate(shapes.items())}


def pack_tagged(blk: Block, model: ModelConfig) -> tuple[dict[str, torch.Tensor],
                                                         dict[str, torch.Tensor]]:
    """(tagged checkpoint tensors of the block by local name, the kind's `pack` of them)."""
    kd = kind(blk.kind)
    w = tagged(kd.shapes(blk, model))
    return w, kd.pack(blk, model, w.__getitem__)


def check_pack_keys(blk: Block, model: ModelConfig) -> None:
    """Every key of `vectors` + `matrices` is packed, with the declared shape, and nothing else."""
    kd = kind(blk.kind)
    declared = {item[0]: tuple(item[1]) for item in kd.vectors(blk, model)
                + kd.matrices(blk, model)}
    _, packed = pack_tagged(blk, model)
    assert {k: tuple(t.shape) for k, t in packed.items()} == declared


def check_roles(model: ModelConfig, blk: Block, expect: dict[str, str]) -> None:
    """Every checkpoint tensor of the block has a role `random_tensor` draws (and the listed
    tensors the listed roles)."""
    kd = kind(blk.kind)
    gen = torch.Generator().manual_seed(0)
    roles = {}
    for local, shape in kd.shapes(blk, model).items():
        roles[local] = kd.init_role(local, blk)
        t = random_tensor(model, roles[local], shape, gen)  # raises on an unknown role
        assert tuple(t.shape) == tuple(shape) and bool(torch.isfinite(t).all()), local
    assert {k: roles[k] for k in expect} == expect


@functools.cache
def hf_model_tensors(name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint name -> (shape, dtype) of the transformers model of tiny preset `name`, built on
    the meta device in bf16 (the tensors transformers keeps in fp32 stay fp32), its names as
    save_pretrained writes them (load-time conversions reverted: unfused experts, split convs)
    and then mapped by the family's `canonical_name`."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    cfg = preset(name)
    cfg_cls, model_cls = (getattr(transformers, c) for c in HF_CLASSES[cfg.family])
    with torch.device("meta"):
        hf = model_cls._from_config(cfg_cls(**cfg.to_hf_dict()), dtype=torch.bfloat16)
    out = {}
    for n, t in revert_weight_conversion(hf, hf.state_dict()).items():
        ours = cfg.canonical_name(n)
        if ours is not None:
            out[ours] = (tuple(t.shape), t.dtype)
    return out


def hf_block_tensors(model: ModelConfig, blk: Block) -> dict[str, tuple[tuple[int, ...],
                                                                        torch.dtype]]:
    """The transformers tensors under the block's prefix, by local name."""
    return {n[len(blk.prefix):]: v for n, v in hf_model_tensors(model.name).items()
            if n.startswith(blk.prefix)}


@functools.cache
def weights_of(name: str) -> dict[str, torch.Tensor]:
    return random_weights(preset(name), seed=1)


def gpu8() -> Any:
    from megakernel.program.gpus import gpu

    return gpu("h100").with_sms(SMS)


@functools.cache
def tiny_program(name: str, batch: int = 2, tokens: int = 1, window: int | None = None,
                 n_splits: int = 2) -> Any:
    """A compiled program of tiny preset `name` (max_seq_len 64)."""
    from megakernel.program.compiler import compile_program

    return compile_program(preset(name), batch, gpu8(), tokens=tokens, max_seq_len=64,
                           n_splits=n_splits, replay_window=window)


def build_context(cfg: ModelConfig, batch: int = 2, tokens: int = 1, max_seq_len: int = 64,
                  n_splits: int = 2, window: int | None = None, context: int = 32) -> Any:
    """A compiler BuildContext (layout, buffers, counters) without scheduling anything: what a
    kind's `stages` reads."""
    from megakernel.program.buffers import plan_buffers
    from megakernel.program.compiler import BuildContext
    from megakernel.program.pack import weight_layout
    from megakernel.program.stages import Counters

    ring_cap = window - 1 + tokens if window else 0
    buf = plan_buffers(cfg, StepShape(batch, tokens, max_seq_len, n_splits, SMS, ring_cap))
    return BuildContext(cfg, batch, tokens, context, n_splits, window, weight_layout(cfg), buf,
                        Counters())


def block_records(prog: Any, blk: Block) -> list[dict]:
    """The decoded records of the program that belong to block `blk` (its layer, an opcode of its
    kind's flow)."""
    from megakernel import isa

    flow = kind(blk.kind).flow
    out = []
    for q in prog.records().tolist():
        for rec in q:
            if rec[0] == isa.Op.END:
                break
            d = isa.decode(rec)
            if d["LAYER"] == blk.layer and d["OPCODE"].name in flow:
                out.append(d)
    return out


def check_cover(prog: Any, blk: Block) -> None:
    """The kind's `cover` maps the block's records of each `coverage` opcode onto [0, units)
    exactly once."""
    kd = kind(blk.kind)
    want = kd.coverage(blk, prog)
    got: dict[str, list[tuple[int, int]]] = {op: [] for op in want}
    for d in block_records(prog, blk):
        if d["OPCODE"].name in want:
            got[d["OPCODE"].name].append(kd.cover(d, blk, prog))
    for op, units in want.items():
        spans = sorted(got[op])
        assert spans, f"no {op} records"
        assert all(hi > lo for lo, hi in spans), op
        flat = [u for lo, hi in spans for u in range(lo, hi)]
        assert flat == list(range(units)), f"{op}: units {flat}, expected 0..{units - 1} once"


def check_read_bytes(prog: Any, blk: Block) -> None:
    """The read side of the kind's `step_bytes` equals what the block's instructions without a
    weight slab stream (their w_bytes + hbm_bytes; slabs are counted by program/bytes.py)."""
    from megakernel import isa

    cats = kind(blk.kind).step_bytes(blk, prog)
    read = sum(v for k, v in cats.items() if not k.endswith("_written"))
    ours = [i for i in prog.instrs if i.layer == blk.layer and isa.spec(i.op).name
            in kind(blk.kind).flow and not isa.spec(i.op).slab]
    assert read == pytest.approx(sum(i.w_bytes + i.hbm_bytes for i in ours), abs=1.0)


def executor_vs_reference(cfg: ModelConfig, window: int | None = None, steps: int = 2,
                          tokens: int = 1) -> float:
    """Run `steps` program steps of `cfg` (batch 2, ragged prompts prefilled by the bf16
    reference) on the executor and the same steps on the bf16 reference; returns the largest
    logit difference (greedy tokens must agree)."""
    from megakernel.executor import Executor
    from megakernel.program.compiler import compile_program
    from megakernel.program.pack import pack_weights
    from reference.model import ReferenceModel

    w = random_weights(cfg, seed=1)
    ref = ReferenceModel(cfg, w, mode="bf16", replay_window=window)
    cache = ref.new_cache(2, 16, max_step_tokens=tokens)
    first = ref.prefill(cache, [[1, 2, 3], [4, 5, 6, 7, 8]]).argmax(-1)
    prog = compile_program(cfg, 2, gpu8(), tokens=tokens, max_seq_len=16, replay_window=window)
    ex = Executor(prog, pack_weights(cfg, w))
    ex.load_cache(cache)
    gen = torch.Generator().manual_seed(2)
    tok = first[:, None] if tokens == 1 else torch.randint(0, cfg.vocab_size, (2, tokens),
                                                           generator=gen)
    worst = 0.0
    for step in range(steps):
        out = ex.step(tok, seed=step)
        want = ref.decode(cache, tok)
        worst = max(worst, (ex.logits.view(2, tokens, -1) - want).abs().max().item())
        assert torch.equal(out, want.argmax(-1)), f"step {step}: greedy tokens differ"
        tok = out[:, -1:] if tokens == 1 else torch.randint(0, cfg.vocab_size, (2, tokens),
                                                            generator=gen)
    return worst


def fine_fp32(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """fp32 tensors of `shapes` holding values bf16 cannot represent (1 + k 2^-20): a table that
    went through bf16 on the way would lose them."""
    out = {}
    for i, (name, s) in enumerate(shapes.items()):
        k = torch.arange(math.prod(s), dtype=torch.float32) + 1 + 100 * i
        out[name] = (1.0 + k * 2.0 ** -20).view(s)
    return out


def check_slab_bytes(prog: Any, blk: Block) -> None:
    """The block's slab records stream each of its packed matrices exactly once: their bytes sum
    to the matrices' bf16 bytes (an entry that follows its matrix, a bias, is not streamed)."""
    from megakernel import isa

    kd = kind(blk.kind)
    want = sum(2 * math.prod(m[1]) for m in kd.matrices(blk, prog.cfg)
               if not (len(m) > 2 and m[2]))
    got = sum(i.w_bytes for i in prog.instrs if i.layer == blk.layer
              and isa.spec(i.op).slab and isa.spec(i.op).name in kd.flow)
    assert got == want


def check_flow(kind_name: str, flow: dict[str, Any], out_op: str) -> None:
    """The kind's flow as documented; every opcode in it registered, owned by the kind or the
    frame; its out_op in it."""
    from megakernel import isa

    kd = kind(kind_name)
    assert kd.flow == flow and kd.out_op == out_op and out_op in flow
    for name in flow:
        assert isa.spec(getattr(isa.Op, name)).kind in (kind_name, "frame"), name


# ---- the recurrent kinds (GDN, KDA, Mamba2) ---------------------------------------------------
def check_recurrent_needs(blk: Block, model: ModelConfig, proj_rows: int, out_dim: int,
                          n_params: int, units: int) -> None:
    """proj f32 [N, proj_rows rounded up to 16], ssm_out bf16 [N, out], the layer's fp32
    parameter row (a constant table) and its ring counts [B, units] (persistent table)."""
    from megakernel.layers.base import CONST, SCRATCH

    width = -(-proj_rows // 16) * 16
    got = {(nd.arena, nd.name): (nd.shape, nd.group, nd.const, nd.persistent, nd.table)
           for nd in kind(blk.kind).needs(blk, model, StepShape(3, 2, 40, 2, 8, 0))}
    assert got == {("f32", "proj"): ((6, width), SCRATCH, False, False, None),
                   ("bf16", "ssm_out"): ((6, out_dim), SCRATCH, False, False, None),
                   ("f32", "ssm_params"): ((n_params,), CONST, True, False, "rec"),
                   ("i32", "ring_count"): ((3, units), SCRATCH, False, True, "rec")}


def check_recurrent_state(blk: Block, model: ModelConfig, conv_dim: int,
                          state: tuple[int, ...], ring: list[tuple[str, tuple[int, ...]]]
                          ) -> None:
    """conv [B, C, K-1], state [B, ...], and only with a ReplaySSM ring its entries
    [B, cap, ...]; the buffer plan lays them out layer by layer, contiguously."""
    from megakernel.program.buffers import plan_buffers

    kd, k = kind(blk.kind), blk.cfg.conv_kernel
    assert kd.recurrent and not kd.kv_cache
    base = [("conv", (3, conv_dim, k - 1)), ("state", (3, *state))]
    assert kd.state(blk, model, 3, 0) == base
    assert kd.state(blk, model, 3, 5) == base + [(n, (3, 5, *s)) for n, s in ring]
    assert kd.ring_shapes(blk.cfg) == ring
    for cap in (0, 5):
        buf = plan_buffers(model, StepShape(3, 1, 40, 2, 8, cap))
        off = 0
        assert list(buf.state) == model.recurrent_layers()
        for layer, regs in buf.state.items():
            b = next(x for x in model.blocks if x.layer == layer and kind(x.kind).recurrent)
            assert [(n, r.shape) for n, r in regs.items()] == kind(b.kind).state(b, model, 3,
                                                                                  cap)
            for r in regs.values():
                assert r.offset == off
                off += r.numel
        assert buf.state_numel == off and buf.ring_cap == cap


def check_recurrent_tables(name: str, kind_name: str, order: list[str]) -> None:
    """pack_weights keeps the layer's parameter row in fp32: ssm_params = the named checkpoint
    tensors, flattened, in `order` (values bf16 cannot hold survive)."""
    check_tables(name, kind_name, "ssm_params", order)


def check_tables(name: str, kind_name: str, region: str, order: list[str]) -> None:
    from megakernel.program.pack import pack_weights

    cfg = preset(name)
    w = random_weights(cfg, seed=1, dtype=torch.float32)
    blocks = [b for b in cfg.blocks if b.kind == kind_name]
    for blk in blocks:
        w.update(fine_fp32({blk.prefix + n: tuple(w[blk.prefix + n].shape) for n in order}))
    packed = pack_weights(cfg, w)
    for blk in blocks:
        t = packed.tables[(region, blk.layer)]
        want = torch.cat([w[blk.prefix + n].reshape(-1) for n in order])
        assert t.dtype == torch.float32 and torch.equal(t, want), blk.key
    assert sorted(k for k in packed.tables if k[0] == region) == sorted(
        (region, b.layer) for b in blocks)


def check_recurrent_stages(model: ModelConfig, blk: Block, window: int | None, core: str
                           ) -> None:
    """PROJ (its rows in slabs of 16, OUT_W the padded width), one core record per (sequence,
    unit) naming the layer's buffers, then out_proj."""
    from megakernel import isa

    kd, c = kind(blk.kind), blk.cfg
    ctx = build_context(model, batch=3, window=window)
    (proj, cr, o), end = kd.stages(blk, ctx, wait=-1)
    width = kd.proj_width(c)
    assert width % 16 == 0 and width - 16 < kd.proj_rows(c) <= width
    assert (proj.op, proj.units, proj.divisible) == (isa.Op.PROJ, width // 16, True)
    p = proj.make(0, proj.units).operands
    assert p["OUT_W"] == width and p["NORM_OFF"] == ctx.lay[f"{blk.key}.norm"].offset
    assert p["OUT_OFF"] == ctx.buf.f32["proj"].offset
    op = getattr(isa.Op, core + ("_REPLAY" if window else "_CORE"))
    units = kd.units(c)
    assert (cr.op, cr.units, cr.divisible) == (op, 3 * units, False)
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


def check_recurrent_program(name: str, kind_name: str, window: int | None, core: str) -> None:
    """The program verifies; the kind's blocks run PROJ, the core opcode of the mode, OPROJ;
    each (sequence, unit) once; the bytes agree with the records."""
    from megakernel.program.verify import check_program

    prog = tiny_program(name, window=window)
    check_program(prog)
    op = core + ("_REPLAY" if window else "_CORE")
    blocks = [b for b in prog.cfg.blocks if b.kind == kind_name]
    assert blocks
    for blk in blocks:
        assert {d["OPCODE"].name for d in block_records(prog, blk)} == {"PROJ", op, "OPROJ"}
        assert kind(kind_name).coverage(blk, prog) == {op: prog.batch * kind(kind_name).units(
            blk.cfg)}
        check_cover(prog, blk)
        check_slab_bytes(prog, blk)
        check_read_bytes(prog, blk)
        # a core streams its share of the packed conv vector (taps and per-kind extras): the
        # whole vector once per sequence
        conv = math.prod(prog.layout[f"{blk.key}.conv"].shape)
        assert kind(kind_name).step_bytes(blk, prog)["weights"] == prog.batch * conv * 2


def check_replay_writes_the_state_once_per_window(name: str, kind_name: str, tokens: int
                                                  ) -> None:
    """ReplaySSM (window 4): the state is read as often as by the recurrent update and written at
    one step in 4 / T; T ring entries are appended per step; the conv window moves alike. The
    core records' stores add up to the same."""
    from megakernel import isa

    window = 4
    rec, rep = (tiny_program(name, tokens=tokens, window=w) for w in (None, window))
    kd = kind(kind_name)
    for blk in (b for b in rec.cfg.blocks if b.kind == kind_name):
        a, b = kd.step_bytes(blk, rec), kd.step_bytes(blk, rep)
        assert a["state_read"] == b["state_read"] > 0
        assert a["state_written"] == a["state_read"]
        assert b["state_written"] == int(a["state_written"] * tokens / window)
        assert a["conv_read"] == a["conv_written"] == b["conv_read"] == b["conv_written"] > 0
        units, entry = kd.units(blk.cfg), kd.entry_bytes(blk.cfg)
        assert b["ring_written"] == rep.rows * units * entry
        assert b["ring_read"] == rep.batch * units * ((window - 1) * entry // 2)
        assert "ring_read" not in a and "ring_written" not in a
        for prog, cats in ((rec, a), (rep, b)):
            core = [i for i in prog.instrs if i.layer == blk.layer
                    and isa.spec(i.op).name.endswith(("_CORE", "_REPLAY"))]
            want = (cats["state_written"] + cats["conv_written"] + cats.get("ring_written", 0)
                    + prog.rows * kd.out_dim(blk.cfg) * 2)
            assert sum(i.store_bytes for i in core) == pytest.approx(want, abs=len(core))
