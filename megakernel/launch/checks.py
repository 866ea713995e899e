"""The launcher's checks of a step against a kernel build, on the host before any CUDA call:
every tensor argument (dtype, shape against the build's static config, contiguity, device,
alignment), the program header's constants the build bakes in, and every record (alignment of
the 16-byte vector accesses, matrices of the build's model shapes, the indices each kind's
handlers assume). The layer kinds declare their part (LayerKind.kernel_header, kv_layout,
matvec_shapes, check_kernel_record); this module reads the declarations generically.

CPU-only logic (torch, no CUDA, no DSL); an ArgumentError names the first mismatch.
"""

from __future__ import annotations

from typing import Any

import torch

from megakernel import isa
from megakernel.common.errors import UserError
from megakernel.kernel.config.spec import KernelSpec, as_spec
from megakernel.layers.base import misaligned

Spec = KernelSpec | dict[str, Any]  # a build's spec, or a manifest's spec dict


class ArgumentError(UserError, ValueError):
    """A tensor or scalar argument of a launch that does not match the build."""


INT32_LIMIT = 1 << 31
TENSOR_ARGS = ("program", "counters", "weights", "f32", "bf16", "i32", "k_cache", "v_cache",
               "state")
_DTYPES = {"int32": torch.int32, "bfloat16": torch.bfloat16, "float32": torch.float32}


def validate_args(spec: Spec, tensors: dict[str, torch.Tensor], *, lengths_off: int,
                  max_seq_len: int | None = None, require_cuda: bool = True) -> None:
    """Check every tensor argument against the build's static config; raises ArgumentError.

    `max_seq_len`: the program header's S_MAX. The kernel takes S_max from the cache's S
    dimension and finds the rope sin table at ROPE_OFF + S_max * D/2, where the program put it
    for S_MAX: a cache of any other length would read the wrong table (or past it), so it is
    refused here, before any CUDA call.
    """
    from megakernel.kernel.config.spec import PARAMS

    dt = {p.name: _DTYPES[p.dtype] for p in PARAMS if p.kind == "ptr"}
    for name in TENSOR_ARGS:
        if name not in tensors:
            raise ArgumentError(f"missing tensor argument {name!r}")
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dt[name]:
            raise ArgumentError(f"{name} must be {dt[name]}, got {t.dtype}")
    prog = tensors["program"]
    if prog.dim() != 3 or prog.shape[2] != isa.RECORD_WORDS or prog.shape[0] < 1:
        raise ArgumentError(f"program must be [num_sms, queue_len, {isa.RECORD_WORDS}] int32, "
                            f"got shape {tuple(prog.shape)}")
    for name in ("counters", "weights", "f32", "bf16", "i32"):
        if tensors[name].dim() != 1 or tensors[name].numel() == 0:
            raise ArgumentError(f"{name} must be a non-empty 1-D arena, got shape "
                                f"{tuple(tensors[name].shape)}")
    if tensors["state"].dim() != 1:  # empty for a model without recurrent layers
        raise ArgumentError(f"state must be a 1-D fp32 arena, got shape "
                            f"{tuple(tensors['state'].shape)}")
    if tensors["counters"].numel() < isa.COUNTER_BASE:
        raise ArgumentError(f"counters must have at least {isa.COUNTER_BASE} words")
    for name in ("f32", "bf16", "i32"):  # the kernel's arena offsets are int32 element offsets
        if tensors[name].numel() >= INT32_LIMIT:
            raise ArgumentError(f"{name} arena has {tensors[name].numel()} elements; the kernel "
                                f"addresses it with int32 offsets (< 2^31)")
    spec = as_spec(spec)
    L, B = spec.kv_layers, spec.batch  # the cache has a slot per attention layer
    if spec.paged:
        check_pages(spec, tensors, L)
    for name, (Hkv, D) in kv_layout(spec).items() if not spec.paged else ():
        t = tensors[name]
        if t.dim() != 5:
            raise ArgumentError(f"{name} must be [L, B, Hkv, S_max, D] = [{L}, {B}, {Hkv}, "
                                f"S_max, {D}], got shape {tuple(t.shape)}")
        if t.shape[1] > B:
            raise ArgumentError(f"{name} holds batch {t.shape[1]} but the kernel was built for "
                                f"batch {B}; rebuild with --batch {t.shape[1]}")
        if (t.shape[0], t.shape[1], t.shape[2], t.shape[4]) != (L, B, Hkv, D):
            raise ArgumentError(f"{name} must be [L, B, Hkv, S_max, D] = [{L}, {B}, {Hkv}, "
                                f"S_max, {D}], got shape {tuple(t.shape)}")
    if (tensors["k_cache"].shape[:4] != tensors["v_cache"].shape[:4]
            and not spec.paged):
        raise ArgumentError(f"k_cache {tuple(tensors['k_cache'].shape)} and v_cache "
                            f"{tuple(tensors['v_cache'].shape)} differ")
    if (max_seq_len is not None and not spec.paged
            and tensors["k_cache"].shape[3] != max_seq_len):
        raise ArgumentError(f"the KV cache has S_max = {tensors['k_cache'].shape[3]} positions "
                            f"but the program was compiled for max_seq_len {max_seq_len} (its "
                            f"rope tables are laid out for it); allocate the cache with "
                            f"{max_seq_len} positions or recompile the program")
    for name in TENSOR_ARGS:
        if not tensors[name].is_contiguous():
            raise ArgumentError(f"{name} must be contiguous (got strides "
                                f"{tuple(tensors[name].stride())})")
    if lengths_off < 0 or lengths_off + B > tensors["i32"].numel():
        raise ArgumentError(f"lengths_off {lengths_off} + batch {B} is outside the i32 arena "
                            f"({tensors['i32'].numel()} elements)")
    if require_cuda:
        devs = {str(tensors[n].device) for n in TENSOR_ARGS}
        bad = [n for n in TENSOR_ARGS if tensors[n].device.type != "cuda"]
        if bad:
            raise ArgumentError(f"the kernel needs CUDA tensors; {', '.join(bad)} "
                                f"{'is' if len(bad) == 1 else 'are'} on "
                                f"{tensors[bad[0]].device}")
        if len(devs) != 1:
            raise ArgumentError(f"all tensors must be on one device, got {sorted(devs)}")
        for n in TENSOR_ARGS:
            if tensors[n].data_ptr() % 16:
                raise ArgumentError(f"{n} must be 16-byte aligned (data_ptr % 16 = "
                                    f"{tensors[n].data_ptr() % 16})")


def kv_layout(spec: Spec) -> dict[str, tuple[int, int]]:
    """(heads, last dim) of k_cache and v_cache [L, B, heads, S_max, dim], as the build's cache
    kind declares them (LayerKind.kv_layout: (Hkv, D) for both, or MLA's latent cache c (1, r)
    and k_rope (1, dr)); (Hkv, D) for a model without a cache kind."""
    s = as_spec(spec)
    for kd in s.layer_kinds():
        if kd.kv_cache:
            return kd.kv_layout(s)
    return {"k_cache": (s.kv_heads, s.head_dim), "v_cache": (s.kv_heads, s.head_dim)}


def check_pages(spec: Spec, tensors: dict[str, torch.Tensor], slots: int) -> None:
    """A paged build's caches: K [slots, num_blocks, Hkv, D, block_size] and V [slots,
    num_blocks, Hkv, block_size, D] of the pool the build bakes in (kernel/host/paged_index.py)."""
    spec = as_spec(spec)
    nb, bs = spec.paged[0], spec.paged[1]
    Hkv, D = spec.kv_heads, spec.head_dim
    for name, want in (("k_cache", (slots, nb, Hkv, D, bs)), ("v_cache", (slots, nb, Hkv, bs, D))):
        if tuple(tensors[name].shape) != want:
            raise ArgumentError(f"{name} must be the paged build's pages {list(want)}, got shape "
                                f"{tuple(tensors[name].shape)}")


def check_header(header: dict[str, int], spec: Spec) -> None:
    """The program header's constants a build bakes in: the RMSNorm form, the ReplaySSM window
    and ring capacity, the page pool of a paged build (and no pages for a contiguous one), and
    each layer kind's (LayerKind.kernel_header: the RoPE dims and output gate of attention, the
    MoE's shape); ArgumentError naming the first mismatch."""
    s = as_spec(spec)
    want = {"NORM_KIND": int(s.norm_one_plus), "REPLAY_WINDOW": s.replay_window,
            "DRAFTS": s.drafts, "NGRAM": s.ngram}
    if s.replay_window:
        want["RING_CAP"] = s.ring_cap
    want.update(s.paged_shape.header() if s.paged else {"PAGED": 0})
    for kd in s.layer_kinds():
        want.update(kd.kernel_header(s))
    for k, v in want.items():
        if header.get(k, 0) != v:
            raise ArgumentError(f"program header {k}={header.get(k)} but the kernel build has "
                                f"{v}: the program is for another model or build")


def check_records(records: torch.Tensor, spec: Spec, layout=None) -> None:  # noqa: ANN001
    """Every record against the build (host, once per program): its opcode has a handler in the
    build; a matvec's slab is a row range of one of the build's matrices for that opcode
    (KernelSpec.matvec_shapes: a program compiled for another model is refused here) with the
    offsets and K its 16-byte vector accesses assume (multiples of 8 elements); every other
    check is the record's kind's (LayerKind.check_kernel_record: whole heads, gate/up block
    pairs, indices within the build's batch, heads, units). With the program's weight layout
    (program/pack.WeightLayout) a matvec's W must also point into a matrix of the format the
    build reads for its opcode (check_weight_format: a bf16 program on an FP8 build, or the
    other way round, is refused here)."""
    from megakernel.layers import kind

    if records.dtype != torch.int32 or records.dim() != 3:
        raise ArgumentError("records must be int32 [num_sms, queue_len, 16]")
    s = as_spec(spec)
    shapes = s.matvec_shapes()
    handled = set(s.handled_ops)
    owners = {op: kind(isa.spec(op).kind) for op in handled if isa.spec(op).kind != "frame"}
    for sm, queue in enumerate(records.tolist()):
        for pos, rec in enumerate(queue):
            if rec[0] == isa.Op.END:
                break
            try:
                d = isa.decode(rec)
            except ValueError as e:
                raise ArgumentError(f"SM {sm} record {pos}: {e}") from None
            op = d["OPCODE"]
            where = f"SM {sm} record {pos} ({op.name})"
            if op not in handled or (isa.spec(op).matvec and op not in shapes):
                raise ArgumentError(f"{where}: the kernel build has no handler for {op.name}; "
                                    "the program is for another model or build")
            matvec = isa.spec(op).matvec is not None
            why = check_matvec_record(d, shapes[op]) if matvec else ""
            frame = isa.spec(op).check  # a frame opcode's own check (layers/frame.py, ...)
            why = why or (owners[op].check_kernel_record(d, s) if op in owners
                          else frame(d, s) if frame else "")
            why = why or (misaligned(d, matvec_alignment(d)) if matvec else "")
            if matvec and layout is not None:
                why = why or check_weight_format(d, s, layout)
            if why:
                raise ArgumentError(f"{where}: {why}")


def matvec_alignment(d: dict) -> dict[str, int]:
    """The multiples a matvec record's operands must be for the GEMV's 16-byte vectors."""
    need = {"W": 8, "K": 8, "IN_OFF": 8, "NROWS": 16}
    if d["NORM_OFF"] >= 0:
        need["NORM_OFF"] = 8
    return need


def check_matvec_record(d: dict, mats: list[tuple[int, int]]) -> str:
    """Why a matvec record does not fit the build ('' when it does): its slab must be rows of one
    of `mats` (K, rows); PROJ's output width one of the projection widths."""
    if not any(d["K"] == k and 0 <= d["ROW0"] and d["ROW0"] + d["NROWS"] <= rows
               for k, rows in mats):
        return (f"K={d['K']}, rows [{d['ROW0']}, {d['ROW0'] + d['NROWS']}) do not fit the "
                f"build's {' or '.join(f'[{r}, {k}]' for k, r in mats)} matrix; the program is "
                "for another model or build")
    if d["OPCODE"] == isa.Op.PROJ and d["OUT_W"] not in (r for _, r in mats):
        return (f"OUT_W={d['OUT_W']} is not a projection width of the build's recurrent layers "
                f"({', '.join(str(r) for _, r in mats)})")
    return ""


def check_weight_format(d: dict, spec: KernelSpec, layout) -> str:  # noqa: ANN001 (WeightLayout)
    """Why a matvec record's W does not point where the build reads its slab ('' when it does):
    into an "fp8" entry for the build's FP8 opcodes (KernelSpec.fp8_ops: every matvec of an FP8
    build but LMHEAD, unless the head is quantized), a "bf16" one otherwise, at the start of row
    ROW0 of a K-wide matrix, with the build's scales per row (docs/FP8.md)."""
    from megakernel.program.pack import PackError

    op = d["OPCODE"]
    try:
        e = layout.entry_at(d["W"])
    except PackError as err:
        return f"W={d['W']}: {err}"
    want = "fp8" if op in spec.fp8_ops else "bf16"
    if e.dtype != want:
        build = (f"an FP8 ({spec.fp8} scales) build" if spec.fp8 else "a bf16-weight build")
        return (f"W={d['W']} points into a {e.dtype} matrix {e.shape}, but {build} reads "
                f"{want} slabs for {op.name}: the program's weights are in another format "
                f"than the kernel's; build the kernel for the model's weight format")
    if len(e.shape) != 2 or e.shape[1] != d["K"] or e.w(d["ROW0"]) != d["W"]:
        return (f"W={d['W']} is not row {d['ROW0']} of a K={d['K']} matrix (the {e.dtype} "
                f"entry at {e.offset} {e.shape})")
    q = spec.quant
    if e.dtype == "fp8" and (e.chunks, e.chunk) != (q.chunks(d["K"]), q.chunk(d["K"])):
        return (f"the fp8 matrix at {e.offset} has {e.chunks} scales per row of {e.chunk} "
                f"inputs; the build reads {q.chunks(d['K'])} of {q.chunk(d['K'])} ({spec.fp8} "
                "granularity)")
    return ""


def check_lengths(spec: Spec, lengths: list[int], s_max: int) -> None:
    """Host-side view of the cache: every sequence has room for this step's T tokens."""
    spec = as_spec(spec)
    T, B = spec.tokens, spec.batch
    if len(lengths) > B:
        raise ArgumentError(f"{len(lengths)} sequences but the kernel was built for batch {B}")
    for b, n in enumerate(lengths):
        if n < 0 or n + T > s_max:
            raise ArgumentError(f"sequence {b}: {n} cached + {T} new tokens exceed the cache "
                                f"length {s_max}")
