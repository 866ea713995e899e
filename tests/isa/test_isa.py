"""The instruction set: one registry of opcodes declared by the layer kinds, the record format."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys

import pytest

from megakernel import isa
from megakernel.isa import Op
from megakernel.layers import all_kinds


def test_isa_roundtrip_every_opcode() -> None:
    rng = random.Random(0)
    for op in Op:
        names = isa.spec(op).names
        ops = {n: rng.randrange(-(1 << 31), 1 << 31) for n in names}
        rec = isa.encode(op, wait=(3, 7, 9), signal=11, layer=2, **ops)
        assert len(rec) == isa.RECORD_WORDS
        d = isa.decode(rec)
        assert d["OPCODE"] == op
        assert (d["WAIT_CID"], d["WAIT_TARGET"], d["WAIT_TOTAL"], d["SIGNAL_CID"], d["LAYER"]) == (
            3, 7, 9, 11, 2)
        for n, v in ops.items():
            assert d[n] == v
            assert rec[isa.field_index(op, n)] == v
        assert op.name in isa.describe(rec)
    table = isa.table_markdown()
    assert f"format version {isa.FORMAT_VERSION}" in table
    assert all(op.name in table for op in Op)


def test_isa_64bit_offsets_and_errors() -> None:
    w = (1 << 33) + 12345
    ops = dict(W=w, ROW0=0, NROWS=16, K=64, NORM_OFF=-1, IN_OFF=0, OUT_OFF=0)
    assert isa.decode(isa.encode(Op.OPROJ, **ops))["W"] == w
    state = (1 << 34) + 7  # a recurrent layer's block past 2^31 elements of the state arena
    core = dict(B_IDX=0, K_HEAD=0, PROJ_OFF=0, CONV_W=0, PARAM_OFF=0, NORM_W=0, STATE=state,
                OUT_OFF=0)
    assert isa.decode(isa.encode(Op.GDN_CORE, **core))["STATE"] == state
    with pytest.raises(KeyError, match="has no operands"):
        isa.encode(Op.OPROJ, **ops, BOGUS=1)
    with pytest.raises(KeyError, match="missing operands"):
        isa.encode(Op.OPROJ, W=0)
    with pytest.raises(OverflowError, match="does not fit in int32"):
        isa.encode(Op.OPROJ, **{**ops, "K": 1 << 31})
    with pytest.raises(ValueError, match="16 words"):
        isa.decode([1, 2, 3])
    with pytest.raises(ValueError, match="unknown opcode"):
        isa.decode([99] + [0] * 15)


def test_isa_does_not_import_the_dsl() -> None:
    code = "import sys, megakernel.program.compiler; print('cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_dense_opcode_numbers_are_the_format_2_ones() -> None:
    """The dense programs' records are unchanged by the one ISA (tests/program pins them)."""
    assert {op.name: int(op) for op in Op if int(op) < 16} == {
        "END": 0, "EMBED": 1, "QKV": 2, "ATTN_PARTIAL": 3, "OPROJ": 5, "GATEUP": 6, "DOWN": 7,
        "LMHEAD": 8, "ARGMAX": 9}


def test_every_opcode_is_declared_by_one_layer_kind() -> None:
    kinds = set(all_kinds()) | {"frame"}
    for s in isa.specs():
        assert s.kind in kinds, s.name
        assert s.doc and all(doc for _, doc in s.operands), s.name
    # every opcode a kind's dataflow names is declared, and every declared opcode is run by some
    # kind (or the frame)
    used = {name for k in all_kinds().values() for name in (*k.flow, *k.after)}
    used |= {"END", "EMBED", "LMHEAD", "ARGMAX", "ACCEPT", "NGRAM"}
    assert used == {s.name for s in isa.specs()}


def test_properties_describe_the_records() -> None:
    for s in isa.specs():
        if s.slab:
            assert {"W_LO", "W_HI", "NROWS", "K"} <= set(s.names)
        if s.matvec:  # the matvec handler reads the shared operands at the same words
            assert s.names[: len(isa.MATVEC)] == tuple(n for n, _ in isa.MATVEC)
        if s.ticket:
            assert "DONE_CID" in s.names
    assert set(isa.slab_ops()) >= set(isa.matvec_ops())
    assert Op.ATTN_PARTIAL not in isa.slab_ops() and Op.ARGMAX not in isa.slab_ops()
    assert isa.spec(Op.ATTN_PARTIAL).reach and isa.spec(Op.ATTN_PARTIAL).ticket


def test_a_conflicting_registration_is_refused() -> None:
    s = isa.spec(Op.QKV)
    with pytest.raises(ValueError, match="registered twice"):
        isa.register(dataclasses.replace(s, doc="another meaning"))
    with pytest.raises(ValueError, match="operands"):
        isa.OpSpec(99, "TOO_MANY", "frame", "x", tuple((f"F{i}", "x") for i in range(11)))
    with pytest.raises(ValueError, match="start with MATVEC"):
        isa.OpSpec(99, "BAD_MATVEC", "frame", "x", (("K", "x"),), matvec="residual")


def test_swapping_two_operands_moves_their_words() -> None:
    """Everyone reads records by operand name: a reordered declaration moves both words."""
    s = isa.spec(Op.QKV)
    ops = list(s.operands)
    i, j = s.names.index("QK_NORM_OFF"), s.names.index("ROPE_OFF")
    ops[i], ops[j] = ops[j], ops[i]
    swapped = dataclasses.replace(s, operands=tuple(ops))
    assert swapped.index("QK_NORM_OFF") == s.index("ROPE_OFF")
    assert swapped.index("ROPE_OFF") == s.index("QK_NORM_OFF")
