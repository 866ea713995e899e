"""AOT build: compile the megakernel for sm_90a / sm_100a on any machine and write what the runtime
needs to launch it without the DSL.

    python -m megakernel build --model llama-3.2-1b --arch sm_90a,sm_100a --out DIR [--batch B]

writes, per arch, DIR/<arch>/{megakernel.cubin, megakernel.ptx, manifest.json}. The manifest holds
the entry symbol, the parameter layout (checked against the PTX `.entry`), block size, dynamic
shared memory, the program FORMAT_VERSION, a fingerprint of sources + DSL version + arch + static
config, and the resource report read from the cubin (registers, spills, local memory, shared
memory). A build that spills, uses local memory or exceeds the register or shared-memory budget
fails here rather than on a GPU.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.config.spec import PARAMS, KernelSpec
from megakernel.kernel.host import limits
from megakernel.kernel.toolchain import fingerprint
from megakernel.kernel.toolchain.tools import PtxEntry, parse_ptx_entry, resource_report
from megakernel.models import ModelConfig

MANIFEST_VERSION = 1
CUBIN_NAME = "megakernel.cubin"
PTX_NAME = "megakernel.ptx"
MANIFEST_NAME = "manifest.json"


class BuildError(RuntimeError):
    """The kernel did not compile, or its compiled form breaks a build rule (named)."""


def dsl_version() -> str:
    import cutlass

    return str(getattr(cutlass, "__version__", "unknown"))


# ---- ABI check ----------------------------------------------------------------------------------
def check_entry_matches(entry: PtxEntry, params=PARAMS) -> None:
    """The PTX entry takes exactly the manifest's parameters, in order, with the same kinds."""
    if len(entry.params) != len(params):
        raise BuildError(f"PTX entry {entry.name} has {len(entry.params)} parameters, the ABI "
                         f"lists {len(params)} ({', '.join(p.name for p in params)})")
    for i, (pp, want) in enumerate(zip(entry.params, params, strict=True)):
        if want.kind == "ptr":
            ok = pp.is_pointer and pp.ptx_type in ("u64", "b64", "s64") and pp.array is None
        else:
            ok = (not pp.is_pointer) and pp.ptx_type in ("u32", "s32", "b32") and pp.array is None
        if not ok:
            raise BuildError(f"parameter {i} ({want.name}) is {want.kind} in the ABI but "
                             f".param .{pp.ptx_type}{' .ptr' if pp.is_pointer else ''}"
                             f"{f'[{pp.array}]' if pp.array else ''} in the PTX")
        if pp.size != want.size:
            raise BuildError(f"parameter {i} ({want.name}) is {pp.size} bytes in the PTX, "
                             f"{want.size} in the ABI")


def check_resources(res: dict, spec: KernelSpec) -> None:
    """Build rules: no spills, no local memory, registers and shared memory within budget
    (per CTA: the opt-in limit; per SM: with the 1 KiB the driver reserves per block)."""
    problems = []
    if res["spill_stores"] or res["spill_loads"]:
        problems.append(f"register spills ({res['spill_stores']} B stores, "
                        f"{res['spill_loads']} B loads)")
    if res["local_bytes"] or res["local_stores"] or res["local_loads"]:
        problems.append(f"local memory ({res['local_bytes']} B, {res['local_stores']} STL, "
                        f"{res['local_loads']} LDL)")
    if res["registers"] > limits.REGISTER_BUDGET:
        problems.append(f"{res['registers']} registers > budget {limits.REGISTER_BUDGET}")
    if res["registers"] * spec.block_threads > 65536:
        problems.append(f"{res['registers']} registers x {spec.block_threads} threads do not fit "
                        f"one SM's register file")
    if spec.smem_bytes > limits.SMEM_BUDGET:
        problems.append(f"dynamic shared memory {spec.smem_bytes} B > budget "
                        f"{limits.SMEM_BUDGET}")
    if spec.smem_bytes + res["shared_bytes"] > limits.SMEM_OPTIN:
        problems.append(f"shared memory {spec.smem_bytes} + {res['shared_bytes']} B > the "
                        f"{limits.SMEM_OPTIN} B a CTA may opt into")
    per_sm = spec.smem_bytes + res["shared_bytes"] + limits.SMEM_RESERVED_PER_BLOCK
    if per_sm > limits.SMEM_PER_SM:
        problems.append(f"shared memory per SM {spec.smem_bytes} dynamic + {res['shared_bytes']} "
                        f"static + {limits.SMEM_RESERVED_PER_BLOCK} reserved by the driver = "
                        f"{per_sm} B > the SM's {limits.SMEM_PER_SM} B: the CTA cannot be "
                        f"resident")
    if problems:
        raise BuildError(f"{spec.arch} build breaks the kernel rules: " + "; ".join(problems))


# ---- compile ------------------------------------------------------------------------------------
def compile_to(spec: KernelSpec, dump_dir: str, line_info: bool = False,
               ) -> tuple[str, str, float]:
    """cute.compile for `spec.arch` with PTX + cubin kept in `dump_dir`; (ptx, cubin, seconds).
    `line_info`: the PTX carries `.loc` directives naming the device code's Python lines (the
    emulator's coverage report reads them)."""
    import cutlass.cute as cute
    import torch  # noqa: F401  (the DSL imports it lazily on first compile; pay it up front)
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    from megakernel.kernel.device.megakernel import DecodeMegakernel

    os.makedirs(dump_dir, exist_ok=True)  # the DSL writes nothing into a missing dump dir
    dtypes = {"int32": Int32, "bfloat16": BFloat16, "float32": Float32}
    args = []
    for p in PARAMS:
        if p.kind == "ptr":
            args.append(make_ptr(dtypes[p.dtype], 256, cute.AddressSpace.gmem, assumed_align=16))
        else:
            args.append(Int32(1))
    args += [Int32(1), make_fake_stream()]  # num_ctas (host-side grid), stream
    return compile_kernel(DecodeMegakernel(spec), args, spec.arch, dump_dir, line_info)


def compile_kernel(kernel, args: list, arch: str, dump_dir: str,  # noqa: ANN001
                   line_info: bool = False) -> tuple[str, str, float]:
    """cute.compile(kernel, *args) for `arch`, PTX + cubin kept in `dump_dir` (which exists);
    (ptx, cubin, seconds). Shared by every AOT-built kernel (the megakernel, the HBM stream)."""
    import cutlass.cute as cute

    options = f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    if line_info:
        options += " --generate-line-info"
    t0 = time.perf_counter()
    try:
        cute.compile(kernel, *args, options=options)
    except Exception as e:  # the DSL's own errors are long; keep the head
        raise BuildError(f"cute.compile failed for {arch}: {str(e)[:2000]}") from e
    dt = time.perf_counter() - t0
    return _newest(dump_dir, f"*.{arch}.ptx"), _newest(dump_dir, f"*.{arch}.cubin"), dt


def _newest(d: str, pattern: str) -> str:
    found = glob.glob(os.path.join(d, pattern))
    if not found:
        raise BuildError(f"the compiler wrote no {pattern} into {d}")
    return max(found, key=os.path.getmtime)


def build_arch(cfg: ModelConfig, arch: str, out_dir: str | Path, batch: int = 1,
               tokens: int = 1, num_threads: int = limits.NUM_THREADS,
               smem_stages: int | None = None, timeline: bool = False,
               l2_window: int = -1, replay_window: int = 0,
               paged=None, drafts: int = 0,  # noqa: ANN001 (PagedKV | None)
               ngram: int = 0) -> dict:
    """Compile one arch into out_dir/<arch>/ and return its manifest (`smem_stages`: the
    shared-memory weight pipeline's stages, None = the deepest ring that fits, spec.make_spec;
    `timeline`: the variant that records per-instruction times, megakernel/measure/timeline.py;
    `replay_window`: the ReplaySSM fold window L of the programs it runs, 0 = recurrent;
    `paged`: the paged-KV build for this page pool, program/paged.PagedKV; `drafts`, `ngram`:
    the speculative step's k drafts and device n-gram drafter, layers/speculative.py)."""
    spec = make_spec(cfg, batch, tokens, arch, num_threads, smem_stages, timeline, l2_window,
                     replay_window=replay_window, paged=paged, drafts=drafts, ngram=ngram)
    return build_spec(spec, cfg, out_dir)


def build_spec(spec: KernelSpec, cfg: ModelConfig, out_dir: str | Path,
               line_info: bool | None = None) -> dict:
    """Compile `spec` (for model `cfg`) into out_dir/<spec.arch>/, check its resources, write and
    return its manifest (build_arch's second half; a handler under development builds a
    make_spec(..., unhandled="trap") spec with it). `line_info`: compile_to's (None:
    fingerprint.ENV_LINE_INFO decides)."""
    if line_info is None:
        line_info = fingerprint.line_info_requested()
    arch, batch, tokens = spec.arch, spec.batch, spec.tokens
    dest = Path(out_dir) / arch
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mk-dump-") as dump:
        ptx_src, cubin_src, seconds = compile_to(spec, dump, line_info)
        shutil.copyfile(ptx_src, dest / PTX_NAME)
        shutil.copyfile(cubin_src, dest / CUBIN_NAME)
    ptx = (dest / PTX_NAME).read_text()
    entry = parse_ptx_entry(ptx)
    check_entry_matches(entry)
    res = resource_report(str(dest / CUBIN_NAME), str(dest / PTX_NAME), arch, entry.name)
    check_resources(res, spec)
    if entry.reqntid is not None and entry.reqntid[0] != spec.block_threads:
        raise BuildError(f"PTX requires {entry.reqntid} threads, spec says {spec.block_threads}")
    dsl = dsl_version()
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "arch": arch,
        "symbol": entry.name,
        "cubin": CUBIN_NAME,
        "ptx": PTX_NAME,
        "cubin_sha256": hashlib.sha256((dest / CUBIN_NAME).read_bytes()).hexdigest(),
        "block": [spec.block_threads, 1, 1],
        "smem_stages": spec.smem_stages,
        "dynamic_smem_bytes": spec.smem_bytes,
        "cooperative": True,
        "params": [{"name": p.name, "kind": p.kind, "dtype": p.dtype, "size": p.size,
                    "doc": p.doc} for p in PARAMS],
        "program_format_version": isa.FORMAT_VERSION,
        "fingerprint": fingerprint.fingerprint(spec, dsl, line_info),
        "dsl_version": dsl,
        "spec": spec.to_dict(),
        "model": cfg.name,
        "model_config": cfg.hf_config(),
        "batch": batch,
        "tokens": tokens,
        "resources": res,
        "budgets": {"registers": limits.REGISTER_BUDGET, "smem_bytes": limits.SMEM_BUDGET},
        "compile_seconds": round(seconds, 3),
        "line_info": line_info,
    }
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def build(cfg: ModelConfig, archs: list[str], out_dir: str | Path, batch: int = 1,
          tokens: int = 1, replay_window: int = 0,
          paged=None, drafts: int = 0, ngram: int = 0) -> list[dict]:  # noqa: ANN001 (PagedKV)
    for a in archs:
        if a not in ARCHS:
            raise BuildError(f"unsupported arch {a!r}; supported: {', '.join(ARCHS)}")
    return [build_arch(cfg, a, out_dir, batch, tokens, replay_window=replay_window, paged=paged,
                       drafts=drafts, ngram=ngram) for a in archs]


def report_line(m: dict) -> str:
    r = m["resources"]
    q = (m.get("model_config") or {}).get("quantization_config")
    fmt = "" if q is None else " fp8"
    spec = m.get("spec") or {}
    if spec.get("drafts"):
        fmt += f" k={spec['drafts']}" + (f" ngram={spec['ngram']}" if spec.get("ngram") else "")
    return (f"{m['arch']:8s} {m['model'] or '?':14s}{fmt} B={m['batch']} T={m['tokens']}  "
            f"regs {r['registers']:3d}  spills {r['spill_stores']}/{r['spill_loads']} B  "
            f"local {r['local_bytes']} B  smem {m['dynamic_smem_bytes']} B  "
            f"stages {m.get('smem_stages', 0)}  "
            f"compile {m['compile_seconds']:.1f} s")
