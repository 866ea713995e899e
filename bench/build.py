"""AOT build time of the megakernel per preset and arch (CPU; needs the DSL, not a GPU).

    python bench/build.py [--models llama-3.2-1b,qwen3-0.6b] [--arch sm_90a,sm_100a] [--out DIR]

Each (model, arch) is compiled in a fresh process (the first cute.compile of a process pays the
DSL's lazy imports, which is what a user's `make build` pays too). Prints a table and writes
DIR/build_times.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megakernel.cli.main import check_names  # noqa: E402
from megakernel.common.arch import ARCHS  # noqa: E402
from megakernel.common.progress import stage  # noqa: E402
from megakernel.models import presets  # noqa: E402


def time_build(model: str, arch: str, batch: int, out: Path) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "megakernel", "build", "--model", model,
                        "--arch", arch, "--batch", str(batch), "--out", str(out), "--json"],
                       cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"model": model, "arch": arch, "batch": batch, "error": r.stderr[-2000:]}
    m = json.loads(r.stdout.strip().splitlines()[-1])[0]
    res = m["resources"]
    return {"model": model, "arch": arch, "batch": batch, "wall_s": round(wall, 2),
            "compile_s": m["compile_seconds"], "registers": res["registers"],
            "spill_bytes": res["spill_stores"] + res["spill_loads"],
            "smem_bytes": m["dynamic_smem_bytes"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--arch", default="sm_90a,sm_100a")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=None, help="where to write build_times.json")
    args = ap.parse_args()
    models = check_names("--models", args.models, list(presets()))
    archs = check_names("--arch", args.arch, list(ARCHS))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for arch in archs:
                with stage(f"building {model} for {arch}"):
                    rows.append(time_build(model, arch, args.batch, Path(tmp) / model))
    print(f"{'model':14s} {'arch':8s} {'wall s':>7s} {'compile s':>9s} {'regs':>5s} "
          f"{'spill B':>7s} {'smem B':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:14s} {r['arch']:8s} FAILED: {r['error'].splitlines()[-1]}")
            continue
        print(f"{r['model']:14s} {r['arch']:8s} {r['wall_s']:7.1f} {r['compile_s']:9.1f} "
              f"{r['registers']:5d} {r['spill_bytes']:7d} {r['smem_bytes']:7d}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "build_times.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    from megakernel.cli.main import run_main

    sys.exit(run_main(main))
