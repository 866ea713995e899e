"""A timeline of one decode step: the timeline build's records, the cost model's prediction, a PNG.

The timeline build (KernelSpec.timeline, `build_timeline`) stamps %globaltimer per instruction
into records [num_sms, queue_len, TIMELINE_WORDS] int64 in the tail of the program buffer
(kernel/config/spec.py TIMELINE_FIELDS). Host side, one step is a table of rows, int64 [n, 8]:

    ROW_FIELDS = (sm, pos, opcode, wait_start, wait_end, finish, load_start, load_end)

times in ns from the step's first stamp, -1 where there is none (load_*: instructions without a
weight slab). `decode`/`encode` convert records <-> rows, `predicted` makes the same rows from
the cost model's replay (program/replay.py `trace`), `draw` renders predicted and measured side
by side as a PNG (one row per SM; waiting, computing and streaming in three colours, a tick every
LEGEND's step), written by a minimal PNG encoder (zlib + struct).

For a GPU run (gpu-check): `build_timeline(cfg, arch, root)` builds the variant into
`timeline_build_dir(root, ...)`, `Megakernel(cfg, weights, batch, build_dir=that dir)` loads it
(and attaches the records: `attach_records`), `run_timeline(mk)` runs one step and returns
the records as a JSON-ready dict, `save_records` / `load_records` keep them (.npz or .json).
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from megakernel.kernel.host.limits import (
    TIMELINE_FIELDS,
    TIMELINE_WORDS,
    timeline_int32_words,
    timeline_offset,
    timeline_word,
)

TIME_FIELDS = ("wait_start", "wait_end", "finish", "load_start", "load_end")
ROW_FIELDS = ("sm", "pos", "opcode", *TIME_FIELDS)
COL = {name: i for i, name in enumerate(ROW_FIELDS)}
_TIME_WORDS = [timeline_word(f) for f in TIME_FIELDS]

# ---- records <-> rows ---------------------------------------------------------------------------


def decode(records: np.ndarray) -> np.ndarray:
    """Records [num_sms, queue_len, TIMELINE_WORDS] int64 -> rows [n, 8] (module docstring): one
    row per instruction whose finish was stamped, in (sm, pos) order, times relative to the
    earliest stamp of the step."""
    buf = np.asarray(records, dtype=np.int64)
    if buf.ndim != 3 or buf.shape[2] != TIMELINE_WORDS:
        raise ValueError(f"timeline records must be [num_sms, queue_len, {TIMELINE_WORDS}], got "
                         f"shape {buf.shape}")
    sm, pos = np.nonzero(buf[:, :, timeline_word("finish")] != 0)
    rec = buf[sm, pos]
    times = rec[:, _TIME_WORDS]
    written = times != 0
    t0 = times[written].min() if written.any() else 0
    rel = np.where(written, times - t0, -1)
    return np.column_stack([sm, pos, rec[:, timeline_word("opcode")], rel]).astype(np.int64)


def encode(rows: np.ndarray, num_sms: int, queue_len: int, t0: int = 1) -> np.ndarray:
    """Rows -> records [num_sms, queue_len, TIMELINE_WORDS] as the kernel would write them with
    its first stamp at `t0` ns (>= 1: 0 means unwritten)."""
    rows = np.asarray(rows, dtype=np.int64)
    buf = np.zeros((num_sms, queue_len, TIMELINE_WORDS), dtype=np.int64)
    sm, pos = rows[:, COL["sm"]], rows[:, COL["pos"]]
    times = rows[:, [COL[f] for f in TIME_FIELDS]]
    buf[sm[:, None], pos[:, None], _TIME_WORDS] = np.where(times >= 0, times + t0, 0)
    buf[sm, pos, timeline_word("opcode")] = rows[:, COL["opcode"]]
    return buf


def predicted(prog, params=None, exact: bool = False) -> np.ndarray:  # noqa: ANN001
    """Rows of the cost model's timeline of `prog` under `params` (CostParams; replay.py's
    trace), in ns; `exact`: float64 rows, times not rounded (what a fit differentiates)."""
    from megakernel.program.replay import TRACE_FIELDS, replay

    assert TRACE_FIELDS == TIME_FIELDS
    trace: list[np.ndarray] = []
    replay(prog, params, trace=trace)
    out = []
    for s, (q, tr) in enumerate(zip(prog.queues, trace, strict=True)):
        ops = np.array([int(prog.instrs[i].op) for i in q], dtype=np.int64)
        ns = np.nan_to_num(tr) * 1e9
        ns = np.where(np.isnan(tr), -1.0, ns if exact else np.rint(ns))
        out.append(np.column_stack([np.full(len(q), s), np.arange(len(q)), ops, ns]))
    return np.concatenate(out).astype(np.float64 if exact else np.int64)


def check_matches(rows: np.ndarray, prog) -> None:  # noqa: ANN001
    """The measured rows come from `prog`'s queues: same (sm, pos) -> opcode (ValueError)."""
    for sm, pos, op in rows[:, :3].tolist():
        q = prog.queues[sm] if sm < len(prog.queues) else []
        if pos >= len(q) or int(prog.instrs[q[pos]].op) != op:
            raise ValueError(f"timeline record SM {sm} position {pos} (opcode {op}) does not "
                             f"match the program compiled here; was it measured on another "
                             f"model, batch or GPU?")


# ---- PNG ----------------------------------------------------------------------------------------
BACKGROUND = (255, 255, 255)
COLOURS = {"waiting": (235, 150, 30), "computing": (40, 90, 210), "streaming": (50, 165, 70)}
TICK = (0, 0, 0)
ROW_H, PANEL_W, MARGIN, GAP, TICK_H = 5, 640, 8, 24, 6


def tick_step(t_max_ns: float) -> int:
    """Tick spacing in ns: 1, 2 or 5 x 10^k us with at most 10 ticks."""
    step = 1000
    while t_max_ns / step > 10:
        step = step * 5 // 2 if str(step // 1000)[0] == "2" else step * 2
    return step


def legend(t_max_ns: float, measured: bool) -> str:
    """What `draw` drew (printed by `plan --timeline`)."""
    panels = "predicted left, measured right" if measured else "predicted"
    return (f"timeline: one row per SM ({panels}); top of a row: waiting "
            f"rgb{COLOURS['waiting']} then computing rgb{COLOURS['computing']}; bottom line: "
            f"streaming rgb{COLOURS['streaming']} (weight slab or cached K/V arriving); ticks "
            f"every {tick_step(t_max_ns) / 1000:g} us, full width {t_max_ns / 1000:.1f} us")


def draw(pred: np.ndarray, meas: np.ndarray | None = None, num_sms: int | None = None
         ) -> tuple[np.ndarray, float]:
    """Image [H, W, 3] uint8 of the predicted rows (and the measured ones beside them) on one
    time scale, and that scale's full width in ns."""
    panels = [pred] if meas is None else [pred, meas]
    n = num_sms or int(max(p[:, COL["sm"]].max() for p in panels)) + 1
    t_max = float(max(p[:, [COL[f] for f in TIME_FIELDS]].max() for p in panels)) or 1.0
    h = 2 * MARGIN + n * ROW_H + TICK_H
    w = 2 * MARGIN + len(panels) * PANEL_W + (len(panels) - 1) * GAP
    img = np.empty((h, w, 3), dtype=np.uint8)
    img[:] = BACKGROUND

    def x(t: np.ndarray, left: int) -> np.ndarray:
        return left + np.floor(t / t_max * (PANEL_W - 1)).astype(np.int64)

    for k, rows in enumerate(panels):
        left = MARGIN + k * (PANEL_W + GAP)
        spans = (("waiting", "wait_start", "wait_end", 0, ROW_H - 2),
                 ("computing", "wait_end", "finish", 0, ROW_H - 2),
                 ("streaming", "load_start", "load_end", ROW_H - 2, ROW_H - 1))
        for colour, a, b, y0, y1 in spans:
            ok = (rows[:, COL[a]] >= 0) & (rows[:, COL[b]] >= 0)
            xa, xb = x(rows[ok, COL[a]], left), x(rows[ok, COL[b]], left)
            for sm, x0, x1 in zip(rows[ok, COL["sm"]].tolist(), xa.tolist(), xb.tolist(),
                                  strict=True):
                top = MARGIN + sm * ROW_H
                img[top + y0: top + y1, x0: max(x1, x0 + 1)] = COLOURS[colour]
        step = tick_step(t_max)
        for t in range(0, int(t_max) + 1, step):
            xt = int(x(np.array(float(t)), left))
            img[h - MARGIN - TICK_H: h - MARGIN, xt] = TICK
    return img, t_max


def png_bytes(img: np.ndarray) -> bytes:
    """8-bit RGB PNG of `img` [H, W, 3] uint8 (filter 0 on every scanline)."""
    h, w, _ = img.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def write_png(path: str | Path, pred: np.ndarray, meas: np.ndarray | None = None,
              num_sms: int | None = None) -> str:
    """Draw and write the PNG; returns the legend."""
    img, t_max = draw(pred, meas, num_sms)
    Path(path).write_bytes(png_bytes(img))
    return legend(t_max, meas is not None)


# ---- records files ------------------------------------------------------------------------------
def save_records(path: str | Path, data: dict[str, Any]) -> None:
    """`run_timeline`'s dict to .npz (records as an int64 array) or .json."""
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps(data) + "\n")
        return
    meta = {k: v for k, v in data.items() if k != "records"}
    np.savez(path, records=np.asarray(data["records"], dtype=np.int64),
             meta=np.array(json.dumps(meta)))


def load_records(path: str | Path) -> dict[str, Any]:
    """`save_records`' file (or gpu-check's JSON) -> dict with `records` an int64 array."""
    path = Path(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text())
    else:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"])) if "meta" in z else {}
            data = {**meta, "records": z["records"]}
    data["records"] = np.asarray(data["records"], dtype=np.int64)
    return data


# ---- the timeline build on a GPU ----------------------------------------------------------------
def timeline_build_dir(root: str | Path, cfg, batch: int = 1, tokens: int = 1,  # noqa: ANN001
                       arch: str = "sm_90a") -> Path:
    """Where `build_timeline` puts the variant: root/<spec tag>/ (the tag ends in -timeline),
    holding <arch>/manifest.json; pass it as Megakernel(build_dir=...)."""
    from megakernel.kernel.config.model_spec import make_spec

    return Path(root) / make_spec(cfg, batch, tokens, arch, timeline=True).tag


def build_timeline(cfg, arch: str, root: str | Path, batch: int = 1,  # noqa: ANN001
                   tokens: int = 1) -> dict:
    """AOT-build the timeline variant into timeline_build_dir(root, ...) (needs the DSL);
    returns its manifest."""
    from megakernel.kernel.toolchain.build import build_arch

    out = timeline_build_dir(root, cfg, batch, tokens, arch)
    return build_arch(cfg, arch, out, batch, tokens, timeline=True)


def attach_records(state) -> Any:  # noqa: ANN001, ANN401 (device_state.DeviceState -> Tensor)
    """Give the program a timeline tail: `state.program` becomes a view of the records at the
    head of a zeroed buffer that also holds the timeline records; returns those as an int64
    tensor [num_sms, queue_len, TIMELINE_WORDS] (a view of the same buffer)."""
    import torch

    prog = state.program
    n, q, w = prog.shape
    buf = torch.zeros(timeline_int32_words(n, q), dtype=torch.int32, device=prog.device)
    head = timeline_offset(n, q)
    buf[:head].copy_(prog.reshape(-1))
    state.program = buf[:head].view(n, q, w)
    return buf[head:].view(torch.int64).view(n, q, TIMELINE_WORDS)


def run_timeline(mk, tokens=None) -> dict[str, Any]:  # noqa: ANN001 (kernel_backend.Megakernel)
    """One step of a Megakernel loaded from a timeline build (after its prefill): zero the
    records, step, read them back. Returns a JSON-ready dict: model, batch, tokens, device,
    num_sms, queue_len, fields (TIMELINE_FIELDS), records (nested lists [num_sms][queue_len]
    [TIMELINE_WORDS] of int64 ns), and `instructions` (rows decoded)."""
    import torch

    if mk.timeline is None:
        raise ValueError("this Megakernel was not loaded from a timeline build "
                         "(build_timeline / timeline_build_dir)")
    mk.timeline.zero_()
    mk.step(tokens)
    torch.cuda.synchronize(mk.device)
    rec = mk.timeline.cpu().numpy()
    return {"model": mk.cfg.name, "batch": mk.batch, "tokens": mk.tokens,
            "device": torch.cuda.get_device_name(mk.device), "num_sms": int(rec.shape[0]),
            "queue_len": int(rec.shape[1]), "fields": list(TIMELINE_FIELDS),
            "records": rec.tolist(), "instructions": int(len(decode(rec)))}
