"""`python -m megakernel build`: AOT-compile the kernel for sm_90a / sm_100a
(megakernel.kernel.toolchain.build) and print each build's resources."""

from __future__ import annotations

import argparse
import json
import time

from megakernel.cli.main import CliError, add_weight_arguments, check_writable, weight_options
from megakernel.common.arch import ARCHS
from megakernel.kernel.toolchain.build import build, report_line
from megakernel.models import resolve


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or Hugging Face checkpoint dir")
    p.add_argument("--arch", default=",".join(ARCHS), help="comma list (default sm_90a,sm_100a)")
    p.add_argument("--out", required=True, help="output directory (DIR/<arch>/...)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step B (default 1)")
    p.add_argument("--tokens", type=int, default=1, help="tokens per sequence per step T")
    p.add_argument("--replay-window", type=int, default=0, metavar="L",
                   help="ReplaySSM fold window of the programs it runs (0: recurrent update)")
    p.add_argument("--drafts", type=int, default=0, metavar="K",
                   help="a speculative step's drafts (T = 1 + K, ACCEPT; 0: a plain step)")
    p.add_argument("--ngram", type=int, default=0, metavar="N",
                   help="the device n-gram drafter's longest suffix (0: the host drafts)")
    p.add_argument("--paged", default=None, metavar="BLOCKS,BLOCK_SIZE,MAX_BLOCKS",
                   help="the paged-KV build for this page pool (program/paged.py)")
    p.add_argument("--json", action="store_true", help="print the manifests as JSON last")
    add_weight_arguments(p)


def run(args: argparse.Namespace) -> int:
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in ARCHS] or ([] if archs else [args.arch])
    if bad:
        raise CliError(f"--arch {bad[0]!r} is not a kernel target; choose from "
                       f"{', '.join(ARCHS)} (comma list)")
    check_writable(args.out, "--out", is_dir=True)
    cfg = resolve(args.model, **weight_options(args))
    t0 = time.perf_counter()
    paged = None
    if args.paged:
        from megakernel.program.paged import PagedKV

        try:
            paged = PagedKV(*(int(x) for x in args.paged.split(",")))
        except (TypeError, ValueError) as e:
            raise CliError(f"--paged {args.paged!r}: BLOCKS,BLOCK_SIZE,MAX_BLOCKS ({e})") from None
    manifests = build(cfg, archs, args.out, args.batch, args.tokens, args.replay_window, paged,
                      args.drafts, args.ngram)
    for m in manifests:
        print(report_line(m))
    print(f"built {len(manifests)} arch(es) into {args.out} in {time.perf_counter() - t0:.1f} s")
    if args.json:
        print(json.dumps(manifests))
    return 0
