"""CPU-side inspection of compiled kernels: PTX `.entry` signatures and cubin resource usage.

Nothing here imports the DSL: the runtime and the tests read manifests, PTX and cubins with it on a
machine that has only torch and cuda-python. Binaries (cuobjdump, ptxas, nvdisasm) are looked up in
the installed NVIDIA wheels first, then on PATH, then under CUDA_HOME / CUDA_PATH.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass


class ToolError(RuntimeError):
    """A binary needed to inspect a cubin is missing or failed."""


def find_tool(name: str) -> str | None:
    """Path of an NVIDIA command-line tool, or None when none is installed."""
    roots: list[str] = []
    try:  # namespace package of the nvidia-* wheels (nvidia/cu13/bin/cuobjdump, ...)
        import nvidia

        roots.extend(list(nvidia.__path__))
    except ImportError:
        pass
    roots.append(os.path.join(sysconfig.get_paths()["purelib"], "nvidia"))
    for root in roots:
        for cand in sorted(glob.glob(os.path.join(root, "*", "bin", name))):
            if os.access(cand, os.X_OK):
                return cand
    found = shutil.which(name)
    if found:
        return found
    for env in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(env)
        if home:
            cand = os.path.join(home, "bin", name)
            if os.access(cand, os.X_OK):
                return cand
    return None


# ---- PTX entry signature ------------------------------------------------------------------------
@dataclass(frozen=True)
class PtxParam:
    """One `.param` of a PTX kernel entry."""

    ptx_type: str  # "u64", "u32", "f32", "b8", ...
    is_pointer: bool  # `.ptr` qualifier (a global pointer)
    align: int | None
    array: int | None  # `[N]` for by-value structs

    @property
    def size(self) -> int:
        width = int(re.sub(r"\D", "", self.ptx_type) or 8) // 8
        return width * (self.array or 1)


@dataclass(frozen=True)
class PtxEntry:
    name: str
    params: tuple[PtxParam, ...]
    reqntid: tuple[int, ...] | None


_ENTRY_RE = re.compile(r"\.visible\s+\.entry\s+([A-Za-z_$][\w$]*)\s*\((.*?)\)", re.S)
_PARAM_RE = re.compile(
    r"\.param(?:\s+\.align\s+(?P<align0>\d+))?\s+\.(?P<type>[a-z]\d+)(?P<ptr>\s+\.ptr)?"
    r"(?:\s+\.(?:global|shared|const|local))?(?:\s+\.align\s+(?P<align>\d+))?"
    r"\s+(?P<name>[\w$]+)(?:\[(?P<arr>\d+)\])?"
)


def parse_ptx_entries(ptx: str) -> list[PtxEntry]:
    """All `.visible .entry` kernels of a PTX module with their parameter lists."""
    entries = []
    for m in _ENTRY_RE.finditer(ptx):
        name, body = m.group(1), m.group(2)
        params = []
        for chunk in body.split(","):
            chunk = " ".join(chunk.split())
            if not chunk:
                continue
            pm = _PARAM_RE.search(chunk)
            if pm is None:
                raise ToolError(f"cannot parse PTX parameter {chunk!r} of entry {name}")
            params.append(PtxParam(
                ptx_type=pm["type"],
                is_pointer=bool(pm["ptr"]),
                align=int(pm["align"] or pm["align0"]) if (pm["align"] or pm["align0"]) else None,
                array=int(pm["arr"]) if pm["arr"] else None,
            ))
        tail = ptx[m.end(): m.end() + 400]
        rq = re.match(r"\s*(?:\.\w+[^\n]*\n\s*)*?\.reqntid\s+([\d,\s]+)", tail)
        reqntid = None
        if rq:
            reqntid = tuple(int(x) for x in rq.group(1).replace(" ", "").split(",") if x)
        entries.append(PtxEntry(name, tuple(params), reqntid))
    return entries


def parse_ptx_entry(ptx: str, name: str | None = None) -> PtxEntry:
    """The single (or the named) kernel entry of a PTX module."""
    entries = parse_ptx_entries(ptx)
    if name is not None:
        entries = [e for e in entries if e.name == name]
    if len(entries) != 1:
        raise ToolError(f"expected one PTX entry{f' named {name}' if name else ''}, "
                        f"found {len(entries)}")
    return entries[0]


def ptx_target(ptx: str) -> str | None:
    m = re.search(r"^\s*\.target\s+(\w+)", ptx, re.M)
    return m.group(1) if m else None


# ---- resource usage -----------------------------------------------------------------------------
_RES_RE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def cubin_resources(cubin_path: str, symbol: str | None = None) -> dict[str, int]:
    """{registers, stack_bytes, shared_bytes (static + reserved), local_bytes} via cuobjdump."""
    tool = find_tool("cuobjdump")
    if tool is None:
        raise ToolError("cuobjdump not found (install the nvidia-cuda-cuobjdump wheel or set "
                        "CUDA_HOME)")
    out = subprocess.run([tool, "-res-usage", cubin_path], capture_output=True, text=True)
    if out.returncode != 0:
        raise ToolError(f"cuobjdump -res-usage failed: {out.stderr.strip()}")
    text = out.stdout
    blocks = re.split(r"\n\s*Function\s+", text)[1:]
    for block in blocks:
        fname, _, rest = block.partition(":")
        if symbol is not None and fname.strip() != symbol:
            continue
        m = _RES_RE.search(rest)
        if m:
            return {"registers": int(m[1]), "stack_bytes": int(m[2]),
                    "shared_bytes": int(m[3]), "local_bytes": int(m[4])}
    raise ToolError(f"no resource line for {symbol or 'any function'} in cuobjdump output")


def ptxas_report(ptx_path: str, arch: str) -> dict[str, int] | None:
    """{spill_stores, spill_loads, ptxas_registers} from `ptxas -v`, or None without a ptxas."""
    tool = find_tool("ptxas")
    if tool is None:
        return None
    out = subprocess.run([tool, f"-arch={arch}", "-v", ptx_path, "-o", os.devnull],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None  # e.g. an older ptxas that does not know the arch; cuobjdump still reports
    log = out.stdout + out.stderr
    sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    rg = re.search(r"Used (\d+) registers", log)
    if not (sp and rg):
        return None
    return {"spill_stores": int(sp[1]), "spill_loads": int(sp[2]), "ptxas_registers": int(rg[1])}


def sass_text(cubin_path: str) -> str:
    """SASS of a cubin (cuobjdump -sass, or nvdisasm)."""
    tool = find_tool("cuobjdump")
    if tool is not None:
        out = subprocess.run([tool, "-sass", cubin_path], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout
    tool = find_tool("nvdisasm")
    if tool is None:
        raise ToolError("neither cuobjdump nor nvdisasm found to disassemble the cubin")
    out = subprocess.run([tool, "-c", cubin_path], capture_output=True, text=True)
    if out.returncode != 0:
        raise ToolError(f"nvdisasm failed: {out.stderr.strip()}")
    return out.stdout


def sass_stats(sass: str) -> dict[str, int]:
    """Counts of the instructions the build rules look at (local traffic, wide loads, barriers)."""
    def count(pat: str) -> int:
        return len(re.findall(pat, sass))

    return {
        "sass_instructions": count(r"/\*[0-9a-f]{4,}\*/\s+[^;]*;"),
        "local_stores": count(r"\bSTL(?:\.\w+)*\b"),
        "local_loads": count(r"\bLDL(?:\.\w+)*\b"),
        "global_loads_128": count(r"\bLDG\.E\.(?:\w+\.)*128\b"),
        "shared_loads_128": count(r"\bLDS\.128\b"),
        "nanosleep": count(r"\bNANOSLEEP\b"),
    }


def resource_report(cubin_path: str, ptx_path: str, arch: str, symbol: str) -> dict[str, object]:
    """The manifest's `resources`: cuobjdump figures, spills (ptxas -v or SASS), SASS counts."""
    res = cubin_resources(cubin_path, symbol)
    stats = sass_stats(sass_text(cubin_path))
    rep = ptxas_report(ptx_path, arch)
    if rep is not None:
        spill_st, spill_ld = rep["spill_stores"], rep["spill_loads"]
    else:  # no matching ptxas: any local-memory instruction in the SASS counts as a spill
        spill_st, spill_ld = stats["local_stores"], stats["local_loads"]
    return {
        "registers": res["registers"],
        "spill_stores": spill_st,
        "spill_loads": spill_ld,
        "local_bytes": res["local_bytes"],
        "stack_bytes": res["stack_bytes"],
        "shared_bytes": res["shared_bytes"],
        **stats,
        "spill_source": "ptxas -v" if rep is not None else "sass STL/LDL count",
    }
