"""Which device code the emulated cases executed: PTX lines hit, mapped to the Python lines and
functions of the kernel's modules through the `.loc` directives of a line-info build.

Collection works across processes: with MEGAKERNEL_COVERAGE set to a file, every emulated launch
(megakernel.launch.emulated.EmulatedKernel, through `record`) appends one JSON line, the build's PTX
path and the lines it executed. A build carries `.loc` only when compiled with MEGAKERNEL_LINE_INFO
set (kernel/toolchain/fingerprint.py: such builds are cached under their own key); launches of plain
builds are counted but cannot be mapped. `Coverage` folds the records: per (module, line) of device
code, whether any PTX instruction it emitted ran, in any build. The report names, per module and per
function, the lines that emitted code and never ran.

megakernel.gpu_check.coverage runs the emulated matrix and writes the report.
"""

from __future__ import annotations

import ast
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\b")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
KERNEL_PKG = Path(__file__).resolve().parents[1] / "kernel" / "device"  # the modules .loc names
ENV_COVERAGE = "MEGAKERNEL_COVERAGE"  # a file: each launch appends what it executed (record)


def loc_map(ptx: str) -> dict[int, tuple[str, int]]:
    """PTX line (1-based) of each instruction -> (kernel module file name, Python line) of the
    `.loc` directive in force there; empty for a build without line info."""
    lines = ptx.splitlines()
    files = {m.group(1): Path(m.group(2)).name for m in map(_FILE.match, lines) if m}  # at the end
    out: dict[int, tuple[str, int]] = {}
    cur: tuple[str, int] | None = None
    for n, text in enumerate(lines, 1):
        m = _LOC.match(text)
        if m:
            name = files.get(m.group(1))
            cur = (name, int(m.group(2))) if name else None
            continue
        s = text.strip()
        if cur and s and not s.startswith((".", "//", "$", "{", "}", ")", "(")):
            out[n] = cur
    return out


def functions(path: Path) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function of a module, inner ones last."""
    tree = ast.parse(path.read_text())
    found: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.ClassDef):
                walk(ch, f"{prefix}{ch.name}.")
            elif isinstance(ch, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((ch.lineno, ch.end_lineno or ch.lineno, prefix + ch.name))
                walk(ch, f"{prefix}{ch.name}.")

    walk(tree, "")
    return found


@dataclass
class Coverage:
    """Device-code lines that emitted PTX (`emitted`) and those any launch executed (`reached`)."""

    emitted: set[tuple[str, int]] = field(default_factory=set)
    reached: set[tuple[str, int]] = field(default_factory=set)
    launches: int = 0
    unmapped: int = 0  # launches of builds without line info
    _maps: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)

    def add(self, ptx_path: str, hits: list[int]) -> None:
        m = self._maps.get(ptx_path)
        if m is None:
            m = self._maps[ptx_path] = loc_map(Path(ptx_path).read_text())
            self.emitted |= set(m.values())
        self.launches += 1
        if not m:
            self.unmapped += 1
        self.reached |= {m[h] for h in hits if h in m}

    def add_records(self, path: Path) -> None:
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                self.add(d["ptx"], d["hits"])

    def by_function(self) -> dict[str, list[tuple[str, int, int, list[int]]]]:
        """module -> [(function, lines emitted, lines reached, unreached lines)], in source
        order; a line belongs to its innermost function (module level: '<module>')."""
        per: dict[tuple[str, str], list[int]] = defaultdict(list)
        hit: dict[tuple[str, str], int] = defaultdict(int)
        fns: dict[str, list[tuple[int, int, str]]] = {}
        for mod, line in sorted(self.emitted):
            if mod not in fns:
                p = KERNEL_PKG / mod
                fns[mod] = functions(p) if p.is_file() else []
            inner = [f for f in fns[mod] if f[0] <= line <= f[1]]
            name = max(inner, key=lambda f: f[0])[2] if inner else "<module>"
            per[mod, name].append(line)
            hit[mod, name] += (mod, line) in self.reached
        out: dict[str, list[tuple[str, int, int, list[int]]]] = defaultdict(list)
        for (mod, name), lines in per.items():
            out[mod].append((name, len(lines), hit[mod, name],
                             [x for x in lines if (mod, x) not in self.reached]))
        for mod in out:
            out[mod].sort(key=lambda r: min(r[3] or [10**9]))
        return dict(sorted(out.items()))

    def report(self, title: str = "Device-code coverage on the emulator") -> str:
        rows = [f"# {title}", "",
                f"{self.launches} emulated launches ({self.unmapped} of builds without line "
                f"info); {len(self.reached)} of {len(self.emitted)} device-code lines that emit "
                f"PTX executed ({pct(len(self.reached), len(self.emitted))}).", "",
                "| module | lines emitting PTX | executed | coverage |", "|---|---|---|---|"]
        table = self.by_function()
        for mod, fs in table.items():
            e, h = sum(f[1] for f in fs), sum(f[2] for f in fs)
            rows.append(f"| {mod} | {e} | {h} | {pct(h, e)} |")
        rows += ["", "## Never executed", "",
                 "Functions none of whose lines ran, then lines not reached inside functions "
                 "that did run.", ""]
        for mod, fs in table.items():
            dead = [f[0] for f in fs if f[2] == 0]
            part = [(f[0], f[3]) for f in fs if f[2] and f[3]]
            if not dead and not part:
                continue
            rows.append(f"- **{mod}**")
            if dead:
                rows.append(f"  - unreached functions: {', '.join(f'`{d}`' for d in dead)}")
            for name, lines in part:
                rows.append(f"  - `{name}`: lines {spans(lines)}")
        return "\n".join(rows) + "\n"


def pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def spans(lines: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    runs: list[list[int]] = []
    for x in sorted(lines):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def record(ptx_path: Path, hits: dict[int, int]) -> None:
    """Append one launch's executed PTX lines to $MEGAKERNEL_COVERAGE, if set (`Coverage` folds
    them)."""
    dest = os.environ.get(ENV_COVERAGE)
    if not dest:
        return
    with open(dest, "a") as f:
        f.write(json.dumps({"ptx": str(ptx_path), "hits": sorted(hits)}) + "\n")
