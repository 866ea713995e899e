"""The package layering the README's layout block describes is the one the imports show: a module
imports only its own layer and the layers below it, function-level imports included (imports
under `if TYPE_CHECKING:` aside). The few edges that run back up are listed in UPWARD with why;
a new one fails here, and so does a listed one that no longer exists."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# top to bottom; "a|b" share a layer (neither imports the other)
LAYERS = (
    "megakernel",  # the package: the API's names and the op's registration
    "megakernel.cli",
    "megakernel.gpu_check|megakernel.vllm_plugin",
    "megakernel.serve",
    "megakernel.measure",
    "megakernel.launch",
    "megakernel.emulator",
    "megakernel.kernel.toolchain",
    "megakernel.kernel.device",
    "megakernel.kernel.config",
    "megakernel.executor",
    "megakernel.program",
    "megakernel.reference",
    "megakernel.models",
    "megakernel.layers",
    "megakernel.kernel.host",
    "megakernel.isa",
    "megakernel.common",
)

# (importing module, imported module): why the edge runs up
UPWARD = {
    ("megakernel.isa.registry", "megakernel.layers"):
        "discovery: the opcode registry imports the layer kinds that register their opcodes, "
        "on first use (load_all)",
    ("megakernel.program.compiler", "megakernel.kernel.config.model_spec"):
        "the cost model prices the build that will run the program (default_build: the ring "
        "depth, the tensor-core path), and make_spec sizes that build from the program's "
        "buffer plan",
}


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the longest prefix naming `module`'s layer (None: not megakernel)."""
    best: tuple[int, int] | None = None
    for i, entry in enumerate(LAYERS):
        for name in entry.split("|"):
            if (module == name or module.startswith(name + ".")) and \
                    (best is None or len(name) > best[1]):
                best = (i, len(name))
    return None if best is None else best[0]


def sources() -> list[Path]:
    """Every module of the package, megakernel/reference (a link to reference/) included."""
    pkg = ROOT / "megakernel"
    return sorted([*pkg.rglob("*.py"), *(pkg / "reference").resolve().rglob("*.py")])


def module_name(path: Path) -> str:
    ref = (ROOT / "megakernel" / "reference").resolve()
    if path.is_relative_to(ref):
        return ".".join(("megakernel", "reference", *path.relative_to(ref).with_suffix("").parts)
                        ).removesuffix(".__init__")
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported megakernel module, line) of every import in the file but the typing-only ones;
    `from megakernel import x` counts as importing megakernel.x."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "megakernel" or node.module.startswith("megakernel.")):
            names = ([f"megakernel.{a.name}" for a in node.names] if node.module == "megakernel"
                     else [node.module])
            out += [(n, node.lineno) for n in names]
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names
                    if a.name == "megakernel" or a.name.startswith("megakernel.")]
    return out


def upward_edges() -> dict[tuple[str, str], str]:
    """(module, imported) -> "file:line" for every import of a higher layer."""
    found: dict[tuple[str, str], str] = {}
    for path in sources():
        me = module_name(path)
        mine = layer_of(me)
        for target, line in imports(path):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs < mine:
                found.setdefault((me, target), f"{path.relative_to(ROOT.resolve())}:{line}")
    return found


def test_every_package_has_a_layer() -> None:
    packages = {module_name(p) for p in sources() if p.name == "__init__.py"}
    for pkg in packages:
        entry = layer_of(pkg)
        assert entry is not None, pkg
    named = {n for e in LAYERS for n in e.split("|")}
    assert named <= packages, sorted(named - packages)


def test_imports_run_down_the_layers() -> None:
    found = upward_edges()
    new = {k: v for k, v in found.items() if k not in UPWARD}
    assert not new, "imports of a higher layer (move what they need down, or list the edge in " \
        "UPWARD with why):\n" + "\n".join(f"  {v}: {a} -> {b}" for (a, b), v in sorted(
            new.items(), key=lambda kv: kv[1]))
    stale = set(UPWARD) - set(found)
    assert not stale, f"UPWARD lists edges that no longer exist: {sorted(stale)}"


def test_the_check_sees_a_planted_upward_import(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A lower layer importing a higher one, even inside a function, is found."""
    leaf = ROOT / "megakernel" / "common" / "errors.py"
    planted = tmp_path / "errors.py"
    planted.write_text(leaf.read_text() + "\n\ndef _f():\n    from megakernel.serve import api\n")
    original = imports

    def patched(path: Path) -> list[tuple[str, int]]:
        return original(planted if path == leaf else path)

    monkeypatch.setitem(globals(), "imports", patched)
    found = upward_edges()
    assert ("megakernel.common.errors", "megakernel.serve") in found
    typed = tmp_path / "typed.py"
    typed.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from megakernel.serve import api\n")
    assert original(typed) == []
