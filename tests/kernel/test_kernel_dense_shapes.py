"""Dense shapes beyond the tiny presets: head_dim 256, any vocabulary size, Qwen2's q/k/v biases.

No GPU here. Host emulations use the kernel's own helpers (spec.lm_row_live, spec.qkv_bias_index)
in the kernel's loop structure: the LM-head epilogue stores logits and takes part in the argmax
only for rows < V, and the QKV epilogue reads the bias of every packed row from where the packer
put it. The compiled builds (DSL) of those shapes keep the resource rules on both archs.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.common.errors import SpecError
from megakernel.kernel.config import spec as spec_mod
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host import limits
from megakernel.kernel.host.dense_index import lm_row_live, qkv_bias_index
from megakernel.kernel.host.limits import LANES, ROW_CHUNK
from megakernel.models import preset

KERNEL_DIR = Path(spec_mod.__file__).parents[1] / "device"


def _function(module: str, name: str) -> ast.FunctionDef:
    """Function `name` ("Class.method" for a method) of a kernel module."""
    tree = ast.parse((KERNEL_DIR / module).read_text())
    cls, _, name = name.rpartition(".")
    if cls:
        tree = next(c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == cls)
    return next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name)


def _calls(fn: ast.FunctionDef, name: str) -> int:
    return sum(isinstance(c, ast.Call) and ast.unparse(c.func) == name for c in ast.walk(fn))


# ---- LM head: padded rows (spec.lm_row_live) ---------------------------------------------------
def _warp_argmax(vals: list[float], idxs: list[int]) -> tuple[float, int]:
    """matvec.warp_argmax: butterfly over 32 lanes, larger value or equal value and lower index."""
    v, i = list(vals), list(idxs)
    for m in range(5):
        ov = [v[ln ^ (1 << m)] for ln in range(LANES)]
        oi = [i[ln ^ (1 << m)] for ln in range(LANES)]
        for ln in range(LANES):
            if ov[ln] > v[ln] or (ov[ln] == v[ln] and oi[ln] < i[ln]):
                v[ln], i[ln] = ov[ln], oi[ln]
    return v[0], i[0]


def _emulate_lm_head(acc: np.ndarray, vocab: int, slabs: list[tuple[int, int]], live=lm_row_live):
    """LMHEAD records (one per slab: ROW0, NROWS; slot = its index) then ARGMAX, in the kernel's
    loop structure: epi_lmhead per ROW_CHUNK chunk (the logits stores; a lane's strided rows, the
    warp argmax, the running best), store_partial_argmax, the ARGMAX merge. `acc` [N, Vpad]: the
    accumulators of every padded row. Returns (logits buffer [N * V + guard], tokens [N])."""
    n_rows = acc.shape[0]
    guard = 64
    logits = np.full(n_rows * vocab + guard, np.nan)  # the f32 arena: logits, then other data
    parg = np.full((len(slabs), n_rows, 2), np.nan)
    for tile, (row0, nrows) in enumerate(slabs):
        best = [[-math.inf, float(row0)] for _ in range(n_rows)]  # pass_prologue
        for rc0 in range(0, nrows, ROW_CHUNK):
            nr = min(ROW_CHUNK, nrows - rc0)
            for n in range(n_rows):
                for r in range(nr):  # the stores
                    row = row0 + rc0 + r
                    if live(row, vocab):
                        logits[n * vocab + row] = acc[n, row]
                lane_v, lane_i = [], []
                for lane in range(LANES):  # the chunk's argmax
                    b, bi = -math.inf, row0 + rc0
                    for r in range(lane, nr, LANES):
                        if live(row0 + rc0 + r, vocab) and acc[n, row0 + rc0 + r] > b:
                            b, bi = acc[n, row0 + rc0 + r], row0 + rc0 + r
                    lane_v.append(b)
                    lane_i.append(bi)
                b, bi = _warp_argmax(lane_v, lane_i)
                if b > best[n][0]:
                    best[n] = [b, float(bi)]
        parg[tile] = best
    tokens = []
    for n in range(n_rows):  # ARGMAX: slots strided over the lanes, then the warp argmax
        lane_v, lane_i = [], []
        for lane in range(LANES):
            b, bi = -math.inf, 0x7FFFFFFF
            for t in range(lane, len(slabs), LANES):
                v, i = parg[t, n, 0], int(parg[t, n, 1])
                if v > b or (v == b and i < bi):
                    b, bi = v, i
            lane_v.append(b)
            lane_i.append(bi)
        tokens.append(_warp_argmax(lane_v, lane_i)[1])
    return logits, tokens


def _slabs(vpad: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """A random split of the padded head into slabs of whole ROW_ALIGN blocks (some > ROW_CHUNK)."""
    blocks = vpad // isa.ROW_ALIGN
    cuts = sorted(set(rng.choice(np.arange(1, blocks), size=min(6, blocks - 1), replace=False)))
    edges = [0, *[int(c) for c in cuts], blocks]
    return [(a * isa.ROW_ALIGN, (b - a) * isa.ROW_ALIGN)
            for a, b in zip(edges, edges[1:], strict=False)]


@pytest.mark.parametrize("vocab", [1001, 1008, 513, 17])
def test_lm_head_masks_padded_rows(vocab):
    from megakernel.layers.frame import padded_vocab

    rng = np.random.default_rng(vocab)
    vpad = padded_vocab(vocab)
    n_rows = 3
    acc = -1.0 - rng.random((n_rows, vpad))  # every real logit negative ...
    acc[:, vocab:] = 0.0  # ... the zero padding rows would win an unmasked argmax
    acc[1, [vocab // 3, vocab - 1]] = -0.5  # a tie at the maximum: the lowest index wins
    slabs = _slabs(vpad, rng)
    logits, tokens = _emulate_lm_head(acc, vocab, slabs)
    np.testing.assert_array_equal(logits[: n_rows * vocab].reshape(n_rows, vocab), acc[:, :vocab])
    assert np.isnan(logits[n_rows * vocab:]).all()  # nothing stored past the [N, V] logits
    assert tokens == [int(np.argmax(acc[n, :vocab])) for n in range(n_rows)]
    assert tokens[1] == vocab // 3 or vocab // 3 == vocab - 1
    if vocab % isa.ROW_ALIGN:  # the unmasked epilogue (the bug this guards) gets it wrong
        bad_logits, bad_tokens = _emulate_lm_head(acc, vocab, slabs, live=lambda r, v: True)
        assert all(t >= vocab for t in bad_tokens)
        assert not np.isnan(bad_logits[n_rows * vocab:]).all()  # it writes past the buffer


def test_lm_head_epilogue_uses_the_row_bound_for_stores_and_argmax():
    fn = _function("epilogues.py", "LMHead.run")
    assert _calls(fn, "lm_row_live") == 2
    assert "self.mv.V" in ast.unparse(fn)


# ---- Qwen2 q/k/v bias (spec.qkv_bias_index) -----------------------------------------------------
def _hf_bias(cfg, w: dict[str, torch.Tensor], layer: int, row: int) -> float:
    """The bias of packed QKV row `row` from the Hugging Face tensors: per kv group g the G q
    heads, k, v (layers/attention.py), D rows each."""
    att = cfg.kind_config("attention")
    d, g = att.head_dim, att.group_size
    grp, rest = divmod(row, (g + 2) * d)
    slot, i = divmod(rest, d)
    p = f"model.layers.{layer}.self_attn."
    if slot < g:
        return float(w[p + "q_proj.bias"][(grp * g + slot) * d + i])
    name = "k_proj.bias" if slot == g else "v_proj.bias"
    return float(w[p + name][grp * d + i])


def _check_bias_reads(cfg, spec, arena: torch.Tensor, w, records: list[dict]) -> int:
    """Emulate epi_qkv's bias reads (matvec.py: chunk row 0's element from qkv_bias_index, then
    head hh, lane, element e) for each record: every row of the slab is read once, from the
    arena element that holds its bias. Returns the rows checked."""
    d, e_per_lane = spec.head_dim, spec.head_dim // LANES
    arena = arena.float()
    checked = 0
    for r in records:
        seen = set()
        for rc0 in range(0, r["NROWS"], ROW_CHUNK):
            nr = min(ROW_CHUNK, r["NROWS"] - rc0)
            bias0 = qkv_bias_index(r["W"], r["ROW0"], r["K"], spec.qkv_rows, rc0)
            for hh in range(nr // d):
                for lane in range(LANES):
                    for e in range(e_per_lane):
                        local = hh * d + lane + LANES * e
                        row = r["ROW0"] + rc0 + local
                        got = float(arena[bias0 + local])
                        assert got == _hf_bias(cfg, w, r["LAYER"], row), (r, row)
                        seen.add(row)
        assert seen == set(range(r["ROW0"], r["ROW0"] + r["NROWS"])), r
        checked += len(seen)
    return checked


def test_qkv_bias_addresses_on_a_compiled_program():
    from megakernel.models.weights import random_weights
    from megakernel.program.compiler import compile_program
    from megakernel.program.gpus import gpu
    from megakernel.program.pack import pack_weights

    cfg = preset("qwen2-tiny")
    spec = make_spec(cfg, 1, 1, "sm_90a")
    assert spec.qkv_bias and spec.qkv_rows == cfg.kind_config("attention").qkv_rows
    w = random_weights(cfg, seed=5)
    packed = pack_weights(cfg, w)
    prog = compile_program(cfg, 1, gpu("h200"))
    recs = [isa.decode(r) for q in prog.records().tolist() for r in q if r[0] == isa.Op.QKV]
    assert any(r["ROW0"] > 0 for r in recs)
    n = _check_bias_reads(cfg, spec, packed.arena, w, recs)
    assert n == cfg.num_layers * spec.qkv_rows


def test_qkv_bias_addresses_of_multi_chunk_slabs():
    """Slabs of whole groups larger than ROW_CHUNK (chunk rows rc0 > 0), starting at any group."""
    from megakernel.models.weights import random_weights
    from megakernel.program.pack import pack_weights

    cfg = dataclasses.replace(preset("qwen2-tiny"), num_heads=8, num_kv_heads=2)  # G = 4
    spec = make_spec(cfg, 1, 1, "sm_90a")
    w = random_weights(cfg, seed=6)
    packed = pack_weights(cfg, w)
    d, g, k = spec.head_dim, spec.group, spec.hidden
    recs = []
    for layer in range(cfg.num_layers):
        base = packed.layout[f"L{layer}.attn.qkv"].offset
        for row0, nrows in ((0, (g + 2) * d), ((g + 2) * d, (g + 2) * d), ((g + 2) * d + d, 3 * d)):
            recs.append(dict(W=base + row0 * k, ROW0=row0, NROWS=nrows, K=k, LAYER=layer))
    assert max(r["NROWS"] for r in recs) > ROW_CHUNK
    assert _check_bias_reads(cfg, spec, packed.arena, w, recs) == sum(r["NROWS"] for r in recs)


def test_qkv_epilogue_adds_the_bias_before_norm_and_rope():
    src = ast.unparse(_function("qkv.py", "QKV.run"))
    assert "qkv_bias_index(" in src
    add, norm, rope = src.index("x[e] = x[e] + b_e"), src.index("rstd"), src.index("x1 * cs")
    assert add < norm < rope


# ---- head_dim 256 -------------------------------------------------------------------------------
def test_head_dim_256_spec():
    cfg = dataclasses.replace(preset("qwen3-tiny"), head_dim=256)
    for arch in ARCHS:
        s = make_spec(cfg, 1, 1, arch)
        assert s.head_dim == 256 and ROW_CHUNK % s.head_dim == 0
        assert s.smem_regions()["q"][1] == s.smem_regions()["o"][1] == 4 * s.num_warps * 256
        assert s.smem_bytes <= limits.SMEM_BUDGET
    with pytest.raises((SpecError, ValueError), match="head_dim"):
        make_spec(dataclasses.replace(preset("qwen3-tiny"), head_dim=96), 1, 1, "sm_90a")


# ---- compiled (DSL) -----------------------------------------------------------------------------
def _variant(name: str) -> object:
    if name == "qwen3-tiny-d256-v1001":  # head_dim 256 (q/k norm) and a vocab of no alignment
        return dataclasses.replace(preset("qwen3-tiny"), head_dim=256, vocab_size=1001)
    return preset(name)


# (model, batch, tokens, smem_stages, archs): Qwen2 on every GEMV path (global FMA, pipelined
# mma, and pipelined FMA in the real Qwen2 preset), head_dim 256 with vocab 1001
BUILDS = [
    ("qwen2-tiny", 2, 2, 0, ("sm_90a",)),
    ("qwen2-tiny", 16, 1, None, ("sm_100a",)),
    ("qwen2.5-0.5b", 1, 1, None, ("sm_100a",)),
    ("qwen3-tiny-d256-v1001", 1, 1, None, ("sm_90a",)),
]


@pytest.fixture(scope="module")
def builds(kernel_build):
    return {(name, b, t, stages, arch): kernel_build(_variant(name), arch, b, t, stages)
            for name, b, t, stages, archs in BUILDS for arch in archs}


def test_dense_shapes_build_within_the_resource_rules(builds):
    assert len(builds) == sum(len(a) for *_, a in BUILDS)
    paths = set()
    for (name, b, t, _stages, arch), (_, m) in sorted(builds.items(), key=str):
        r = m["resources"]
        spec = spec_mod.KernelSpec.from_dict(m["spec"])
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, arch, r)
        assert r["local_bytes"] == 0 and r["local_stores"] == 0 and r["local_loads"] == 0, r
        assert 0 < r["registers"] <= limits.REGISTER_BUDGET, (name, arch, r)
        assert m["dynamic_smem_bytes"] == spec.smem_bytes <= limits.SMEM_BUDGET
        paths.add((spec.qkv_bias, spec.pipelined, spec.mma))
        print(f"{name} B={b} T={t} stages={m['smem_stages']} {arch}: {r['registers']} regs, "
              f"smem {m['dynamic_smem_bytes']} B, compile {m['compile_seconds']} s")
    assert {(True, True, False), (True, False, False), (True, True, True)} <= paths
    d256 = spec_mod.KernelSpec.from_dict(builds[("qwen3-tiny-d256-v1001", 1, 1, None,
                                                 "sm_90a")][1]["spec"])
    assert d256.head_dim == 256 and d256.vocab == 1001 and d256.qk_norm


def test_bias_loads_are_compiled_in_only_with_qkv_bias(builds, tmp_path):
    """The Qwen2 build has E = D / 32 more scalar bf16 loads (the bias of each of a lane's head
    elements) than the same spec without biases; other builds load none."""
    from megakernel.kernel.toolchain.build import compile_to

    d, m = builds[("qwen2-tiny", 2, 2, 0, "sm_90a")]
    spec = spec_mod.KernelSpec.from_dict(m["spec"])
    assert spec.qkv_bias
    with_bias = (d / "megakernel.ptx").read_text()
    att = list(spec.constants("attention"))
    att[4] = 0  # (heads, kv_heads, head_dim, qk_norm, qkv_bias, rotary_dim, output_gate)
    kinds = tuple((k, tuple(att) if k == "attention" else c) for k, c in spec.kinds)
    no_bias = dataclasses.replace(spec, kinds=kinds)
    assert not no_bias.qkv_bias
    ptx = Path(compile_to(no_bias, str(tmp_path))[0])
    without = ptx.read_text()

    def scalar_bf16_loads(s: str) -> int:
        return len(re.findall(r"\bld\.global\.b16\b", s))

    assert scalar_bf16_loads(with_bias) - scalar_bf16_loads(without) == spec.head_dim // LANES
