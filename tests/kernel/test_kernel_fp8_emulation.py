"""A numpy emulation of the kernel's FP8 weight slabs (docs/FP8.md; kernel/fp8_index.py), walked
with the kernel's own index helpers, against program/pack.PackedWeights.slab on real packed FP8
weights (models/fp8.QuantizedWeights of random weights, program/pack.pack_weights).

For every matvec record of a compiled program the emulation does what the device code does:
- the loader (Pipeline.load_queue): the record's tiles (plans.matvec_tiles with the opcode's
  bytes per weight) copied byte for byte from the arena into stages [rows][kc];
- the FMA GEMV (Matvec.gemv_tile_fp8 / gemv_fp8): each lane vector's 8 codes at its stage byte
  (or its global byte, fp8_index.slab_byte), loaded as two little-endian words and converted
  code by code (fp8_index.word_codes, e4m3_value: the PTX cvt), times the scale the kernel reads
  (fp8_index.scale_byte, the chunk of the vector's first input);
so the weights the kernel multiplies are rebuilt and must equal the executor's slab bit for bit
(bf16 slabs of the same program included). The mma form's B operand (fp8_index.fp8_operand_byte,
the bf16 pair words of memory.e4m3x4_bf16x2) is laid on the PTX fragment layout and must be the
bf16 form's; its block-scaled accumulation (chunks per warp slice, fp8_index.mma_warp_steps, the
C columns' scales) must compute the slab's products. The QKV bias after an FP8 matrix, the MoE
expert stride and the spec's FP8 rules are checked against the packed layout.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from megakernel import isa
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host import fp8_index as fi
from megakernel.kernel.host import limits
from megakernel.kernel.host import moe_index as mi
from megakernel.kernel.host.dense_index import mma_operand_word, qkv_bias_index, row_major
from megakernel.kernel.host.limits import MMA_K_ALIGN, MMA_M, MMA_N, VEC, tile_rows
from megakernel.kernel.host.plans import matvec_tiles, stage_plan
from megakernel.models import preset
from megakernel.models.fp8 import E4M3, Fp8Format, QuantizedWeights
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from megakernel.program.pack import pack_weights
from tests.kernel.test_kernel_mma import _fragments_to_matrices

F32 = np.float32
# (preset, granularity, LM head quantized): dense (tied and untied heads), a QKV bias, the MoE
CASES = [("llama-tiny", "channel", False), ("llama-tiny", "block", True),
         ("qwen2-tiny", "block", False), ("qwen3.5-tiny", "channel", True),
         ("kimi-linear-tiny", "block", False)]


@functools.cache
def _model(name: str, gran: str, lm_head: bool):
    """(cfg, packed FP8 weights, the arena as bytes, a batch-1 program's matvec records, spec)."""
    cfg = preset(name).replace(quant=Fp8Format(gran, lm_head=lm_head))
    packed = pack_weights(cfg, QuantizedWeights(cfg, random_weights(cfg, seed=0)))
    prog = compile_program(cfg, 1, gpu("h200"))
    recs = [isa.decode(r) for q in prog.records().tolist() for r in q if r[0] != isa.Op.END]
    mats = [d for d in recs if isa.spec(d["OPCODE"]).matvec is not None]
    spec = make_spec(cfg, 1, 1, "sm_90a")
    raw = packed.arena.view(torch.uint8).numpy()
    return cfg, packed, raw, mats, spec


def _f32_at(raw: np.ndarray, byte: int) -> np.float32:
    assert byte % 4 == 0
    return raw[byte:byte + 4].view(F32)[0]


def _codes_value(codes) -> np.ndarray:  # noqa: ANN001
    """8 code bytes as the device converts them: two little-endian words, code i = byte i."""
    out = []
    for w in (fi.word_of(codes[:4]), fi.word_of(codes[4:])):
        out += [fi.e4m3_value(c) for c in fi.word_codes(w)]
    return np.array(out, F32)


def _loader_stages(raw: np.ndarray, d: dict, wb: int, spec) -> list:  # noqa: ANN001
    """Pipeline.load_queue for one record: (tile, stage bytes [rows * kc * wb]) per tile."""
    k = d["K"]
    out = []
    for _p, row0, rows, col0, kc in matvec_tiles(d["NROWS"], k, 1, spec.k_chunk,
                                                  spec.num_warps, wb):
        assert rows * kc * wb <= limits.SMEM_STAGE_BYTES and (kc * wb) % 16 == 0
        if kc == k:  # one bulk copy of whole rows
            src = fi.slab_byte(d["W"], row0, col0, k, wb)
            assert src % 16 == 0
            stage = raw[src:src + rows * kc * wb].copy()
        else:
            stage = np.concatenate([raw[fi.slab_byte(d["W"], row0 + r, col0, k, wb):][:kc * wb]
                                    for r in range(rows)])
        out.append(((row0, rows, col0, kc), stage))
    return out


def _device_weights(raw: np.ndarray, d: dict, spec, w: int | None = None) -> np.ndarray:  # noqa: ANN001
    """The fp32 weights [NROWS, K] the FMA GEMV multiplies for record d (W = `w` when bound)."""
    d = dict(d, W=d["W"] if w is None else w)
    op, k = d["OPCODE"], d["K"]
    wb = spec.weight_bytes(op)
    chunks = fi.scale_chunks(k, spec.fp8_chunk)
    out = np.full((d["NROWS"], k), np.nan, F32)
    for (row0, rows, col0, kc), stage in _loader_stages(raw, d, wb, spec):
        for r in range(rows):
            for v in range(kc // VEC):
                b = row_major(r, v * VEC, kc) * wb  # the lane's vector in the stage
                if wb == 2:
                    vals = torch.from_numpy(stage[b:b + 16].copy()).view(torch.bfloat16)
                    out[row0 + r, col0 + v * VEC:][:VEC] = vals.float().numpy()
                    continue
                c = fi.scale_chunk_of(col0 + v * VEC, spec.fp8_chunk)
                s = _f32_at(raw, fi.scale_byte(d["W"], d["ROW0"], k, chunks, row0 + r, c))
                out[row0 + r, col0 + v * VEC:][:VEC] = _codes_value(stage[b:b + 8]) * s
    return out


@pytest.mark.parametrize("name,gran,head", CASES)
def test_device_weights_equal_the_packed_slab(name, gran, head):
    cfg, packed, raw, mats, spec = _model(name, gran, head)
    seen = set()
    for d in mats:
        op = d["OPCODE"]
        e = packed.layout.entry_at(d["W"])
        assert e.dtype == ("fp8" if op in spec.fp8_ops else "bf16")
        key = (op, d["W"])
        if key in seen:
            continue
        seen.add(key)
        want, _ = packed.slab(d["W"], d["ROW0"], d["NROWS"], d["K"])
        got = _device_weights(raw, d, spec)
        np.testing.assert_array_equal(got, want.numpy(), err_msg=f"{op.name} W={d['W']}")
    ops = {d["OPCODE"] for d in mats}
    assert (isa.Op.LMHEAD in spec.fp8_ops) == (head and not cfg.tie_word_embeddings)
    assert ops - {isa.Op.LMHEAD} <= set(spec.fp8_ops)


def test_every_expert_binds_to_its_fp8_matrix_with_the_layout_stride():
    cfg, packed, raw, mats, spec = _model("kimi-linear-tiny", "block", False)
    e = next(b.cfg for b in cfg.blocks if b.kind == "moe")
    stride = mi.x_stride(e.intermediate_size, cfg.hidden_size, spec.quant)
    lay = packed.layout
    key = next(k for k in lay.entries if k.endswith(".x0.gateup")).rsplit(".x0.", 1)[0]
    for m in ("gateup", "down"):
        assert lay[f"{key}.x1.{m}"].offset - lay[f"{key}.x0.{m}"].offset == stride
    expert = [d for d in mats if d["OPCODE"] in (isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN)
              and d["SLOT"] >= 0]
    assert expert
    for d in expert[:4]:
        for x in (0, e.num_experts - 1):
            w = mi.bound_w(d["W"], x, stride)
            assert f".x{x}." in next(k for k, v in lay.entries.items() if v == lay.entry_at(w))
            want, _ = packed.slab(w, d["ROW0"], d["NROWS"], d["K"])
            np.testing.assert_array_equal(_device_weights(raw, d, spec, w), want.numpy())


@pytest.mark.parametrize("name,gran,head", CASES[:2])
def test_global_path_gemv_reads_the_same_weights_and_sums(name, gran, head):
    """gemv_fp8: R rows per warp group read at fp8_index.slab_byte straight from the arena,
    scaled as the ring path; the result against the executor's x @ slab^T."""
    cfg, packed, raw, mats, spec = _model(name, gran, head)
    rng = np.random.default_rng(1)
    for d in [d for d in mats if d["OPCODE"] in spec.fp8_ops][:6]:
        k, nrows = d["K"], d["NROWS"]
        chunks = fi.scale_chunks(k, spec.fp8_chunk)
        x = torch.from_numpy(rng.standard_normal(k).astype(F32)).bfloat16().float().numpy()
        y = np.zeros(nrows, np.float64)
        for row in range(nrows):
            rs = _f32_at(raw, fi.scale_byte(d["W"], d["ROW0"], k, chunks, row, 0))
            acc = 0.0
            for v in range(k // VEC):
                b = fi.slab_byte(d["W"], row, v * VEC, k, 1)
                assert b % 8 == 0  # the 8-byte load
                part = float(np.dot(_codes_value(raw[b:b + 8]), x[v * VEC:][:VEC]))
                if spec.fp8_chunk:  # block: the vector's partial times its chunk's scale
                    c = fi.scale_chunk_of(v * VEC, spec.fp8_chunk)
                    acc += part * _f32_at(raw, fi.scale_byte(d["W"], d["ROW0"], k, chunks, row, c))
                else:
                    acc += part
            y[row] = acc * (rs if not spec.fp8_chunk else 1.0)
        want = packed.slab(d["W"], d["ROW0"], nrows, k)[0].double().numpy() @ x
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


# ---- the mma form ---------------------------------------------------------------------------
def _mma_b_words(stage: np.ndarray, kc: int, step: int, g: int, t: int) -> list:
    """The 4 B words (bf16 pairs as value pairs) lane (g, t) builds for K-step `step` from an
    FP8 stage: two words of codes, each to two bf16 pairs (memory.e4m3x4_bf16x2)."""
    b = fi.fp8_operand_byte(g, step, t, kc)
    assert b % 8 == 0
    vals = _codes_value(stage[b:b + 8]).astype(np.float64)
    return [vals[2 * i:2 * i + 2] for i in range(4)]


@pytest.mark.parametrize("gran", ["channel", "block"])
def test_mma_operand_and_block_scaled_accumulation(gran):
    cfg, packed, raw, mats, _ = _model("llama-tiny", gran, gran == "block")
    spec = make_spec(cfg, 16, 1, "sm_90a")
    assert spec.mma
    nw, NO = spec.num_warps, spec.no
    rng = np.random.default_rng(2)
    d = next(d for d in mats if d["OPCODE"] == isa.Op.DOWN)  # the longest K
    k = d["K"]
    chunks = fi.scale_chunks(k, spec.fp8_chunk)
    cs = fi.CHUNK_STEPS if spec.fp8_chunk else 1
    x = torch.from_numpy(rng.standard_normal((NO, k)).astype(F32)).bfloat16().double().numpy()
    want = x @ packed.slab(d["W"], d["ROW0"], d["NROWS"], k)[0].double().numpy().T
    got = np.zeros_like(want)
    for (row0, rows, col0, kc), stage in _loader_stages(raw, d, 1, spec):
        assert rows == MMA_N or row0 + rows == d["NROWS"]
        codes = np.stack([[fi.e4m3_value(c) for c in stage[r * kc:(r + 1) * kc]]
                          for r in range(rows)])
        steps = kc // MMA_K_ALIGN
        per = fi.mma_warp_steps(steps, nw, cs)
        red = np.zeros((NO, MMA_N))
        for warp in range(nw):
            sb, se = warp * per, min(steps, warp * per + per)
            assert sb % cs == 0  # a block-scaled slice starts on a chunk boundary
            acc = np.zeros((NO, MMA_N))
            for c0 in range(sb, se, cs):
                part = np.zeros((NO, MMA_N))
                for step in range(c0, min(se, c0 + cs)):
                    bw = {}
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        bw[lane] = (_mma_b_words(stage, kc, step, g, t) if g < rows
                                    else [np.zeros(2)] * 4)
                        if g < rows:  # the bf16 form's words of the same (code) values
                            tile16 = codes[g].reshape(-1, 2)
                            wi = mma_operand_word(0, step, t, kc // 2)
                            np.testing.assert_array_equal(np.stack(bw[lane]), tile16[wi:wi + 4])
                    for h in range(2):
                        a = {ln: (np.zeros(2),) * 4 for ln in range(32)}  # A from x below
                        b = {ln: (bw[ln][2 * h], bw[ln][2 * h + 1]) for ln in range(32)}
                        _, B = _fragments_to_matrices(a, b)  # B [16, 8]: k slot x weight row
                        # the k slots {2t, 2t+1, 2t+8, 2t+9} hold inputs 8t + 4h + {0, 1, 2, 3}
                        perm = np.empty(16, int)
                        for t in range(4):
                            perm[[2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]] = (
                                step * MMA_K_ALIGN + 8 * t + 4 * h + np.arange(4))
                        part += x[:, col0 + perm] @ B
                if spec.fp8_chunk:  # acc += part * the scales of its C columns (rows 2t, 2t+1)
                    c = fi.scale_chunk_of(col0 + c0 * MMA_K_ALIGN, spec.fp8_chunk)
                    s = np.array([_f32_at(raw, fi.scale_byte(d["W"], d["ROW0"], k, chunks,
                                                             row0 + n, c)) if n < rows else 0.0
                                  for n in range(MMA_N)])
                    acc += part * s
                else:
                    acc += part
            red += acc
        if not spec.fp8_chunk:  # mma_reduce: the warps' sum times the row's scale
            red *= np.array([_f32_at(raw, fi.scale_byte(d["W"], d["ROW0"], k, chunks,
                                                        row0 + n, 0)) if n < rows else 0.0
                             for n in range(MMA_N)])
        got[:, row0:row0 + rows] += red[:, :rows]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---- conversion, layout pieces, spec rules ------------------------------------------------------
def test_e4m3_conversion_is_the_format_and_words_are_little_endian():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(E4M3).float().numpy()
    got = np.array([fi.e4m3_value(c) for c in range(256)], F32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    b = np.arange(8, dtype=np.uint8) * 37
    words = b.view("<u4")  # what a 32-bit load of the bytes gives
    assert [fi.word_of(b[:4]), fi.word_of(b[4:])] == [int(w) for w in words]
    assert fi.word_codes(int(words[1])) == [int(c) for c in b[4:]]
    # e4m3 values are exact in bf16 (the mma form's B operand is not rounded)
    assert torch.equal(torch.from_numpy(want[~np.isnan(want)]).bfloat16().float(),
                       torch.from_numpy(want[~np.isnan(want)]))


def test_scale_chunks_follow_the_format():
    for k in (256, 320, 512, 2048, 8192 + 128, 14336):
        assert fi.scale_chunks(k, fi.chunk_inputs("channel")) == Fp8Format("channel").chunks(k)
        assert fi.scale_chunks(k, fi.chunk_inputs("block")) == Fp8Format("block").chunks(k)
    assert fi.SCALE_CHUNK == Fp8Format("block").block[1]


def test_qkv_bias_follows_the_fp8_matrix():
    cfg, packed, raw, mats, spec = _model("qwen2-tiny", "block", False)
    assert spec.qkv_bias and isa.Op.QKV in spec.fp8_ops
    lay = packed.layout
    for d in (d for d in mats if d["OPCODE"] == isa.Op.QKV):
        i = fi.qkv_bias_index(d["W"], d["ROW0"], d["K"], spec.qkv_rows, 0)
        e = lay.entry_at(i)
        assert e.dtype == "bf16" and e.shape == (spec.qkv_rows,) and i - e.offset == d["ROW0"]
        assert e == lay[[k for k, v in lay.entries.items() if v == lay.entry_at(d["W"])][0]
                        + "_bias"]
        # the bf16 form's index lands elsewhere: the kernel must pick the FP8 one
        assert qkv_bias_index(d["W"], d["ROW0"], d["K"], spec.qkv_rows, 0) != i


def test_spec_carries_the_weight_format():
    cfg = preset("qwen3.5-tiny")  # an untied head
    assert not cfg.tie_word_embeddings
    bf, ch = make_spec(cfg, 1, 1, "sm_90a"), make_spec(cfg.replace(quant=Fp8Format()), 1, 1,
                                                       "sm_90a")
    bl = make_spec(cfg.replace(quant=Fp8Format("block", lm_head=True)), 1, 1, "sm_90a")
    assert bf.fp8 == "" and bf.fp8_ops == () and bf.quant is None
    assert (ch.fp8, ch.fp8_lm_head, bl.fp8, bl.fp8_lm_head) == ("channel", False, "block", True)
    assert isa.Op.LMHEAD not in ch.fp8_ops and isa.Op.LMHEAD in bl.fp8_ops
    assert ch.weight_bytes(isa.Op.QKV) == 1 and ch.weight_bytes(isa.Op.LMHEAD) == 2
    assert (ch.fp8_chunk, bl.fp8_chunk) == (0, fi.SCALE_CHUNK)
    assert len({bf.tag, ch.tag, bl.tag}) == 3 and ch.tag.endswith("-fp8c")
    from megakernel.kernel.toolchain.fingerprint import fingerprint
    assert len({fingerprint(s, "v") for s in (bf, ch, bl)}) == 3
    assert type(ch).from_dict(ch.to_dict()) == ch
    # a tied head is the bf16 embedding whatever the format says
    tied = preset("qwen2-tiny")
    assert tied.tie_word_embeddings
    s = make_spec(tied.replace(quant=Fp8Format(lm_head=True)), 1, 1, "sm_90a")
    assert not s.fp8_lm_head and isa.Op.LMHEAD not in s.fp8_ops


def test_fp8_tiles_hold_the_stage_in_bytes():
    assert tile_rows(8192, 8, wbytes=1) == 4 and tile_rows(8192, 8) == 2
    assert tile_rows(2048, 8, wbytes=1) == 8  # never more rows than warps
    assert tile_rows(16384 * 2, 8, wbytes=1) == 1
    slabs = [(64, 8192, 1), (0, 0), (48, 2048, 1), (32, 2048)]  # FP8, none, FP8, bf16
    plan = stage_plan(slabs, 2, 8192, 8)
    for i, (nrows, k, *wb) in enumerate(slabs):
        wbytes = wb[0] if wb else 2
        seen = np.zeros((nrows, k), int)
        for _, _, r0, rows, c0, cols in (t for t in plan if t[0] == i):
            assert rows * cols * wbytes <= limits.SMEM_STAGE_BYTES and (cols * wbytes) % 16 == 0
            seen[r0:r0 + rows, c0:c0 + cols] += 1
        assert (seen == 2).all()  # every weight once per pass


def test_scale_run_is_every_row_once_and_aligned():
    _, packed, _, mats, spec = _model("llama-tiny", "block", True)
    for d in (d for d in mats if d["OPCODE"] in spec.fp8_ops):
        e = packed.layout.entry_at(d["W"])
        first, n = fi.scale_run(d["W"], d["ROW0"], d["NROWS"], d["K"], e.chunks)
        assert first % 16 == 0 and n == 4 * e.chunks * d["NROWS"]
        assert 2 * e.scale_offset <= first and first + n <= 2 * e.offset
        rows = {fi.scale_byte(d["W"], d["ROW0"], d["K"], e.chunks, r, c)
                for r in range(d["NROWS"]) for c in range(e.chunks)}
        assert rows == set(range(first, first + n, 4))


def test_mma_warp_slices_start_on_chunk_boundaries_and_cover_the_tile():
    for steps in (1, 4, 7, 16, 31, 64):
        for cs in (1, fi.CHUNK_STEPS):
            per = fi.mma_warp_steps(steps, 8, cs)
            covered = [s for w in range(8) for s in range(w * per, min(steps, w * per + per))]
            assert covered == list(range(steps)) and per % cs == 0
    assert fi.mma_warp_steps(64, 8, 1) == 8 and MMA_M == 16
