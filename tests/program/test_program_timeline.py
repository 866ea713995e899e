"""The timeline host side: records <-> rows, the predicted timeline, the PNG, and the refit of
per-instruction costs to a timeline (megakernel/measure/timeline.py, measure/timeline_fit.py)."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np
import pytest

from megakernel.measure import timeline as tl
from megakernel.measure import timeline_fit
from megakernel.models import resolve
from megakernel.program.compiler import compile_program
from megakernel.program.cost import CostParams
from megakernel.program.gpus import gpu

SMS = 8


@pytest.fixture(scope="module")
def prog():
    return compile_program(resolve("llama-tiny"), 1, gpu("h200").with_sms(SMS))


def random_rows(rng: np.random.Generator, num_sms: int, queue_len: int) -> np.ndarray:
    """Rows with every field random (no slab: load times -1), the earliest stamp at 0."""
    out = []
    for s in range(num_sms):
        for p in range(int(rng.integers(1, queue_len))):
            ws = int(rng.integers(0, 10**6))
            we, fin = ws + int(rng.integers(0, 10**4)), ws + int(rng.integers(10**4, 10**5))
            ls = int(rng.integers(0, 10**6)) if rng.random() < 0.7 else -1
            le = ls + int(rng.integers(1, 10**4)) if ls >= 0 else -1
            out.append([s, p, int(rng.integers(1, 12)), ws, we, fin, ls, le])
    rows = np.array(out, dtype=np.int64)
    t = rows[:, 3:]
    rows[:, 3:] = np.where(t >= 0, t - t[t >= 0].min(), -1)
    return rows


def test_records_round_trip():
    rng = np.random.default_rng()
    rows = random_rows(rng, 5, 9)
    buf = tl.encode(rows, 5, 9, t0=int(rng.integers(1, 10**15)))
    assert buf.shape == (5, 9, tl.TIMELINE_WORDS) and buf.dtype == np.int64
    np.testing.assert_array_equal(tl.decode(buf), rows)


def test_predicted_rows_follow_the_program(prog):
    rows = tl.predicted(prog)
    assert len(rows) == sum(len(q) for q in prog.queues)
    tl.check_matches(rows, prog)  # opcodes at their (sm, pos)
    ws, we, fin = rows[:, 3], rows[:, 4], rows[:, 5]
    assert (ws >= 0).all() and (we >= ws).all() and (fin > we).all()
    assert (rows[:, 6] >= 0).any()  # slabs streamed
    bad = rows.copy()
    bad[0, 2] += 1
    with pytest.raises(ValueError, match="does not match"):
        tl.check_matches(bad, prog)


def read_png(data: bytes) -> np.ndarray:
    """Minimal reader of the 8-bit RGB, filter-0 PNGs tl.png_bytes writes (CRCs checked)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos: pos + 4])
        tag, body = data[pos + 4: pos + 8], data[pos + 8: pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n: pos + 12 + n])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, tag
        chunks[tag] = chunks.get(tag, b"") + body
        pos += 12 + n
    w, h, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2) and b"IEND" in chunks
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def test_png_has_every_sm_row_in_both_panels(prog, tmp_path):
    pred = tl.predicted(prog)
    meas = tl.predicted(prog, CostParams(mem_latency=900e-9))
    legend = tl.write_png(tmp_path / "t.png", pred, meas, prog.num_sms)
    img = read_png((tmp_path / "t.png").read_bytes())
    h = 2 * tl.MARGIN + SMS * tl.ROW_H + tl.TICK_H
    w = 2 * tl.MARGIN + 2 * tl.PANEL_W + tl.GAP
    assert img.shape == (h, w, 3) and "measured" in legend
    drawn = (img != np.array(tl.BACKGROUND, np.uint8)).any(axis=2)
    for k in range(2):
        left = tl.MARGIN + k * (tl.PANEL_W + tl.GAP)
        for s in range(SMS):
            top = tl.MARGIN + s * tl.ROW_H
            assert drawn[top: top + tl.ROW_H, left: left + tl.PANEL_W].any(), (k, s)
    colours = {tuple(c) for c in img.reshape(-1, 3).tolist()}
    assert set(tl.COLOURS.values()) <= colours


@pytest.mark.parametrize("planted", [False, True])
def test_refit_recovers_the_parameters_of_a_timeline(prog, planted):
    """Records made by the cost model with drawn parameters are fitted back to them; perturbing
    the fixed cost of the records moves the fit with it."""
    rng = np.random.default_rng()
    start = CostParams()

    def away(x: float) -> float:
        """A draw at least 1.4x from the fit's start, so loss_before cannot be near zero."""
        return x * float(rng.uniform(1.4, 2.2)) ** float(rng.choice([-1.0, 1.0]))

    true = CostParams(mem_latency=away(start.mem_latency),
                      fixed_per_instr=away(start.fixed_per_instr))
    made = dataclasses.replace(true, fixed_per_instr=true.fixed_per_instr * 1.5) if planted \
        else true
    rows = tl.decode(tl.encode(tl.predicted(prog, made), SMS, 64, t0=10**12))
    fit = timeline_fit.fit_timeline(prog, rows)
    assert fit.loss_after < 1e-4 < fit.loss_before
    assert fit.params.fixed_per_instr == pytest.approx(made.fixed_per_instr, rel=0.01)
    assert fit.params.mem_latency == pytest.approx(made.mem_latency, rel=0.01)


def test_records_files_round_trip(tmp_path):
    rows = random_rows(np.random.default_rng(), 3, 5)
    data = {"model": "llama-tiny", "batch": 1, "records": tl.encode(rows, 3, 5).tolist()}
    for name in ("r.npz", "r.json"):
        tl.save_records(tmp_path / name, data)
        back = tl.load_records(tmp_path / name)
        assert back["model"] == "llama-tiny"
        np.testing.assert_array_equal(tl.decode(back["records"]), rows)
