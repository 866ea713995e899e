"""megakernel/layers/__init__.py and base.py: the layer-kind registry and the interface every kind
fulfils (one module per kind, its opcodes owned and used by its flow, consistent buffer
declarations across kinds, the base class's defaults), checked for every registered kind."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megakernel import isa
from megakernel.layers import KINDS, LayerKind, all_kinds, kind, register_kind
from megakernel.layers.base import StepShape
from megakernel.layers.recurrent import RecurrentKind
from megakernel.models import Block, preset
from tests.layers.helpers import presets_with
from tests.registries import ALL_TINY
from tests.registries import KINDS as KIND_NAMES

FRAME_OPS = {"END", "EMBED", "OPROJ", "DOWN", "PROJ", "LMHEAD", "ARGMAX", "ACCEPT", "NGRAM"}


def test_every_kind_is_registered_by_its_own_module() -> None:
    kinds = all_kinds()
    assert kinds, "no layer kind registered"
    for name, cls in kinds.items():
        assert cls.name == name and cls.__module__ == f"megakernel.layers.{name}"
        assert kind(name) is cls is KINDS[name]


def test_every_kind_has_its_test_module() -> None:
    here = Path(__file__).parent
    for name in [*all_kinds(), "frame"]:
        assert (here / f"test_layer_{name}.py").is_file(), name


def test_every_kind_runs_in_a_tiny_preset() -> None:
    for name in KIND_NAMES:
        assert presets_with(name), name


def test_unknown_kind_is_named() -> None:
    with pytest.raises(KeyError, match="unknown layer kind 'nope'; known: attention, gdn"):
        kind("nope")


def test_a_kind_name_is_registered_once() -> None:
    swiglu = kind("swiglu")
    assert register_kind(swiglu) is swiglu  # re-registering the same class is harmless

    class Other(LayerKind):
        name = "swiglu"

    with pytest.raises(ValueError, match="registered twice"):
        register_kind(Other)
    assert KINDS["swiglu"] is swiglu


@pytest.mark.parametrize("name", KIND_NAMES)
def test_the_interface_contract(name: str) -> None:
    """A frozen config dataclass; the hooks every kind must implement; a flow whose entries wait
    on the block input (None) or on opcodes of the flow, without cycles, ending in out_op; every
    opcode registered and owned by the kind or the frame; recurrent kinds are RecurrentKinds,
    cache kinds declare their cache."""
    kd = kind(name)
    assert dataclasses.is_dataclass(kd.config) and kd.config.__dataclass_params__.frozen
    for hook in ("shapes", "matrices", "pack", "stages"):
        assert getattr(kd, hook).__func__ is not getattr(LayerKind, hook).__func__, hook
    flow = kd.flow
    assert flow and kd.out_op in flow and None in flow.values()

    def deps(op: str) -> tuple[str, ...]:
        dep = flow[op]
        return () if dep is None else (dep,) if isinstance(dep, str) else tuple(dep)

    def reaches_the_input(op: str, path: tuple[str, ...]) -> None:
        for d in deps(op):
            assert d in flow and d not in path, f"{op} waits on {d} (path {path})"
            reaches_the_input(d, (*path, d))

    for op in flow:
        reaches_the_input(op, (op,))
        assert isa.spec(getattr(isa.Op, op)).kind in (name, "frame"), op
    waited = {d for op in flow for d in deps(op)}
    assert kd.out_op not in waited  # nothing of the block waits on its last opcode
    assert kd.recurrent == issubclass(kd, RecurrentKind)
    if kd.kv_cache:
        assert kd.kv.__func__ is not LayerKind.kv.__func__
    if kd.recurrent:
        assert {"PROJ", isa.spec(kd.core_op).name, isa.spec(kd.replay_op).name} <= set(flow)


def test_every_opcode_is_used_by_its_owners_flow_and_run_by_the_executor() -> None:
    from megakernel.executor.core import _load_ops

    ops = _load_ops()
    for s in isa.specs():
        if s.kind == "frame":
            assert s.name in FRAME_OPS, s.name
        else:
            kd = KINDS.get(s.kind)
            assert kd and (s.name in kd.flow or s.name in kd.after), s.name
        assert s.name == "END" or s.name in ops, f"no executor op for {s.name}"
    used = {op for k in KINDS.values() for op in k.flow}
    assert FRAME_OPS - used == {"END", "EMBED", "LMHEAD", "ARGMAX", "ACCEPT", "NGRAM"}


@pytest.mark.parametrize("name", ALL_TINY)
def test_blocks_of_one_layer_run_distinct_opcodes(name: str) -> None:
    """The verifier tells a layer's blocks apart by opcode: two blocks of one layer never share
    one (e.g. an attention block's OPROJ and a SwiGLU's DOWN)."""
    by_layer: dict[int, list[str]] = {}
    for blk in preset(name).blocks:
        by_layer.setdefault(blk.layer, []).extend(kind(blk.kind).flow)
    for layer, ops in by_layer.items():
        assert len(ops) == len(set(ops)), (layer, ops)


def test_shared_regions_are_declared_alike_by_every_kind() -> None:
    """Blocks that need one region name share it (sized to the largest): every declaration of a
    name agrees on the arena, the rank, the group and the flags."""
    decl: dict[str, tuple] = {}
    shape = StepShape(2, 1, 32, 2, 8, 4)
    for name in ALL_TINY:
        cfg = preset(name)
        for blk in cfg.blocks:
            for nd in kind(blk.kind).needs(blk, cfg, shape):
                key = (nd.arena, len(nd.shape), nd.group, nd.const, nd.persistent, nd.table)
                assert decl.setdefault(nd.name, key) == key, (blk.kind, nd.name)


def test_base_defaults() -> None:
    """What a kind inherits: an optional hook does nothing; the init role is chosen by name."""
    cfg = preset("llama-tiny")
    blk = Block(0, "x", "swiglu", None, "p.", "n")
    shape = StepShape(2, 3, 16, 1, 8, 0)
    assert shape.rows == 6
    assert LayerKind.init_role("q_proj.bias", blk) == "bias"
    assert LayerKind.init_role("dt_bias", blk) == "proj"
    assert LayerKind.init_role("w.weight", blk) == "proj"
    assert LayerKind.vectors(blk, cfg) == [] and LayerKind.tables(blk, cfg, None) == {}
    assert LayerKind.needs(blk, cfg, shape) == [] and LayerKind.state(blk, cfg, 2, 4) == []
    assert LayerKind.constants(blk, cfg, shape) == {} and LayerKind.header(blk, cfg) == {}
    assert LayerKind.coverage(blk, None) == {} and LayerKind.step_bytes(blk, None) == {}
    LayerKind.check(blk, cfg)
    LayerKind.check_record({}, blk, None, "")
    for hook, args in (("shapes", (blk, cfg)), ("matrices", (blk, cfg)),
                       ("pack", (blk, cfg, None)), ("stages", (blk, None, 0)),
                       ("kv", (blk, cfg, 1, 1)), ("cover", ({}, blk, None))):
        with pytest.raises(NotImplementedError):
            getattr(LayerKind, hook)(*args)
