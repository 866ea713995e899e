"""Test lanes: which tests `make test` runs (the fast lane) and which `make test-slow` runs, decided
from what a test uses, not from a list of tests.

A test is slow when it (its function, its parameters, the fixtures it requests and the helpers
of the test tree they call, followed through their code) uses one of the SLOW resources: a
kernel build beyond the fast lane's one small build per arch (the `lane_build` fixture), a
subprocess (the CLI as a user runs it, a wheel build), a Hugging Face checkpoint (transformers
models built, saved or loaded), a real trained model (SmolLM2, fetched into the cache), a
free-running generation against the reference, a cost-model fit, a whole gpu-check run, the
compiled program of a real-size model (a preset that is not a `-tiny` one), or an executor step
of many rows or splits (parameters batch x tokens of at least LARGE_ROWS, or at least
LARGE_SPLITS splits). Everything else is fast. The conftest hook marks the slow ones `slow`;
`make test` deselects them, `make test-slow` selects only them.

"Uses" is read from the code objects (the names a function loads, calls or imports, and its
word-like string constants), so a new test lands in the right lane without being listed.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# resource -> the names whose use puts a test in the slow lane
SLOW: dict[str, frozenset[str]] = {
    "kernel builds": frozenset({"kernel_build", "build_arch", "ensure_build", "compile_to",
                                "compile_kernel", "build_all", "prepare_builds"}),
    "subprocess": frozenset({"subprocess"}),
    "transformers checkpoints": frozenset({"hf_checkpoint", "build_hf_model", "save_pretrained",
                                           "from_pretrained", "hf_oracle"}),
    "long generations": frozenset({"ref_generate", "long_speculative_run",
                                   "long_speculative_ngram", "long_speculative_bug"}),
    "cost-model fits": frozenset({"refit", "least_squares", "--refit", "fit_timeline",
                                  "hindcast"}),
    "gpu-check runs": frozenset({"gpu-check"}),
    "real models": frozenset({"SMOLLM2"}),  # fetched with pip, then 30 layers on the CPU
    "emulated runs": frozenset({"emulated_run"}),  # the PTX emulator's matrix (minutes)
}
# a real-size program: one of these with the name of a preset that is not a tiny one
PROGRAMS = frozenset({"compile_program"})
# a large step: parameters `batch` x `tokens` (1 when absent) or `n_splits` at least these
LARGE_ROWS, LARGE_SPLITS = 16, 32


def code_names(code: types.CodeType) -> set[str]:
    """Names a code object (and the functions, lambdas and comprehensions nested in it) loads,
    calls, imports or spells as a string constant."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= code_names(c)
        elif isinstance(c, str) and 0 < len(c) < 64 and not any(ch.isspace() for ch in c):
            names.add(c)
    return names


def uses(funcs: Iterable[Callable], extra: Iterable[str] = ()) -> set[str]:
    """Every name `funcs` use, following the functions of the test tree they name (helpers in
    tests/, module globals of the test's module)."""
    out = set(extra)
    for f in funcs:
        out |= function_uses(inspect_function(f))
    return out


_USES: dict[int, frozenset[str]] = {}


def function_uses(f: types.FunctionType | None) -> frozenset[str]:
    """The names `f` uses and those of the test-tree functions it names, each function once
    (memoised: a helper shared by many tests is read once)."""
    if f is None:
        return frozenset()
    if id(f) in _USES:
        return _USES[id(f)]
    seen, out, todo = {id(f)}, set(), [f]
    while todo:
        g = todo.pop()
        names = code_names(g.__code__)
        out |= names
        for n in names:
            h = inspect_function(g.__globals__.get(n))
            if h is not None and in_tests(h) and id(h) not in seen:
                seen.add(id(h))
                todo.append(h)
    _USES[id(f)] = frozenset(out)
    return _USES[id(f)]


def inspect_function(f: object) -> types.FunctionType | None:
    """The plain function behind a test, fixture, method or wrapper (None for other objects)."""
    f = getattr(f, "__wrapped__", f)
    f = getattr(f, "__func__", f)
    return f if isinstance(f, types.FunctionType) else None


def in_tests(obj: object) -> bool:
    """A function defined in a module of the test tree (followed by `uses`)."""
    f = inspect_function(obj)
    if f is None:
        return False
    path = getattr(f.__code__, "co_filename", "")
    return path.startswith(str(TESTS))


def slow_reasons(names: set[str]) -> list[str]:
    """The SLOW resources among `names` (empty: the test is fast)."""
    reasons = [r for r, ns in SLOW.items() if names & ns]
    if names & PROGRAMS and names & large_presets():
        reasons.append("real-size programs")
    return sorted(reasons)


@functools.cache
def large_presets() -> frozenset[str]:
    """The registered presets that are not tiny ones (real shapes, mid-size)."""
    from megakernel.models.registry import presets

    return frozenset(n for n in presets() if not n.endswith("-tiny"))


def param_reasons(params: dict) -> list[str]:
    """The slow resources a parametrised test's parameters ask for: a large step."""
    def num(name: str) -> int:
        v = params.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) else 0

    rows = max(num("batch"), 1) * max(num("tokens"), 1)
    return ["large steps"] if rows >= LARGE_ROWS or num("n_splits") >= LARGE_SPLITS else []


def param_names(params: dict) -> set[str]:
    """The string values of a parametrised test's parameters (tuples and lists opened)."""
    out: set[str] = set()
    for v in params.values():
        for x in v if isinstance(v, tuple | list) else (v,):
            if isinstance(x, str):
                out.add(x)
    return out


@functools.cache
def packages_of_file(path: str) -> frozenset[str]:
    return frozenset(_packages(path))


def packages(module: types.ModuleType) -> set[str]:
    """The packages under megakernel/ a test module imports (packages_of_file)."""
    return set(packages_of_file(module.__file__))


def _packages(path: str) -> set[str]:
    """The packages under megakernel/ (dotted names, megakernel itself for its top-level
    modules) whose modules a test module imports, at module level or in its functions."""
    import ast

    tree = ast.parse(Path(path).read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        for m in mods:
            if m == "megakernel" or m.startswith("megakernel."):
                out.add(package_of(m))
    return out - {""}


def package_of(module: str) -> str:
    """The package a dotted megakernel name belongs to: itself when it is a package directory,
    else its parent ('' for a name that is not a module or package of megakernel)."""
    root = TESTS.parent
    path = root.joinpath(*module.split("."))
    if path.is_dir() and (path / "__init__.py").exists():
        return module
    if path.with_suffix(".py").is_file():
        return module.rpartition(".")[0]
    parent = module.rpartition(".")[0]  # an attribute (a name imported from a module)
    return package_of(parent) if parent else ""


def all_packages() -> set[str]:
    """Every package under megakernel/ that holds modules of its own (the reference/ link
    excluded: tests/reference is its; a folder of subpackages only, like kernel/, is covered by
    theirs)."""
    root = TESTS.parent / "megakernel"
    return {"megakernel"} | {
        "megakernel." + ".".join(p.parent.relative_to(root).parts)
        for p in root.rglob("__init__.py") if p.parent != root and "reference" not in
        p.relative_to(root).parts and any(q.name != "__init__.py" for q in p.parent.glob("*.py"))}
