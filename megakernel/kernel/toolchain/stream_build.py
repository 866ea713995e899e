"""AOT build of the HBM read-stream kernel (megakernel.kernel.device.stream):

    python -m megakernel.kernel.toolchain.stream_build --out DIR [--arch sm_90a,sm_100a]

writes DIR/<arch>/{stream.cubin, stream.ptx, manifest.json} (megakernel.measure.bandwidth launches
it), refusing a build with spills, local memory or a PTX entry other than the launcher's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from megakernel.common.arch import ARCHS
from megakernel.kernel.host.limits import SMEM_STAGE_BYTES
from megakernel.kernel.toolchain.build import BuildError, compile_kernel, dsl_version
from megakernel.kernel.toolchain.tools import parse_ptx_entry, resource_report


def build_stream(out_dir: str | Path, arch: str, stage_bytes: int = SMEM_STAGE_BYTES,
                 stages: int | None = None) -> dict:
    """Compile the stream kernel for `arch` into out_dir/<arch>/ and return its manifest; refuses
    (BuildError) a build with spills or local memory or a PTX entry other than PARAMS."""
    import cutlass.cute as cute
    import torch  # noqa: F401  (the DSL imports it lazily on first compile; pay it up front)
    from cutlass import Int32
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    from megakernel.kernel.device.stream import (
        CUBIN_NAME,
        KERNEL_NAME,
        MANIFEST_NAME,
        PARAMS,
        PTX_NAME,
        STREAM_STAGES,
        STREAM_THREADS,
        HbmStream,
    )

    if arch not in ARCHS:
        raise BuildError(f"unsupported arch {arch!r}; supported: {', '.join(ARCHS)}")
    stages = STREAM_STAGES if stages is None else stages
    k = HbmStream(stage_bytes, stages)
    dest = Path(out_dir) / arch
    dest.mkdir(parents=True, exist_ok=True)
    ptr = make_ptr(Int32, 256, cute.AddressSpace.gmem, assumed_align=16)
    args = [ptr, ptr, Int32(1), Int32(1), make_fake_stream()]
    with tempfile.TemporaryDirectory(prefix="mk-stream-") as dump:
        ptx_src, cubin_src, seconds = compile_kernel(k, args, arch, dump)
        shutil.copyfile(ptx_src, dest / PTX_NAME)
        shutil.copyfile(cubin_src, dest / CUBIN_NAME)
    entry = parse_ptx_entry((dest / PTX_NAME).read_text())
    kinds = tuple("ptr" if p.is_pointer else "i32" for p in entry.params)
    if kinds != tuple(kind for _, kind in PARAMS):
        raise BuildError(f"stream PTX entry takes {kinds}, the launcher passes {PARAMS}")
    res = resource_report(str(dest / CUBIN_NAME), str(dest / PTX_NAME), arch, entry.name)
    if res["spill_stores"] or res["spill_loads"] or res["local_bytes"] or res["local_stores"] \
            or res["local_loads"]:
        raise BuildError(f"stream kernel for {arch} spills or uses local memory: {res}")
    manifest = {
        "kernel": KERNEL_NAME,
        "arch": arch,
        "symbol": entry.name,
        "cubin": CUBIN_NAME,
        "ptx": PTX_NAME,
        "cubin_sha256": hashlib.sha256((dest / CUBIN_NAME).read_bytes()).hexdigest(),
        "block": [STREAM_THREADS, 1, 1],
        "dynamic_smem_bytes": k.smem_bytes,
        "stage_bytes": stage_bytes,
        "stages": stages,
        "params": [{"name": n, "kind": kind} for n, kind in PARAMS],
        "dsl_version": dsl_version(),
        "resources": res,
        "compile_seconds": round(seconds, 3),
    }
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="AOT-build the HBM read-stream kernel")
    ap.add_argument("--out", required=True, help="output directory (DIR/<arch>/...)")
    ap.add_argument("--arch", default=",".join(ARCHS))
    args = ap.parse_args(argv)
    for a in (x.strip() for x in args.arch.split(",") if x.strip()):
        m = build_stream(args.out, a)
        r = m["resources"]
        print(f"{a:8s} stream: regs {r['registers']}  spills {r['spill_stores']}/"
              f"{r['spill_loads']} B  local {r['local_bytes']} B  smem "
              f"{m['dynamic_smem_bytes']} B  compile {m['compile_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
