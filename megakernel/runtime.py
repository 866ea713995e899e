"""Load a prebuilt megakernel cubin and launch it with the CUDA driver API (cuda-python).

Needs torch and cuda-python only, never the DSL: this is what runs on a GPU machine that cannot
install the compiler. A build directory (megakernel.kernel.build) holds DIR/<arch>/manifest.json
next to the cubin. Before anything touches CUDA the runtime checks, with errors that name the
problem:
- the manifest: schema, program FORMAT_VERSION (a stale build is refused), arch;
- the device: compute capability -> arch (9.0 -> sm_90a, 10.0 -> sm_100a), SM count >= CTAs of
  the program (all CTAs must be co-resident: they spin on each other), shared-memory opt-in limit,
  and, before the first launch, the driver's occupancy (blocks per SM x SMs >= CTAs);
- every tensor argument: dtype, shape (against the build's static config), contiguity, device,
  batch and length within what the build serves.
The launch goes on torch's current stream with the cooperative attribute (co-residency is then
guaranteed or the launch fails), so it is stream-ordered with torch work and graph-capturable.
A step whose counter wait does not complete within 10 s (a deadlock) ends with CUDA's "an illegal
instruction was encountered": the kernel's watchdog trap (megakernel/kernel/sync.py).
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megakernel import isa

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
CAPABILITY_ARCH = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
ARCHS = tuple(CAPABILITY_ARCH.values())


class KernelUnavailable(RuntimeError):
    """The kernel cannot run here (no GPU, unsupported GPU, no build for it, no cuda-python)."""


class ManifestError(ValueError):
    """A build directory or manifest that this runtime refuses (stale, wrong arch, damaged)."""


class ArgumentError(ValueError):
    """A tensor or scalar argument of a launch that does not match the build."""


# ---- manifest -----------------------------------------------------------------------------------
_REQUIRED = ("manifest_version", "arch", "symbol", "cubin", "block", "dynamic_smem_bytes",
             "params", "program_format_version", "fingerprint", "spec", "resources")


@dataclass(frozen=True)
class Manifest:
    path: Path  # the directory holding manifest.json and the cubin
    data: dict[str, Any]

    @property
    def arch(self) -> str:
        return self.data["arch"]

    @property
    def spec(self) -> dict[str, Any]:
        return self.data["spec"]

    @property
    def symbol(self) -> str:
        return self.data["symbol"]

    @property
    def block(self) -> tuple[int, int, int]:
        b = self.data["block"]
        return int(b[0]), int(b[1]), int(b[2])

    @property
    def smem(self) -> int:
        return int(self.data["dynamic_smem_bytes"])

    @property
    def params(self) -> list[dict[str, Any]]:
        return self.data["params"]

    @property
    def rows(self) -> int:
        return int(self.spec["batch"]) * int(self.spec["tokens"])

    def cubin_bytes(self) -> bytes:
        p = self.path / self.data["cubin"]
        if not p.is_file():
            raise ManifestError(f"cubin {p} named by the manifest is missing")
        return p.read_bytes()


def parse_manifest(data: dict[str, Any], path: Path, arch: str | None = None) -> Manifest:
    """Validate a manifest dict; refuses other manifest/program versions and the wrong arch."""
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ManifestError(f"manifest in {path} lacks {', '.join(missing)}")
    if data["manifest_version"] != MANIFEST_VERSION:
        raise ManifestError(f"manifest in {path} has version {data['manifest_version']}; this "
                            f"runtime reads version {MANIFEST_VERSION}: rebuild the kernel")
    if data["program_format_version"] != isa.FORMAT_VERSION:
        raise ManifestError(
            f"stale build in {path}: compiled for program format version "
            f"{data['program_format_version']}, but the program compiler now emits version "
            f"{isa.FORMAT_VERSION}; rebuild with `python -m megakernel build`")
    if data["arch"] not in ARCHS:
        raise ManifestError(f"manifest in {path} is for unsupported arch {data['arch']!r}")
    if arch is not None and data["arch"] != arch:
        raise ManifestError(f"manifest in {path} is for {data['arch']}, the device needs {arch}")
    from megakernel.kernel.spec import PARAMS  # pure Python: no DSL import

    names = [p["name"] for p in data["params"]]
    if names != [p.name for p in PARAMS]:
        raise ManifestError(f"manifest in {path} has parameters {names}; this runtime launches "
                            f"{[p.name for p in PARAMS]}: rebuild the kernel")
    return Manifest(path, data)


def load_manifest(build_dir: str | Path, arch: str) -> Manifest:
    """The manifest of `arch` in a build directory (DIR/<arch>/manifest.json, or DIR itself)."""
    d = Path(build_dir)
    for cand in (d / arch, d):
        f = cand / MANIFEST_NAME
        if f.is_file():
            try:
                data = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise ManifestError(f"{f} is not valid JSON: {e}") from None
            return parse_manifest(data, cand, arch)
    raise KernelUnavailable(f"no {arch} build in {d} (expected {d / arch / MANIFEST_NAME}); build "
                            f"one with `python -m megakernel build --arch {arch} --out {d}`")


# ---- device -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_optin: int  # bytes of dynamic shared memory one block may opt into

    @property
    def arch(self) -> str:
        return arch_for_capability(self.capability)


def arch_for_capability(cap: tuple[int, int]) -> str:
    if tuple(cap) not in CAPABILITY_ARCH:
        raise KernelUnavailable(f"GPU compute capability {cap[0]}.{cap[1]} is not a kernel "
                                f"target; the kernel runs on 9.0 (sm_90a) and 10.0 (sm_100a)")
    return CAPABILITY_ARCH[tuple(cap)]


def device_info(device: int | torch.device | None = None) -> DeviceInfo:
    if not torch.cuda.is_available():
        raise KernelUnavailable("no CUDA GPU is available (torch.cuda.is_available() is False); "
                                "the kernel needs an sm_90a or sm_100a GPU")
    idx = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    p = torch.cuda.get_device_properties(idx)
    smem = int(getattr(p, "shared_memory_per_block_optin", 0) or 0)
    return DeviceInfo(p.name, (p.major, p.minor), int(p.multi_processor_count), smem)


def check_device(m: Manifest, dev: DeviceInfo, num_ctas: int,
                 blocks_per_sm: int | None = None) -> None:
    """The build fits the device: arch, co-residency of every CTA, shared memory.

    `blocks_per_sm`: the driver's occupancy of the kernel at the manifest's block size and
    dynamic shared memory (cuOccupancyMaxActiveBlocksPerMultiprocessor); a cooperative launch
    needs blocks_per_sm * SMs >= CTAs, else the launch would fail (or, without the cooperative
    attribute, the CTAs would spin on CTAs that never start)."""
    if dev.arch != m.arch:
        raise ManifestError(f"the build in {m.path} is for {m.arch}, but {dev.name} is "
                            f"{dev.arch}: build for {dev.arch}")
    if num_ctas > dev.sm_count:
        raise ArgumentError(f"the program has {num_ctas} CTA queues but {dev.name} has "
                            f"{dev.sm_count} SMs: the CTAs spin on each other and must all be "
                            f"resident; compile the program for this GPU")
    if dev.smem_optin and m.smem > dev.smem_optin:
        raise ManifestError(f"the kernel needs {m.smem} B of shared memory per CTA, {dev.name} "
                            f"allows {dev.smem_optin} B")
    if blocks_per_sm is not None and blocks_per_sm * dev.sm_count < num_ctas:
        raise ArgumentError(
            f"the cooperative launch needs all {num_ctas} CTAs resident, but the driver's "
            f"occupancy is {blocks_per_sm} block(s) of {m.block[0]} threads with {m.smem} B of "
            f"dynamic shared memory per SM x {dev.sm_count} SMs = "
            f"{blocks_per_sm * dev.sm_count} < {num_ctas}")


# ---- argument validation (CPU-only logic; runs before any CUDA call) ----------------------------
INT32_LIMIT = 1 << 31
TENSOR_ARGS = ("program", "counters", "weights", "f32", "bf16", "i32", "k_cache", "v_cache",
               "state")
_DTYPES = {"int32": torch.int32, "bfloat16": torch.bfloat16, "float32": torch.float32}


def validate_args(spec: dict[str, Any], tensors: dict[str, torch.Tensor], *, lengths_off: int,
                  max_seq_len: int | None = None, require_cuda: bool = True) -> None:
    """Check every tensor argument against the build's static config; raises ArgumentError.

    `max_seq_len`: the program header's S_MAX. The kernel takes S_max from the cache's S
    dimension and finds the rope sin table at ROPE_OFF + S_max * D/2, where the program put it
    for S_MAX: a cache of any other length would read the wrong table (or past it), so it is
    refused here, before any CUDA call.
    """
    from megakernel.kernel.spec import PARAMS

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
    # the cache has a slot per attention layer (KernelSpec.kv_layers)
    L = len(spec.get("attn_layers") or ()) or spec["layers"]
    B = spec["batch"]
    if spec.get("paged"):
        check_pages(spec, tensors, L)
    for name, (Hkv, D) in kv_layout(spec).items() if not spec.get("paged") else ():
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
            and not spec.get("paged")):
        raise ArgumentError(f"k_cache {tuple(tensors['k_cache'].shape)} and v_cache "
                            f"{tuple(tensors['v_cache'].shape)} differ")
    if (max_seq_len is not None and not spec.get("paged")
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


def kv_layout(spec: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(heads, last dim) of k_cache and v_cache [L, B, heads, S_max, dim]: (Hkv, D) for both, or
    with MLA layers the latent cache (layers/mla.py): c (1, r) and k_rope (1, dr)."""
    if spec.get("mla"):
        _, r, _, dr, _ = spec["mla"]
        return {"k_cache": (1, r), "v_cache": (1, dr)}
    return {"k_cache": (spec["kv_heads"], spec["head_dim"]),
            "v_cache": (spec["kv_heads"], spec["head_dim"])}


def check_pages(spec: dict[str, Any], tensors: dict[str, torch.Tensor], slots: int) -> None:
    """A paged build's caches: K [slots, num_blocks, Hkv, D, block_size] and V [slots,
    num_blocks, Hkv, block_size, D] of the pool the build bakes in (kernel/paged_index.py)."""
    nb, bs = spec["paged"][0], spec["paged"][1]
    Hkv, D = spec["kv_heads"], spec["head_dim"]
    for name, want in (("k_cache", (slots, nb, Hkv, D, bs)), ("v_cache", (slots, nb, Hkv, bs, D))):
        if tuple(tensors[name].shape) != want:
            raise ArgumentError(f"{name} must be the paged build's pages {list(want)}, got shape "
                                f"{tuple(tensors[name].shape)}")


def check_header(header: dict[str, int], spec: dict[str, Any]) -> None:
    """The program header's constants a build bakes in (KernelSpec): the RMSNorm form, the RoPE
    dims, the output gate and its buffer's offset, the ReplaySSM window and ring capacity, the
    page pool of a paged build (and no pages for a contiguous one), the MoE shape and expert
    stride of a build with MoE layers; ArgumentError naming the first mismatch."""
    rotary = (spec.get("rotary") or spec["head_dim"]) if spec.get("rope", True) else 0
    gated = bool(spec.get("output_gate"))
    want = {"NORM_KIND": int(bool(spec.get("norm_one_plus"))), "ROTARY_DIM": rotary,
            "OUTPUT_GATE": int(gated)}
    if gated:
        want["F32_GATE_OFF"] = spec["gate_off"]
    window = spec.get("replay_window", 0)
    want["REPLAY_WINDOW"] = window
    if window:
        want["RING_CAP"] = window - 1 + spec["tokens"]  # KernelSpec.ring_cap
    if spec.get("paged"):
        from megakernel.kernel.paged_index import PagedShape

        want.update(PagedShape.of(tuple(spec["paged"]), spec["kv_heads"],
                                  spec["head_dim"]).header())
    else:
        want["PAGED"] = 0
    if spec.get("moe"):  # KernelSpec.moe (layers/moe.MoE.kernel_constants)
        from megakernel.kernel.moe_index import x_stride

        e, top_k, inter, n_group, topk_group, shared, norm, scale_bits = spec["moe"]
        want.update(MOE_E=e, MOE_TOPK=top_k, MOE_I=inter, MOE_N_GROUP=n_group,
                    MOE_TOPK_GROUP=topk_group, MOE_SHARED=shared, MOE_NORM=norm,
                    MOE_SCALE_F32_BITS=scale_bits, MOE_X_STRIDE=x_stride(inter, spec["hidden"]))
    for k, v in want.items():
        if header.get(k, 0) != v:
            raise ArgumentError(f"program header {k}={header.get(k)} but the kernel build has "
                                f"{v}: the program is for another model or build")


def check_records(records: torch.Tensor, spec: dict[str, Any]) -> None:
    """The alignment the kernel's 16-byte vector accesses assume, on every record (host, once).

    Weight slabs, bf16 inputs and embedding rows: offsets and K multiples of 8 elements; fp32
    inputs/outputs of 16-byte vectors: multiples of 4; partial o rows: whole heads. Also what the
    build bakes in as constants and the epilogues assume: each matvec's K and row range against
    the build's model shapes (a program compiled for another model is refused here), QKV slabs of
    whole heads, GATEUP slabs of whole (gate, up) block pairs, attention indices within B, Hkv.
    """
    from megakernel.isa import GATEUP_BLOCK, Op, decode
    from megakernel.layers import all_kinds
    from megakernel.layers.frame import padded_vocab

    if records.dtype != torch.int32 or records.dim() != 3:
        raise ArgumentError("records must be int32 [num_sms, queue_len, 16]")
    H, Inter, V, D = spec["hidden"], spec["inter"], spec["vocab"], spec["head_dim"]
    Hq, Hkv, B, N = spec["heads"], spec["kv_heads"], spec["batch"], spec["batch"] * spec["tokens"]
    slots = Hq // Hkv * (2 if spec.get("output_gate") else 1) + 2  # KernelSpec.qkv_slots
    # (K, matrix rows) of each matvec opcode's matrices in the build's model
    shapes = {Op.QKV: [(H, Hkv * slots * D)], Op.OPROJ: [(Hq * D, H)],
              Op.GATEUP: [(H, 2 * Inter)], Op.UP_RELU2: [(H, Inter)], Op.DOWN: [(Inter, H)],
              Op.LMHEAD: [(H, padded_vocab(V))]}
    gdn, mamba = recurrent_shape(spec, "gdn"), recurrent_shape(spec, "mamba")
    # the other kinds' matrices (recurrent input projections and out_proj, MLA, experts), as each
    # kind declares them from its constants (LayerKind.matvec_shapes)
    for kd in all_kinds().values():
        if kd.spec_field and spec.get(kd.spec_field):
            for name, mats in kd.matvec_shapes(tuple(spec[kd.spec_field]), H).items():
                shapes.setdefault(getattr(Op, name), []).extend(mats)
    handled = set(spec.get("ops") or (s.code for s in isa.specs() if s.device))
    for sm, queue in enumerate(records.tolist()):
        for pos, rec in enumerate(queue):
            if rec[0] == Op.END:
                break
            try:
                d = decode(rec)
            except ValueError as e:
                raise ArgumentError(f"SM {sm} record {pos}: {e}") from None
            op = d["OPCODE"]
            where = f"SM {sm} record {pos} ({op.name})"
            if op not in handled or (isa.spec(op).matvec and op not in shapes):
                raise ArgumentError(f"{where}: the kernel build has no handler for {op.name}; "
                                    "the program is for another model or build")
            need: dict[str, int] = {}
            if isa.spec(op).matvec is not None:
                need = {"W": 8, "K": 8, "IN_OFF": 8, "NROWS": 16}
                if d["NORM_OFF"] >= 0:
                    need["NORM_OFF"] = 8
                if not any(d["K"] == k and 0 <= d["ROW0"] and d["ROW0"] + d["NROWS"] <= rows
                           for k, rows in shapes[op]):
                    raise ArgumentError(
                        f"{where}: K={d['K']}, rows [{d['ROW0']}, {d['ROW0'] + d['NROWS']}) do "
                        f"not fit the build's {' or '.join(f'[{r}, {k}]' for k, r in shapes[op])}"
                        f" matrix; the program is for another model or build")
                if op == Op.PROJ and d["OUT_W"] not in (r for _, r in shapes[op]):
                    raise ArgumentError(f"{where}: OUT_W={d['OUT_W']} is not a projection "
                                        f"width of the build's recurrent layers "
                                        f"({', '.join(str(r) for _, r in shapes[op])})")
                if op == Op.QKV and (d["NROWS"] % D or d["ROW0"] % D):
                    raise ArgumentError(f"{where}: a QKV slab of {d['NROWS']} rows at row "
                                        f"{d['ROW0']} is not whole heads of {D}")
                if op in (Op.GATEUP, Op.EXPERT_GATEUP) and (
                        d["NROWS"] % (2 * GATEUP_BLOCK) or d["ROW0"] % (2 * GATEUP_BLOCK)):
                    raise ArgumentError(f"{where}: a GATEUP slab of {d['NROWS']} rows at row "
                                        f"{d['ROW0']} is not whole {GATEUP_BLOCK}-row gate/up "
                                        f"block pairs")
            elif op in (Op.GDN_CORE, Op.GDN_REPLAY):
                if not (0 <= d["B_IDX"] < B and 0 <= d["K_HEAD"] < gdn.hk and d["STATE"] >= 0):
                    raise ArgumentError(f"{where}: sequence {d['B_IDX']}, key head "
                                        f"{d['K_HEAD']}, state offset {d['STATE']} outside the "
                                        f"build's B={B}, Hk={gdn.hk}")
            elif op in (Op.MAMBA_CORE, Op.MAMBA_REPLAY):
                if not (0 <= d["B_IDX"] < B and 0 <= d["GROUP"] < mamba.groups
                        and d["STATE"] >= 0):
                    raise ArgumentError(f"{where}: sequence {d['B_IDX']}, group {d['GROUP']}, "
                                        f"state offset {d['STATE']} outside the build's B={B}, "
                                        f"G={mamba.groups}")
            elif op in (Op.MLA_Q, Op.MLA_O):
                if not 0 <= d["HEAD"] < spec["mla"][0]:
                    raise ArgumentError(f"{where}: head {d['HEAD']} outside the build's "
                                        f"H={spec['mla'][0]}")
            elif op == Op.MLA:
                if not (0 <= d["B_IDX"] < B and 0 <= d["SPLIT"] < d["N_SPLITS"]):
                    raise ArgumentError(f"{where}: sequence {d['B_IDX']}, split {d['SPLIT']}/"
                                        f"{d['N_SPLITS']} outside the build's B={B}")
            elif op == Op.EMBED:
                if d["K"] != H or not 0 <= d["N0"] <= d["N1"] <= N:
                    raise ArgumentError(f"{where}: rows [{d['N0']}, {d['N1']}) of K={d['K']} do "
                                        f"not fit the build's N={N}, H={H}")
                need = {"W": 8, "K": 8, "OUT_OFF": 4}
            elif op == Op.ATTN_PARTIAL:
                need = {"PO_OFF": 4}
                if not (0 <= d["B_IDX"] < B and 0 <= d["KV_HEAD"] < Hkv
                        and 0 <= d["SPLIT"] < d["N_SPLITS"]):
                    raise ArgumentError(f"{where}: sequence {d['B_IDX']}, kv head "
                                        f"{d['KV_HEAD']}, split {d['SPLIT']}/{d['N_SPLITS']} "
                                        f"outside the build's B={B}, Hkv={Hkv}")
            for k, m in need.items():
                if d[k] % m:
                    raise ArgumentError(f"SM {sm} record {pos} ({op.name}): {k}={d[k]} is not a "
                                        f"multiple of {m}; the kernel's vector accesses need it")


def recurrent_shape(spec: dict[str, Any], field: str):  # noqa: ANN201
    """A manifest spec's index arithmetic of a recurrent kind (`field` "gdn": GDNShape, "mamba":
    MambaShape; None when the build has no such layers)."""
    from megakernel.kernel.gdn_index import GDNShape
    from megakernel.kernel.mamba_index import MambaShape
    from megakernel.kernel.spec import LANES

    if not spec.get(field):
        return None
    cls = {"gdn": GDNShape, "mamba": MambaShape}[field]
    return cls.of(tuple(spec[field]), spec["batch"], spec["tokens"],
                  spec.get("num_threads", 256) // LANES)


def check_lengths(spec: dict[str, Any], lengths: list[int], s_max: int) -> None:
    """Host-side view of the cache: every sequence has room for this step's T tokens."""
    T, B = spec["tokens"], spec["batch"]
    if len(lengths) > B:
        raise ArgumentError(f"{len(lengths)} sequences but the kernel was built for batch {B}")
    for b, n in enumerate(lengths):
        if n < 0 or n + T > s_max:
            raise ArgumentError(f"sequence {b}: {n} cached + {T} new tokens exceed the cache "
                                f"length {s_max}")


# ---- the driver-API launcher --------------------------------------------------------------------
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 layout
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError:
            raise KernelUnavailable("cuda-python is not installed (pip install cuda-python)") \
                from None
    return driver


def _check(result, call: str, drv=None):  # noqa: ANN001 (cuda-python objects)
    """cuda-python returns (err, *values): raise naming `call` on error, return the values."""
    drv = drv or _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != int(drv.CUresult.CUDA_SUCCESS):
        _, msg = drv.cuGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise RuntimeError(f"{call} failed: CUDA driver error {int(err)}: {text}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


class LoadedKernel:
    """A cubin loaded into the current CUDA context, ready to launch on torch's streams.

    `driver` (default: cuda.bindings.driver) and `dev` (default: device_info(device)) are
    injectable so that the whole call sequence can be checked against a fake driver."""

    def __init__(self, manifest: Manifest, device: int | None = None, *, driver=None,  # noqa: ANN001
                 dev: DeviceInfo | None = None):
        self.manifest = manifest
        self.dev = dev or device_info(device)
        if self.dev.arch != manifest.arch:
            raise ManifestError(f"the build in {manifest.path} is for {manifest.arch}, but "
                                f"{self.dev.name} is {self.dev.arch}")
        self.drv = drv = driver or _driver()
        self.blocks_per_sm: int | None = None  # the driver's occupancy (first launch)
        torch.cuda.init()  # torch owns the primary context; the driver API uses it
        torch.cuda.current_stream()
        self._cubin = manifest.cubin_bytes()
        self.library = _check(drv.cuLibraryLoadData(self._cubin, None, None, 0, None, None, 0),
                              "cuLibraryLoadData", drv)
        self.kernel = _check(drv.cuLibraryGetKernel(self.library, manifest.symbol.encode()),
                             "cuLibraryGetKernel", drv)
        dev_idx = torch.cuda.current_device() if device is None else int(device)
        cu_dev = _check(drv.cuDeviceGet(dev_idx), "cuDeviceGet", drv)
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(drv.cuKernelSetAttribute(attr, manifest.smem, self.kernel, cu_dev),
               "cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", drv)

    def launch(self, num_ctas: int, tensors: dict[str, torch.Tensor], ints: dict[str, int],
               stream: int | None = None) -> None:
        """One step. Validation is the caller's (validate_args) - this only launches."""
        drv = self.drv
        check_device(self.manifest, self.dev, num_ctas)
        vals, keep = [], []
        for p in self.manifest.params:
            if p["kind"] == "ptr":
                v = ctypes.c_uint64(tensors[p["name"]].data_ptr())
            else:
                v = ctypes.c_int32(int(ints[p["name"]]))
            keep.append(v)
            vals.append(ctypes.addressof(v))
        argv = (ctypes.c_void_p * len(vals))(*vals)
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = num_ctas, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.manifest.block
        cfg.sharedMemBytes = self.manifest.smem
        # the tensors' device, not whichever device is current: its context and its stream
        dev = next(iter(tensors.values())).device  # validate_args: all on one device
        func = drv.CUfunction(int(self.kernel))  # the CUkernel, resolved in the current context
        with torch.cuda.device(dev):  # makes that device's primary context current
            if self.blocks_per_sm is None:  # the co-residency a cooperative launch needs
                self.blocks_per_sm = int(_check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    func, self.manifest.block[0], self.manifest.smem),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor", drv))
            check_device(self.manifest, self.dev, num_ctas, self.blocks_per_sm)
            s = torch.cuda.current_stream(dev).cuda_stream if stream is None else stream
            cfg.hStream = drv.CUstream(s)
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attr.value.cooperative = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            _check(drv.cuLaunchKernelEx(cfg, func, ctypes.addressof(argv), 0),
                   "cuLaunchKernelEx", drv)
        del keep

    def __del__(self):
        lib = getattr(self, "library", None)
        if lib is not None:
            try:
                self.drv.cuLibraryUnload(lib)
            except Exception:  # interpreter shutdown: the context may be gone already
                pass
