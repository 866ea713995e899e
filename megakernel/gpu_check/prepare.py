"""`gpu-check --prepare`: AOT-build, on a machine with the DSL, every cubin the run needs (an FP8
case's build is of its format: KernelSpec.fp8 is in the spec's tag, so it lands in its own
directory of the build set, beside the bf16 build of the same shape)."""

from __future__ import annotations

import time
from pathlib import Path

from megakernel.gpu_check.cases import Case, stage_cases, variant_dir
from megakernel.kernel.host.variants import VARIANTS


def wanted(stages: list[int] | None = None) -> list[tuple[Case, str]]:
    """(case, variant) of every build (or of `stages`'): the stages' cases and, with stage 2,
    the benchmark's variants."""
    from megakernel.gpu_check.driver import bench_items

    out = stage_cases(stages)
    if stages is None or 2 in stages:
        out += [(Case.from_dict(it["case"]), it["variant"])
                for it in bench_items(Path("."), None) if it["kind"] in ("bench", "timeline")]
    return out


def prepare(build_dir: str | Path, archs: list[str], cases: list[tuple[Case, str]] | None = None,
            stages: list[int] | None = None) -> tuple[list[dict], list[str]]:
    """Build every (case, variant) for every arch (or `cases`, or those of `stages`), and the HBM
    stream kernel (all stages); a build that fails (or a variant that cannot serve a case) is
    reported and skipped. Returns the manifests and the failures ('variant case arch: error')."""
    from megakernel.kernel.config.model_spec import make_spec
    from megakernel.kernel.toolchain.build import build_arch

    out, failed, done = [], [], set()
    todo = wanted(stages) if cases is None else cases
    for c, v in [(b, variant) for case, variant in todo for b in case.builds()]:
        cfg = c.config()  # in the case's weight format: an FP8 case gets its FP8 build
        fmt = f" {c.weights}" if c.fp8 else ""
        for arch in archs:
            for pool in (None, c.pool()) if c.paged else (None,):  # a paged case: both builds
                what = (f"{v} {c.model} B={c.batch} T={c.tokens}{fmt}{' paged' if pool else ''} "
                        f"{arch}")
                t0 = time.perf_counter()
                try:
                    # can the variant serve it? and the tag find_build looks for
                    make_spec(cfg, c.batch, c.tokens, arch, **VARIANTS[v], paged=pool,
                              **c.build_kw)
                    tag = make_spec(cfg, c.batch, c.tokens, arch, paged=pool, **c.build_kw).tag
                    if (tag, arch, v) in done:
                        continue
                    done.add((tag, arch, v))
                    m = build_arch(cfg, arch, variant_dir(build_dir, v) / tag, c.batch,
                                   c.tokens, **VARIANTS[v], paged=pool, **c.build_kw)
                except Exception as e:  # SpecError (the variant cannot serve it), BuildError
                    failed.append(f"{what}: {type(e).__name__}: {str(e)[:300]}")
                    print(f"FAILED {failed[-1]}", flush=True)
                    continue
                r = m["resources"]
                print(f"built {what}: {r['registers']} regs, spills {r['spill_stores']}/"
                      f"{r['spill_loads']}, smem {m['dynamic_smem_bytes']} B, "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
                out.append(m)
    if cases is None and stages is None:
        out += _stream(build_dir, archs, failed)
    return out, failed


def _stream(build_dir: str | Path, archs: list[str], failed: list[str]) -> list[dict]:
    from megakernel.kernel.toolchain.stream_build import build_stream
    from megakernel.measure.bandwidth import stream_build_dir

    out = []
    for arch in archs:
        try:
            out.append(build_stream(stream_build_dir(build_dir), arch))
            print(f"built the HBM stream kernel for {arch}", flush=True)
        except Exception as e:
            failed.append(f"stream {arch}: {type(e).__name__}: {str(e)[:300]}")
            print(f"FAILED {failed[-1]}", flush=True)
    return out
