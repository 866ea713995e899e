"""The layer-kind interface and its registry.

A `LayerKind` is a class of class methods and declarations, registered by name with
`@register_kind`. A model's blocks (models/config.py `Block`) name their kind; everything the host
does with a block goes through the kind:

checkpoint   `shapes` (Hugging Face tensor names relative to the block's prefix -> shape),
             `init_role` (how random weights are drawn, models/weights.py), `fp32_params`
             (tensors transformers keeps in fp32, not rounded in the reference's bf16 mode)
packing      `vectors` (small tensors, packed at the head of the arena so that 32-bit operands
             reach them) and `matrices` (everything streamed as slabs), `pack` (checkpoint
             tensors -> packed tensors), `tables` (fp32 constants stored in the f32 arena)
buffers      `needs` (activation scratch, constants, per-layer tables), `kv` (the per-layer
             cache it keeps), `state` (persistent fp32 recurrent state: conv window, state,
             ReplaySSM ring)
program      its opcodes (isa.registry, declared in the kind's module), `stages` (the block's
             work as stages, waiting on the block input), `flow` (which opcode of the block
             waits on which: the verifier's dataflow check), `coverage` (work units of the
             opcodes without a weight slab, checked once per step by the verifier),
             `slab_passes` (matrices whose slabs are bound at run time)
cost         `step_bytes` (bytes by category, for the per-family byte accounting)
kernel       `kernel_constants` (the shapes a build bakes in), `kernel_shape` (its handlers'
             index arithmetic), `kernel_support`, `kernel_check`, `matvec_shapes`, `kernel_header`,
             `kv_layout`, `check_kernel_record`: the kind's device declaration, read generically by
             the build (kernel/config/spec.py, kernel/config/model_spec.py) and the launcher's
             checks (runtime.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from megakernel.common.registry import Registry

if TYPE_CHECKING:
    import torch

    from megakernel.isa.stages import Stage
    from megakernel.models.config import Block, ModelConfig
    from megakernel.program.paged import PagedKV

KINDS: Registry[type[LayerKind]] = Registry("megakernel.layers", "layer kind",
                                           skip=("base", "recurrent"))

# buffer groups: regions of one arena are laid out group by group, in declaration order within a
# group (so that adding a kind never moves the regions of the others)
STREAM, SCRATCH, OUTPUT, CONST = 0, 1, 2, 3


@dataclass(frozen=True)
class Need:
    """A region a block needs in one of the typed arenas ("f32", "bf16", "i32").

    Blocks that need the same name share one region, sized to the largest; a block uses the
    region's first prod(shape) elements as a tensor of its own `shape` (so a matvec input is
    contiguous [N, K] whichever block wrote it). `table`: the region
    has one row of `shape` per block that declares it with this table name (rows in block order;
    `ProgramBuffers.row(table, layer)`). `const`: host-written constants (kept when scratch is
    poisoned). `persistent`: carried from step to step (not scratch).
    """

    arena: str
    name: str
    shape: tuple[int, ...]
    group: int = SCRATCH
    const: bool = False
    persistent: bool = False
    table: str | None = None


@dataclass(frozen=True)
class StepShape:
    """What a block's buffers depend on: rows and cache sizes of one program."""

    batch: int
    tokens: int
    max_seq_len: int
    n_splits: int
    num_sms: int
    ring_cap: int  # ReplaySSM ring entries per (layer, sequence); 0: recurrent update
    paged: PagedKV | None = None  # paged KV and caller-owned step metadata (program/paged.py)
    drafts: int = 0  # a speculative step's drafts k (tokens = 1 + k; layers/speculative.py)

    @property
    def rows(self) -> int:
        return self.batch * self.tokens


def partial_argmax_bytes(n_tiles: int, rows: int) -> int:
    """Bytes the step's end (ARGMAX, ACCEPT) reads of the LM head's partial argmaxes: one f32
    (max logit, index) pair per slot and activation row (buffer "part_argmax")."""
    return n_tiles * rows * 8


def misaligned(d: dict, need: dict[str, int]) -> str:
    """'' when every operand named in `need` of decoded record `d` is a multiple of its value,
    else what the first that is not breaks (check_kernel_record's alignment part)."""
    for k, m in need.items():
        if d[k] % m:
            return f"{k}={d[k]} is not a multiple of {m}; the kernel's vector accesses need it"
    return ""


def register_kind(cls: type[LayerKind]) -> type[LayerKind]:
    """Class decorator: register a layer kind under `cls.name`."""
    return KINDS.add(cls.name, cls)


class LayerKind:
    """Base class of the layer kinds; see the module docstring for what each hook means."""

    name: ClassVar[str] = ""
    config: ClassVar[type] = object
    recurrent: ClassVar[bool] = False  # conv window, state and ReplaySSM ring per layer
    kv_cache: ClassVar[bool] = False  # a K/V (or latent) cache slot per layer
    # kv_cache kinds' split-KV attention: (most splits, fewest keys a split) per (sequence, kv
    # head of `split_heads`); the compiler's default split count stays within them
    splits: ClassVar[tuple[int, int]] = (16, 64)
    fp32_params: ClassVar[tuple[str, ...]] = ()  # local names kept fp32 by transformers
    # opcode name -> the opcode(s) of the same block it waits on (None: the block's input)
    flow: ClassVar[dict[str, object]] = {}
    out_op: ClassVar[str] = ""  # the opcode whose counter ends the block: derived from `flow`
    # a speculative step's opcodes of the kind that run after the step's end: opcode name -> the
    # sort of step whose end they wait on (isa.step_end: "speculative", layers/speculative.py)
    after: ClassVar[dict[str, str]] = {}
    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.flow:  # the one opcode of the flow no other opcode waits on
            waited = {p for v in cls.flow.values() if v
                      for p in ((v,) if isinstance(v, str) else v)}
            ends = [op for op in cls.flow if op not in waited]
            if len(ends) != 1:
                raise ValueError(f"layer kind {cls.name}: flow {cls.flow} must end in one opcode")
            cls.out_op = ends[0]

    # ---- kernel build: the kind's device declaration (read by kernel/config/spec.py, runtime.py)
    @classmethod
    def kernel_constants(cls, cfg: Any) -> tuple[int, ...]:
        """The shapes of this kind's config (`cls.config`) a kernel build bakes in: its entry of
        `KernelSpec.kinds`, read back by the device code with `spec.constants(name)`."""
        return ()

    @classmethod
    def kernel_shape(cls, spec: Any) -> Any:  # noqa: ANN401 (a kernel/*_index shape)
        """The index arithmetic of this kind's device handlers for a build (a pure-python shape
        with `smem()`, shared by the handlers and their host emulation); None: no such handler."""
        return None

    @classmethod
    def kernel_support(cls, cfg: Any) -> str:
        """What of this kind's config no kernel build supports yet ('' when builds do), checked
        before a spec is made: check_kernel_support's "the kernel does not support ... yet"."""
        return ""

    @classmethod
    def kernel_check(cls, spec: Any) -> str:
        """Why a build cannot serve this kind's layers ('' when it can): SpecError's text."""
        return ""

    @classmethod
    def matvec_shapes(cls, spec: Any) -> dict[str, list[tuple[int, int]]]:
        """Opcode name -> the (K, rows) of the matrices this kind's matvec records stream in a
        build (what the build's K budget and the runtime's record checks read)."""
        return {}

    @classmethod
    def kernel_header(cls, spec: Any) -> dict[str, int]:
        """Program header fields a program must hold to run on the build (check_header in
        launch/checks.py): the constants its handlers take from the build, not the header."""
        return {}

    @classmethod
    def kv_layout(cls, spec: Any) -> dict[str, tuple[int, int]]:
        """kv_cache kinds: (heads, last dim) of the build's k_cache and v_cache [slots, B, heads,
        S_max, dim]."""
        raise NotImplementedError

    @classmethod
    def check_kernel_record(cls, d: dict, spec: Any) -> str:
        """Why a decoded record of one of this kind's opcodes does not fit the build ('' when it
        does): index bounds and operand alignment its handler or epilogue assumes (checked on
        every record before a launch, launch.checks.check_records)."""
        return ""

    # ---- checkpoint ------------------------------------------------------------------------------
    @classmethod
    def shapes(cls, blk: Block, model: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Local tensor name (after `blk.prefix`) -> shape, in checkpoint order."""
        raise NotImplementedError

    @classmethod
    def init_role(cls, local: str, blk: Block) -> str:
        """Random-init role of a tensor (models/weights.py ROLES); default by name and rank."""
        if local.endswith("bias") and not local.endswith("dt_bias"):
            return "bias"
        return "proj"

    @classmethod
    def check(cls, blk: Block, model: ModelConfig) -> None:
        """ConfigError naming a shape of this block that megakernel does not support."""

    # ---- packing ---------------------------------------------------------------------------------
    @classmethod
    def vectors(cls, blk: Block, model: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """Small packed tensors (beside the block's input norm): key suffix -> shape."""
        return []

    @classmethod
    def matrices(cls, blk: Block, model: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """Packed matrices streamed as slabs: key suffix -> shape."""
        raise NotImplementedError

    @classmethod
    def quantized(cls, blk: Block, model: ModelConfig) -> list[str]:
        """Local names of the checkpoint matrices its `matrices` are packed from: what an FP8
        model stores in e4m3 (models/fp8.py); every packed matrix comes only from these."""
        return []

    @classmethod
    def pack(cls, blk: Block, model: ModelConfig, w: Any) -> dict[str, torch.Tensor]:
        """Packed tensors by key suffix; `w(local)` is the checkpoint tensor (bf16)."""
        raise NotImplementedError

    @classmethod
    def tables(cls, blk: Block, model: ModelConfig, w: Any) -> dict[str, torch.Tensor]:
        """fp32 rows of per-layer tables (Need.table) by region name; `w(local)` is the
        checkpoint tensor in fp32."""
        return {}

    # ---- buffers ---------------------------------------------------------------------------------
    @classmethod
    def needs(cls, blk: Block, model: ModelConfig, shape: StepShape) -> list[Need]:
        return []

    @classmethod
    def constants(cls, blk: Block, model: ModelConfig, shape: StepShape
                  ) -> dict[str, torch.Tensor]:
        """Host-computed fp32 constants (CONST regions it needs) by region name."""
        return {}

    @classmethod
    def split_heads(cls, cfg: Any) -> int:
        """KV heads a sequence's cache is split for (kv_cache kinds): one attention partial per
        (sequence, kv head, split)."""
        raise NotImplementedError

    @classmethod
    def kv(cls, blk: Block, model: ModelConfig, batch: int, max_seq_len: int
           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of the K and V caches (kv_cache kinds): [B, heads, S_max, dims]."""
        raise NotImplementedError

    @classmethod
    def state(cls, blk: Block, model: ModelConfig, batch: int, ring_cap: int, pending: int = 0
              ) -> list[tuple[str, tuple[int, ...]]]:
        """The layer's blocks of the persistent fp32 state arena (recurrent kinds), in order:
        "conv" [B, C, K-1], "state" [B, ...], then (ring_cap > 0) the ring entries, then (a
        speculative step's T = `pending`) "pending" [B, C, T]."""
        return []

    # ---- program ---------------------------------------------------------------------------------
    @classmethod
    def header(cls, blk: Block, model: ModelConfig) -> dict[str, int]:
        """Program header fields of this kind (the same for every block of the kind)."""
        return {}

    @classmethod
    def stages(cls, blk: Block, ctx: Any, wait: int) -> tuple[list[Stage], int]:
        """The block's stages, the first waiting on counter `wait` (the block input); returns
        them and the counter that ends the block."""
        raise NotImplementedError

    @classmethod
    def check_record(cls, d: dict, blk: Block, prog: Any, where: str) -> None:
        """ProgramError (program/verify.py) naming a record of this block that breaks one of the
        kind's invariants."""

    @classmethod
    def binding(cls, d: dict, blk: Block, prog: Any) -> tuple[int, bool, bool] | None:
        """For a record that writes or reads a run-time binding region (the MoE's work list):
        (the region's offset, whether it writes it, whether a reader may find nothing bound and
        stream no tiles); None for other records. The verifier's binding rule reads it."""
        return None

    @classmethod
    def slab_passes(cls, blk: Block, prog: Any) -> dict[str, int]:
        """Times per step the block's slab records cover a packed matrix (key suffix), for the
        matrices not covered exactly once: a matrix reached only through a run-time binding (0)
        and the one whose records are bound at run time to it or its likes (once per binding:
        layers/moe.py's work slots)."""
        return {}

    @classmethod
    def coverage(cls, blk: Block, prog: Any) -> dict[str, int]:
        """Work units per step of the block's opcodes without a weight slab, by opcode name;
        `cover` maps a record of one of them to its unit (each unit once per step)."""
        return {}

    @classmethod
    def cover(cls, d: dict, blk: Block, prog: Any) -> tuple[int, int]:
        """The units [lo, hi) a record of an opcode in `coverage` covers."""
        raise NotImplementedError

    # ---- cost -----------------------------------------------------------------------------------
    @classmethod
    def step_bytes(cls, blk: Block, prog: Any) -> dict[str, float]:
        """Bytes one step moves for this block, by category (program/bytes.py)."""
        return {}
