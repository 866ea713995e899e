"""The device code reads records through the ISA registry (kernel/config/fields.py).

Static (no DSL): every record word the kernel sources read is named through a field helper whose
name the registry knows, no read uses a number or `COMMON_WORDS + N`, no opcode is tested by a
range or named outside its own handler; the helpers follow the registry (an operand moved in a
copied declaration moves the word); the opcode sets the kernel branches on are the registry's
properties restricted to the opcodes a build handles. Compiled (DSL): a kernel traced against a
registry with two operands swapped reads the swapped words.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from megakernel import isa
from megakernel.isa import registry
from megakernel.kernel.config import fields, model_spec
from megakernel.kernel.config.fields import (
    FieldError,
    OpTable,
    common,
    mv,
    one_of,
    slab_word,
    word,
)
from megakernel.kernel.toolchain import fingerprint
from megakernel.models import preset

KERNEL_DIR = fingerprint.KERNEL
# the modules a cubin is traced from, less the host-side tables and helpers (spec.py, fields.py)
DEVICE_SOURCES = tuple(n for n in fingerprint.KERNEL_SOURCES
                       if n not in ("config/spec.py", "config/fields.py"))
HELPERS = {"word", "mv", "slab_word", "common"}


def _trees() -> dict[str, ast.Module]:
    return {n: ast.parse((KERNEL_DIR / n).read_text(), n) for n in DEVICE_SOURCES}


def _name(node: ast.AST) -> str:
    return ast.unparse(node)


def _field_reads(tree: ast.Module) -> list[ast.AST]:
    """The word expressions of every record read: `rec[...]` and `record_word(queue, pc, ...)`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _name(node.value) == "rec":
            out.append(node.slice)
        elif isinstance(node, ast.Call) and _name(node.func) == "record_word":
            out.append(node.args[2])
    return out


def _resolve(expr: ast.AST) -> int:
    """The word a field-helper call names (KeyError from the registry when the name is wrong);
    AssertionError unless it is such a call with literal names."""
    assert isinstance(expr, ast.Call) and _name(expr.func) in HELPERS, \
        f"record word read without a field helper: {_name(expr)}"
    *head, last = expr.args
    assert isinstance(last, ast.Constant) and isinstance(last.value, str), _name(expr)
    fn = _name(expr.func)
    if fn == "word":
        assert len(head) == 1 and _name(head[0]).startswith("Op."), \
            f"word() takes one opcode as Op.NAME: {_name(expr)}"
        return word(getattr(isa.Op, _name(head[0])[3:]), last.value)
    return getattr(fields, fn)(last.value)


def test_every_record_read_is_named_through_the_registry():
    reads = {n: _field_reads(t) for n, t in _trees().items()}
    assert sum(map(len, reads.values())) >= 40  # the kernel does read its records this way
    for n, exprs in reads.items():
        for e in exprs:
            w = _resolve(e)
            assert 0 <= w < isa.RECORD_WORDS, (n, _name(e), w)
    # the reads that used to be numbers, by the word the registry gives them
    assert word(isa.Op.ATTN_PARTIAL, "DONE_CID") == 15 and mv("NROWS") == 9
    assert slab_word("K") == mv("K") == 10 and common("LAYER") == 5


def test_no_record_word_by_number_or_queue_read_around_the_helpers():
    for n, tree in _trees().items():
        src = (KERNEL_DIR / n).read_text()
        assert "COMMON_WORDS" not in src, n  # `f = isa.COMMON_WORDS; rec[f + 3]`
        inside = {id(x) for f in ast.walk(tree)
                  if isinstance(f, ast.FunctionDef) and f.name == "record_word"
                  for x in ast.walk(f)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and _name(node.func) in ("ld", "cute.arch.load")
                    and id(node) not in inside):
                assert not _name(node.args[0]).startswith("queue"), \
                    f"{n}: a queue read outside record_word: {_name(node)}"


def test_opcodes_are_not_tested_by_range_or_by_a_matvec_name():
    """Opcode sets come from the registry (fields.OpTable); an opcode is named in a comparison
    only by the loop's own dispatch (EMBED, ARGMAX, the queue's END) or by a handler class of
    opcodes that are not matvecs."""
    for n, tree in _trees().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = [_name(s)[3:] for s in sides if _name(s).startswith("Op.")]
            if not named:
                continue
            assert all(isinstance(o, ast.Eq | ast.NotEq) for o in node.ops), \
                f"{n}: opcode range test {_name(node)}"
            for op in named:
                assert op in fields.BUILTIN or isa.spec(getattr(isa.Op, op)).handler, \
                    f"{n}: {_name(node)} (dispatch matvec opcodes by the registry's `matvec` " \
                    "epilogue)"


def test_field_helpers_follow_the_registry(monkeypatch):
    """Swap two operands in a copied declaration: the helper's words swap with them."""
    qkv = isa.spec(isa.Op.QKV)
    a, b = word(isa.Op.QKV, "QK_NORM_OFF"), word(isa.Op.QKV, "ROPE_OFF")
    ops = list(qkv.operands)
    ia, ib = qkv.names.index("QK_NORM_OFF"), qkv.names.index("ROPE_OFF")
    ops[ia], ops[ib] = ops[ib], ops[ia]
    monkeypatch.setitem(registry._SPECS, qkv.code, dataclasses.replace(qkv, operands=tuple(ops)))
    assert (word(isa.Op.QKV, "QK_NORM_OFF"), word(isa.Op.QKV, "ROPE_OFF")) == (b, a)
    with pytest.raises(KeyError, match="has no operand 'TILE'"):
        word(isa.Op.QKV, "TILE")
    with pytest.raises(KeyError):
        mv("QK_NORM_OFF")  # not a shared matvec operand
    with pytest.raises(KeyError):
        common("ROW0")


def test_shared_words_must_agree(monkeypatch):
    """A handled slab opcode with its slab fields elsewhere cannot be streamed by the loader and
    the lookahead, which read those words without decoding the opcode: refused by the registry
    (a slab opcode is a matvec opcode) and, should one slip through, by the kernel's tables."""
    shuffled = (("PAD", ""), ("W_LO", ""), ("W_HI", ""), ("NROWS", ""), ("K", ""))
    with pytest.raises(ValueError, match="a slab opcode is a matvec opcode"):
        registry.OpSpec(99, "FAKE_SLAB", "frame", "test", shuffled, slab=True, device=True)
    fake = registry.OpSpec(99, "FAKE_SLAB", "frame", "test", registry.MATVEC, slab=True,
                           matvec="nonesuch", device=True)  # an epilogue the kernel lacks
    object.__setattr__(fake, "operands", shuffled)  # a registry bug the kernel must still catch
    object.__setattr__(fake, "names", tuple(n for n, _ in shuffled))
    monkeypatch.setitem(registry._SPECS, 99, fake)
    with pytest.raises(FieldError, match="operand W_LO is not at one word"):
        slab_word("W_LO")
    with pytest.raises(FieldError, match="no handler for opcodes"):
        OpTable(fields.device_ops())  # device=True, but the kernel has no handler for it


def test_op_table_is_the_registry_restricted_to_the_build():
    s = model_spec.make_spec(preset("llama-tiny"), 1, 1, "sm_90a")
    t = OpTable.for_spec(s)
    specs = isa.specs()
    # the opcodes of its program, from the registry's layer kinds: no relu^2 (Nemotron-H) handler
    assert t.handled == tuple(sorted(model_spec.program_ops(preset("llama-tiny"))))
    # every device opcode of a kind llama has not (relu^2, the recurrent cores), PROJ, and the
    # speculative step's end (ACCEPT, NGRAM: a plain step ends in ARGMAX)
    hybrid = {x.code for x in specs if x.device and x.kind not in ("frame", "attention",
                                                                    "swiglu")} | {
        isa.Op.PROJ, isa.Op.ACCEPT, isa.Op.NGRAM}
    assert {isa.Op.UP_RELU2, isa.Op.GDN_CORE, isa.Op.MAMBA_CORE} <= hybrid
    assert set(t.handled) == {x.code for x in specs if x.device} - hybrid
    assert set(t.epilogue("qkv.QKV")) == {isa.Op.QKV}
    assert set(t.epilogue("epilogues.LMHead")) == {isa.Op.LMHEAD}
    assert set(t.epilogue("epilogues.Residual")) == {isa.Op.OPROJ, isa.Op.DOWN}
    assert set(t.epilogue("epilogues.GateUp")) == {isa.Op.GATEUP}
    assert t.ticket == (isa.Op.ATTN_PARTIAL,)
    # the predicates the kernel traces, evaluated on ints for every registered opcode
    for x in specs:
        assert one_of(x.code, t.slab) == (x.slab and x.code in t.handled), x.name
        assert one_of(x.code, t.matvec) == (x.matvec is not None and x.code in t.handled), x.name
    # the Kimi opcodes are device opcodes of other kinds: no slab of theirs is llama's
    kimi = {isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN, isa.Op.KDA_CORE, isa.Op.MLA}
    assert kimi <= hybrid and not any(one_of(x, t.slab) for x in kimi)


def test_matvec_operands_at_one_word():
    for name in fields.MATVEC_NAMES:
        assert {isa.field_index(op, name) for op in isa.matvec_ops()} == {mv(name)}
    fields.check_registry()


def test_the_fingerprint_covers_the_device_code_and_the_registry():
    """Every module the cubin is compiled from is in fingerprint.KERNEL_SOURCES: all of device/,
    config/ (fields.py included) and host/, none of toolchain/; the registry's modules (isa,
    layers) are hashed too."""
    found = {f"{d}/{p.name}" for d in ("device", "config", "host", "toolchain")
             for p in (KERNEL_DIR / d).glob("*.py")}
    # stream.py: a kernel of its own (the HBM read stream), with its own build
    not_traced = {f"{d}/__init__.py" for d in ("device", "config", "host")} | {"device/stream.py"} \
        | {n for n in found if n.startswith("toolchain/")}
    assert len(found) > 40 and found - not_traced == set(fingerprint.KERNEL_SOURCES)
    import inspect

    src = inspect.getsource(fingerprint.source_digest)
    assert '("isa", "layers")' in src


# ---- compiled (DSL) -----------------------------------------------------------------------------
def test_traced_kernel_reads_the_registry_words(monkeypatch, tmp_path, kernel_build):
    """The words are taken from the registry when the kernel is traced: with ARGMAX's LEN_OFF and
    FLAGS swapped in the registry, the compiled kernel reads the other word for each."""
    from megakernel.kernel.toolchain.build import compile_to

    cfg = preset("llama-tiny")
    s = model_spec.make_spec(cfg, 1, 1, "sm_90a", smem_stages=0)
    ptx0 = (kernel_build(cfg, "sm_90a", 1, 1, 0)[0] / "megakernel.ptx").read_text()
    assert Path(compile_to(s, str(tmp_path / "c"))[0]).read_text() == ptx0  # deterministic
    am = isa.spec(isa.Op.ARGMAX)
    ops = list(am.operands)
    i, j = am.names.index("LEN_OFF"), am.names.index("FLAGS")
    ops[i], ops[j] = ops[j], ops[i]
    monkeypatch.setitem(registry._SPECS, am.code, dataclasses.replace(am, operands=tuple(ops)))
    ptx1 = Path(compile_to(s, str(tmp_path / "b"))[0]).read_text()
    assert ptx0 != ptx1


def test_every_device_opcode_has_its_handler_class_or_epilogue():
    """Each device opcode that is not a matvec names a kernel.handler.Handler class with `run`
    (its declaration is where the loop finds it); a build makes one instance per class with that
    class's opcodes of the build; a declared handler of a non-device opcode is refused."""
    from megakernel.kernel.device.handler import Handler, handler_class, handlers_for

    for s in isa.specs():
        if s.device and s.matvec is None and s.name not in fields.BUILTIN:
            cls = handler_class(s.handler)
            assert issubclass(cls, Handler) and cls.run is not Handler.run, s.name
    spec = model_spec.make_spec(preset("kimi-linear-tiny"), 1, 1, "sm_90a", replay_window=4)
    got = {type(h).__name__: {isa.spec(c).name for c in h.ops}
           for h in handlers_for(spec, OpTable.for_spec(spec).handled)}
    assert got == {"KimiDeltaAttention": {"KDA_REPLAY"},
                   "LatentAttention": {"MLA_Q", "MLA", "MLA_O"},
                   "MoERouter": {"ROUTER_SCORE", "ROUTER"}, "Experts": {"MOE_COMBINE"}}
    with pytest.raises(ValueError, match="handler class is for device opcodes"):
        dataclasses.replace(isa.spec(isa.Op.MLA), device=False)


def test_every_matvec_opcode_names_its_epilogue_class():
    """Each device matvec opcode names a kernel.epilogue.Epilogue class with `run` (OpSpec.matvec,
    where the matvec finds it); a build makes one instance per class with that class's opcodes
    of the build, in opcode order; a class the kernel does not define is refused."""
    from types import SimpleNamespace

    from megakernel.kernel.device.epilogue import Epilogue, epilogues_for
    from megakernel.kernel.device.handler import handler_class

    for s in isa.specs():
        if s.device and s.matvec is not None:
            cls = handler_class(s.matvec)
            assert issubclass(cls, Epilogue) and cls.run is not Epilogue.run, s.name
    spec = model_spec.make_spec(preset("kimi-linear-tiny"), 1, 1, "sm_90a")
    mv = SimpleNamespace(spec=spec, NO=spec.no, NW=spec.num_warps)
    got = [(type(e).__name__, {isa.spec(c).name for c in e.ops})
           for e in epilogues_for(mv, OpTable.for_spec(spec).handled)]
    assert got == [("Residual", {"OPROJ", "DOWN"}), ("GateUp", {"GATEUP"}),
                   ("LMHead", {"LMHEAD"}), ("Proj", {"PROJ"}),
                   ("ExpertGateUp", {"EXPERT_GATEUP"}), ("ExpertDown", {"EXPERT_DOWN"})]
    assert not fields.class_defined("epilogues.Nonesuch") and fields.class_defined("qkv.QKV")
