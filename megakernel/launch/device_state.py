"""A program's kernel arguments on one device (`DeviceState`, made by `allocate_state`: records,
counters, packed weights, arenas, KV cache, recurrent state) and the build that serves a model
(`find_build`: a build directory, $MEGAKERNEL_BUILD_DIR or the JIT cache). The op
(torch_op.decode_step) takes `DeviceState.tensors()` in `TENSORS` order; the speculative op
(torch_op.speculative_step) the same tensors with `spec_offsets`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megakernel.launch.checks import ArgumentError
from megakernel.launch.runtime import Manifest, load_manifest
from megakernel.models import ModelConfig

ENV_BUILD_DIR = "MEGAKERNEL_BUILD_DIR"


def find_build(cfg: ModelConfig, batch: int, tokens: int, arch: str,
               build_dir: str | Path | None, replay_window: int = 0,
               paged=None, drafts: int = 0,  # noqa: ANN001 (program.paged.PagedKV | None)
               ngram: int = 0) -> Manifest:
    """The manifest to launch: `build_dir` / $MEGAKERNEL_BUILD_DIR (AOT; a single build
    DIR/<arch>/ or a build set DIR/<spec tag>/<arch>/) or the JIT cache (`replay_window`: for
    programs with that ReplaySSM window, 0 = the recurrent update; `paged`: the paged-KV build
    for this page pool; `drafts`, `ngram`: the speculative step's build, layers/speculative.py)."""
    from megakernel.kernel.config.model_spec import make_spec

    # SpecError names what the kernel cannot run
    need = make_spec(cfg, batch, tokens, arch, replay_window=replay_window, paged=paged,
                     drafts=drafts, ngram=ngram)
    build_dir = build_dir or os.environ.get(ENV_BUILD_DIR)
    if build_dir is None:
        from megakernel.kernel.toolchain.jit import ensure_build

        build_dir = ensure_build(cfg, batch, tokens, arch, replay_window=replay_window,
                                 drafts=drafts, ngram=ngram)
    build_dir = Path(build_dir)
    if not (build_dir / arch / "manifest.json").is_file():  # a build set: DIR/<tag>/<arch>/
        tagged = build_dir / need.tag
        if (tagged / arch / "manifest.json").is_file():
            build_dir = tagged
    m = load_manifest(build_dir, arch)
    s = m.spec
    # everything the build bakes in as a constant (eps included: a checkpoint whose
    # rms_norm_eps differs from the build's would otherwise run with the wrong one)
    want = {k: v for k, v in need.to_dict().items()
            if k not in ("arch", "num_threads", "smem_stages", "timeline", "l2_window")}
    # (a field newer than the build's manifest has its default there)
    from dataclasses import fields

    from megakernel.kernel.config.spec import KernelSpec

    default = {f.name: f.default for f in fields(KernelSpec)}
    bad = {k: (s.get(k, default[k]), v) for k, v in want.items() if s.get(k, default[k]) != v}
    if bad:
        raise ArgumentError(
            f"the build in {m.path} does not serve this model/batch: "
            + ", ".join(f"{k} built {b} vs needed {n}" for k, (b, n) in bad.items())
            + f"; rebuild with `python -m megakernel build --batch {batch} --tokens {tokens}`")
    return m


TENSORS = ("program", "counters", "weights", "f32", "bf16", "i32", "k_cache", "v_cache",
           "state")


@dataclass
class DeviceState:
    """The kernel's arguments for one program: records, counters, arenas, KV cache, recurrent
    state."""

    prog: object  # megakernel.program.compiler.Program
    program: torch.Tensor
    counters: torch.Tensor
    weights: torch.Tensor
    f32: torch.Tensor
    bf16: torch.Tensor
    i32: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    state: torch.Tensor  # fp32 [buffers.state_numel]: conv windows, states, rings (persistent)
    offsets: list[int]  # [lengths_off, tokens_out_off, logits_off, S_MAX] for decode_step
    packed: object = None  # megakernel.program.pack.PackedWeights (`weights` is its arena)
    # a speculative program's (drafts k): `offsets` + [tokens_in_off, emitted_off] (i32) for
    # torch_op.speculative_step; None for a plain program
    spec_offsets: list[int] | None = None

    def region(self, arena: str, name: str) -> torch.Tensor:
        r = getattr(self.prog.buffers, arena)[name]
        return getattr(self, arena)[r.offset: r.offset + r.numel]

    def state_region(self, layer: int, name: str) -> torch.Tensor:
        return self.prog.buffers.state_view(self.state, layer, name)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in TENSORS}

    def load_cache(self, cache) -> None:  # noqa: ANN001 (reference.model.Cache)
        """Copy a reference cache (bf16 mode) into the KV cache, the recurrent state arena (conv
        windows, states, rings, ring counts) and the lengths: what the first kernel step reads
        after a prefill by the reference."""
        from megakernel.executor.core import ExecutorError, load_cache

        try:
            load_cache(self.prog, cache, k=self.k_cache, v=self.v_cache, state=self.state,
                       i32=self.i32)
        except (ExecutorError, RuntimeError) as e:  # a cache of another shape than the program's
            raise ArgumentError(f"the reference cache does not fit the kernel's arguments: {e}"
                                ) from None


def allocate_state(cfg: ModelConfig, weights: dict[str, torch.Tensor] | None, prog,  # noqa: ANN001
                   device: str | torch.device, packed=None,  # noqa: ANN001
                   caches: tuple[torch.Tensor, torch.Tensor] | None = None) -> DeviceState:
    """Pack the weights (or take `packed`, packed once for several programs) and allocate every
    buffer of `prog` on `device` (CPU works too: the layout is checked there); `caches`: K and V
    shared with other programs of one cache layout (paged buckets). Counters start at zero and
    are never reset (epochs)."""
    from megakernel.layers import kind
    from megakernel.program.pack import pack_weights

    buf, hdr, d = prog.buffers, prog.header, torch.device(device)
    packed = packed if packed is not None else pack_weights(cfg, weights, device=d)
    k_cache, v_cache = caches if caches is not None else (
        torch.zeros(buf.kv_shape, dtype=torch.bfloat16, device=d),
        torch.zeros(buf.v_shape, dtype=torch.bfloat16, device=d))
    st = DeviceState(
        prog=prog,
        program=prog.records().to(d),
        counters=torch.zeros(prog.counter_words(), dtype=torch.int32, device=d),
        weights=packed.arena.to(d),
        f32=torch.zeros(buf.f32_numel, dtype=torch.float32, device=d),
        bf16=torch.zeros(buf.bf16_numel, dtype=torch.bfloat16, device=d),
        i32=torch.zeros(buf.i32_numel, dtype=torch.int32, device=d),
        k_cache=k_cache, v_cache=v_cache,
        state=torch.zeros(buf.state_numel, dtype=torch.float32, device=d),
        offsets=[hdr["I32_LENGTHS_OFF"], hdr["I32_TOKENS_OUT_OFF"], hdr["F32_LOGITS_OFF"],
                 hdr["S_MAX"]],
        packed=packed,
    )
    if getattr(prog, "drafts", 0):
        st.spec_offsets = [*st.offsets, buf.i32["tokens_in"].offset, buf.i32["emitted"].offset]
    for blk in cfg.blocks:  # host-written constants (RoPE tables, ...) and checkpoint tables
        for name, t in kind(blk.kind).constants(blk, cfg, prog.step_shape()).items():
            st.region("f32", name).copy_(t.reshape(-1))
    for (name, layer), t in packed.tables.items():
        r = buf.f32[name]
        row = buf.region_row(name, layer) * (r.numel // r.shape[0])
        st.region("f32", name)[row : row + t.numel()].copy_(t)
    return st
