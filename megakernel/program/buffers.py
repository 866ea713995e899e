"""The buffer plan: where every region of a program lives in the typed arenas, the caches and the
recurrent state.

The kernel gets one pointer per arena; record operands are element offsets into them.

    weights  bf16  the packed weight arena (program/pack.py)
    f32      fp32  regions the blocks need (layers/*.py `needs`), e.g. h, attention partials,
                   projections, logits; constants written once by the host (RoPE tables,
                   per-layer SSM parameters, routers)
    bf16     bf16  q, attention outputs, MLP activations, ...
    i32      int32 tokens in/out, lengths, ReplaySSM ring counts, expert ids
    k, v     bf16  the KV cache [slots, B, heads, S_max, dims], one slot per layer with a cache
                   (attention: k, v; MLA: the latent c and k_rope), in layer order
    state    fp32  persistent recurrent state, per recurrent layer a block: conv window, state,
                   ReplaySSM ring; 64-bit offsets

Regions of an arena are laid out group by group (layers/base.py: stream, scratch, output,
constants), in order of first declaration within a group, each on a 64-element boundary; blocks
that need one name share a region sized to the largest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megakernel.isa.stages import PlanError, Region
from megakernel.layers import kind
from megakernel.layers.base import Need, StepShape
from megakernel.layers.frame import needs as frame_needs
from megakernel.program.paged import PagedKV

ARENAS = ("f32", "bf16", "i32")
ALIGN = 64


@dataclass
class BufferPlan:
    f32: dict[str, Region]
    bf16: dict[str, Region]
    i32: dict[str, Region]
    f32_numel: int
    bf16_numel: int
    i32_numel: int
    kv_shape: tuple[int, ...]  # K cache [slots, B, heads, S_max, dims] (paged: paged.py)
    v_shape: tuple[int, ...]  # V cache
    kv_slot: dict[int, int] = field(default_factory=dict)  # layer -> KV cache slot
    state: dict[int, dict[str, Region]] = field(default_factory=dict)  # layer -> its blocks
    state_numel: int = 0
    rows: dict[str, dict[int, int]] = field(default_factory=dict)  # table -> layer -> row
    tables: dict[str, str] = field(default_factory=dict)  # region -> its table (Need.table)
    constants: tuple[str, ...] = ()  # f32 regions written once by the host
    persistent: tuple[tuple[str, str], ...] = ()  # (arena, region) carried across steps
    ring_cap: int = 0  # ReplaySSM ring entries per (layer, sequence); 0: recurrent update
    paged: PagedKV | None = None  # the page pool when K/V are paged (program/paged.py)

    def row(self, table: str, layer: int) -> int:
        return self.rows[table][layer]

    def state_view(self, state: torch.Tensor, layer: int, name: str) -> torch.Tensor:
        """Region `name` of recurrent layer `layer` in the flat state arena `state`, as a view
        of its shape ([B, ...])."""
        r = self.state[layer][name]
        return state[r.offset : r.offset + r.numel].view(r.shape)

    def region_row(self, region: str, layer: int) -> int:
        """The row of `layer` in table region `region`."""
        return self.rows[self.tables[region]][layer]

    def poison_scratch(self, f32, bf16) -> None:  # noqa: ANN001 (torch tensors)
        """NaN over every scratch value of the f32 and bf16 arenas, keeping the host-written
        constants (RoPE tables, ...): what a step must overwrite before anyone reads it."""
        saved = [(r, f32[r.offset: r.offset + r.numel].clone())
                 for r in (self.f32[n] for n in self.constants)]
        f32.fill_(float("nan"))
        bf16.fill_(float("nan"))
        for r, t in saved:
            f32[r.offset: r.offset + r.numel] = t

    @property
    def kv_bytes(self) -> int:
        return 2 * (math.prod(self.kv_shape) + math.prod(self.v_shape))

    @property
    def state_bytes(self) -> int:
        return 4 * self.state_numel

    @property
    def scratch_bytes(self) -> int:
        return 4 * self.f32_numel + 2 * self.bf16_numel + 4 * self.i32_numel


def _merge(needs: list[Need]) -> dict[str, dict[str, tuple[Need, tuple[int, ...]]]]:
    """arena -> name -> (first need, merged shape), in layout order."""
    out: dict[str, dict[str, tuple[Need, tuple[int, ...]]]] = {a: {} for a in ARENAS}
    for nd in sorted(needs, key=lambda x: x.group):  # stable: declaration order within a group
        if nd.arena not in out:
            raise ValueError(f"region {nd.name}: unknown arena {nd.arena!r}")
        have = out[nd.arena].get(nd.name)
        if have is None:
            out[nd.arena][nd.name] = (nd, nd.shape)
            continue
        first, shape = have
        if len(shape) != len(nd.shape) or first.group != nd.group or first.const != nd.const:
            raise PlanError(f"blocks need region {nd.arena}.{nd.name} with incompatible layouts "
                            f"{shape} and {nd.shape}")
        out[nd.arena][nd.name] = (first, tuple(max(a, b) for a, b in zip(shape, nd.shape,
                                                                             strict=True)))
    return out


def plan_buffers(cfg, shape: StepShape) -> BufferPlan:  # noqa: ANN001 (ModelConfig)
    """The buffer plan of `cfg` for one step shape (see the module docstring)."""
    needs: list[Need] = list(frame_needs(cfg, shape))
    rows: dict[str, dict[int, int]] = {}
    for blk in cfg.blocks:
        for nd in kind(blk.kind).needs(blk, cfg, shape):
            if nd.table is not None:
                table = rows.setdefault(nd.table, {})
                table.setdefault(blk.layer, len(table))
            needs.append(nd)
    counts = {t: len(r) for t, r in rows.items()}
    tables = {nd.name: nd.table for nd in needs if nd.table}
    needs = [Need(nd.arena, nd.name, (counts[nd.table], *nd.shape), nd.group, nd.const,
                  nd.persistent) if nd.table else nd for nd in needs]
    arenas: dict[str, dict[str, Region]] = {}
    sizes: dict[str, int] = {}
    const, persistent = [], []
    for arena, regions in _merge(needs).items():
        out, off = {}, 0
        for name, (nd, shp) in regions.items():
            off = (off + ALIGN - 1) // ALIGN * ALIGN
            out[name] = Region(off, shp)
            off += math.prod(shp)
            if nd.const:
                const.append(name)
            if nd.persistent:
                persistent.append((arena, name))
        arenas[arena] = out
        sizes[arena] = (off + ALIGN - 1) // ALIGN * ALIGN

    # KV cache: one slot per layer with a cache, every slot of one layout
    kv_slot: dict[int, int] = {}
    kv_shapes: set = set()
    for blk in cfg.blocks:
        kd = kind(blk.kind)
        if kd.kv_cache:
            kv_slot[blk.layer] = len(kv_slot)
            if shape.paged is None:
                kv_shapes.add(kd.kv(blk, cfg, shape.batch, shape.max_seq_len))
            elif blk.kind != "attention":
                raise PlanError(f"paged KV serves attention layers; layer {blk.layer} is "
                                f"{blk.kind}")
            else:
                kv_shapes.add(shape.paged.page_shapes(blk.cfg.num_kv_heads, blk.cfg.head_dim))
    if len(kv_shapes) > 1:
        raise PlanError(f"the model's layers keep KV caches of different layouts {kv_shapes}; "
                        "one program serves one layout")
    k_shape, v_shape = kv_shapes.pop() if kv_shapes else ((shape.batch, 1, 1, 1),) * 2
    n_slots = max(1, len(kv_slot))

    # persistent recurrent state: per recurrent layer, its blocks in order
    state: dict[int, dict[str, Region]] = {}
    off = 0
    for blk in cfg.blocks:
        regs = kind(blk.kind).state(blk, cfg, shape.batch, shape.ring_cap,
                                    shape.tokens if shape.drafts else 0)
        if regs:
            state[blk.layer] = {}
            for name, shp in regs:
                state[blk.layer][name] = Region(off, shp)
                off += math.prod(shp)
    return BufferPlan(arenas["f32"], arenas["bf16"], arenas["i32"], sizes["f32"], sizes["bf16"],
                      sizes["i32"], (n_slots, *k_shape), (n_slots, *v_shape), kv_slot, state, off,
                      rows, tables, tuple(const), tuple(persistent), shape.ring_cap,
                      shape.paged)
