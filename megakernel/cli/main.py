"""Command line: `python -m megakernel <command> [options]`, and the helpers its commands share.

Commands live in the `COMMANDS` table: name -> `Command(help, module, add, run)`. Only the chosen
command's module is imported, so a heavy or missing module (the DSL build, the GPU check) never
slows down or breaks the others, and this module imports nothing at the top but the standard
library and megakernel.common.errors. (The package itself imports torch and registers the op when
loaded, never the DSL: the GPU machine runs every command but build without it.) Adding a command
is one `register(...)` line plus a module exposing `add_arguments(parser)` and `run(args) -> int`
(cli/info.py, cli/generate.py, cli/plan.py, ...).

A user error (megakernel.common.errors.UserError: bad config, bad checkpoint, bad token ids, ...)
prints `error: <message>` on stderr and exits with status 2; anything else is a bug and keeps its
traceback. `run_main` does the same for the scripts under bench/.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megakernel.common.errors import UserError

PROG = "python -m megakernel"


class CliError(UserError, ValueError):
    """Bad command-line input (syntax of --prompt-ids, incompatible options, ...)."""


@dataclass(frozen=True)
class Command:
    help: str
    module: str  # imported only when this command runs
    add: str = "add_arguments"  # add(parser) -> None
    run: str = "run"  # run(args) -> int (exit status)


COMMANDS: dict[str, Command] = {}


def register(
    name: str, help: str, module: str, add: str = "add_arguments", run: str = "run"
) -> None:
    """Add (or replace) a subcommand; see the module docstring."""
    COMMANDS[name] = Command(help, module, add, run)


def check_names(flag: str, text: str, known: Sequence[str]) -> list[str]:
    """A comma list of names -> the list; CliError naming `flag` and the known names when one is
    unknown (for sweeps, so a typo fails before the first long stage, not after)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known] or ([] if names else [text])
    if bad:
        raise CliError(f"{flag}: unknown name {bad[0]!r}; known: {', '.join(known)}")
    return names


def run_main(fn: Callable[[], int | None]) -> int:
    """Run a script's main(): a user error (UserError) is one `error:` line and status 2."""
    try:
        return int(fn() or 0)
    except Exception as e:
        if not _is_user_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def check_writable(path: str, flag: str, is_dir: bool = False) -> None:
    """CliError naming `flag` unless `path` (a file, or a directory with `is_dir`) can be created:
    a file's directory must exist, a directory's nearest existing ancestor must be a directory,
    and either must be writable."""
    import os
    from pathlib import Path

    p = Path(path)
    if is_dir and p.exists() and not p.is_dir():
        raise CliError(f"{flag} {path}: exists and is not a directory")
    if not is_dir and p.is_dir():
        raise CliError(f"{flag} {path}: is a directory, expected a file name")
    parent = p if is_dir else p.parent
    if not is_dir and not parent.exists():
        raise CliError(f"{flag} {path}: directory {parent} does not exist")
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CliError(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"{flag} {path}: {parent} is not writable")


def add_weight_arguments(p: argparse.ArgumentParser) -> None:
    """--weights, --fp8-granularity, --fp8-lm-head: the weights' format (docs/FP8.md), the same
    for every command that loads or plans a model."""
    from megakernel.models.fp8 import GRANULARITIES, WEIGHT_FORMATS

    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="bf16: the checkpoint's own form (an FP8 checkpoint stays FP8); fp8: "
                   "quantize the block matrices to e4m3 on load (default bf16)")
    p.add_argument("--fp8-granularity", choices=GRANULARITIES, default="channel",
                   help="scales of --weights fp8: one per output channel (default) or per "
                   "128x128 block")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="with --weights fp8, quantize the LM head too (kept bf16 by default)")


def weight_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of models.resolve / load_model for the flags above."""
    if args.weights != "fp8" and (args.fp8_granularity != "channel" or args.fp8_lm_head):
        raise CliError("--fp8-granularity and --fp8-lm-head apply with --weights fp8")
    return {"weights": args.weights, "granularity": args.fp8_granularity,
            "lm_head": args.fp8_lm_head}


def _is_user_error(e: BaseException) -> bool:
    return isinstance(e, UserError)


# ---- commands ------------------------------------------------------------------------------------
register("info", "versions, GPU, and what each backend can do here", "megakernel.cli.info")
register("generate", "greedy generation with a chosen backend", "megakernel.cli.generate")
register("demo", "the main job: plan, CPU executor vs reference, AOT build (GPU run if any)",
         "megakernel.cli.demo")
register("plan", "compile a decode-step program and print its predicted cost",
         "megakernel.cli.plan")
register("build", "AOT-compile the kernel for sm_90a/sm_100a (needs the DSL, not a GPU)",
         "megakernel.cli.build")
register("gpu-check", "check prebuilt cubins on this GPU against the reference and executor",
         "megakernel.gpu_check")


# ---- entry point ---------------------------------------------------------------------------------
def _chosen(argv: Sequence[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a
        if a in ("-h", "--help"):
            return None
    return None


def build_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, Command | None]:
    """The parser, with full arguments only for the command named in `argv`."""
    parser = argparse.ArgumentParser(prog=PROG, description="One fused decode-step kernel for "
                                     "dense and hybrid LLMs: reference, CPU executor, CuTe DSL "
                                     "kernel.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    name = _chosen(argv)
    chosen = None
    for cmd_name, cmd in COMMANDS.items():
        p = sub.add_parser(cmd_name, help=cmd.help, description=cmd.help)
        if cmd_name == name:
            try:
                add = getattr(importlib.import_module(cmd.module), cmd.add)
            except (ImportError, AttributeError) as e:
                raise CliError(f"command {cmd_name!r} is not available: {e}") from None
            add(p)
            chosen = cmd
    return parser, chosen


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def run_command() -> int:
        parser, cmd = build_parser(argv)
        args = parser.parse_args(argv)  # exits 2 with usage on bad syntax
        assert cmd is not None
        return getattr(importlib.import_module(cmd.module), cmd.run)(args)

    return run_main(run_command)
