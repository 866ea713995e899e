"""The paged build inside a gpu-check case: the same model, batch and steps run a second time on
the paged program (program/paged.py) and its build (KernelSpec.paged), next to the contiguous
kernel, from the same prefill, with the same tokens.

The reference's prefill cache is scattered into pages in a shuffled block order over random
pages (not zeros: a read through a wrong block finds other numbers). The last sequence is
padding (slot -1, length 0) when B > 1. Per step the host writes input ids, lengths, the block
table and the slot mapping (as vLLM does); the program neither advances lengths nor feeds tokens
back. Checked: the live rows' logits equal the contiguous kernel's up to shared-rounding flips
(the same split count: only the addressing differs) and are within the band of the references,
the greedy tokens are the logits' own; the padding rows' logits are finite; after the steps no
page outside the block table's live rows was written.
"""

from __future__ import annotations

from typing import Any

import torch

from megakernel.gpu_check import compare


class PagedRun:
    def __init__(self, c, mk, cache16_cpu, build_dir, simulate: bool,  # noqa: ANN001
                 emulate: bool = False) -> None:
        from megakernel.launch.device_state import allocate_state
        from megakernel.launch.torch_op import register_program
        from megakernel.program.compiler import compile_program
        from megakernel.program.paged import load_pages

        self.pool, self.mk, self.c = c.pool(), mk, c
        self.live = c.batch - 1 if c.batch > 1 else c.batch  # the last sequence: padding
        self.prog = compile_program(mk.cfg, c.batch, mk.prog.gpu, tokens=c.tokens,
                                    n_splits=mk.prog.n_splits, paged=self.pool)
        self.st = allocate_state(mk.cfg, None, self.prog, mk.device, packed=mk.args.packed)
        if simulate and not emulate:
            self.kernel = register_program(self.prog, mk.args.packed)
        else:
            self.kernel = _register_build(mk, self.prog, c, build_dir, self.pool, emulate)
        g = torch.Generator().manual_seed(c.batch * 131 + c.tokens)
        nb, mb = self.pool.num_blocks, self.pool.max_blocks
        self.table = torch.randperm(nb, generator=g)[: c.batch * mb].view(c.batch, mb)
        k, v = (torch.randn(t.shape, generator=g).to(torch.bfloat16)
                for t in (self.st.k_cache, self.st.v_cache))
        load_pages(k, v, self.prog.buffers.kv_slot, cache16_cpu, self.table[: self.live],
                   self.pool.block_size)
        self.st.k_cache.copy_(k)
        self.st.v_cache.copy_(v)
        self.initial = (k, v)  # what the pages no live sequence owns must still hold
        self.res: dict[str, Any] = dict(paged_max_logit_diff=0.0, paged_logit_over=0,
                                        paged_identical=True, paged_band_failures=0,
                                        paged_token_mismatches=0, paged_pad_finite=True)

    def step(self, tok: torch.Tensor, lengths: list[int], logits: torch.Tensor,
             l16: torch.Tensor, l32: torch.Tensor) -> None:
        """One paged step with the contiguous step's tokens [B, T] and lengths before it;
        `logits` [N, V] the contiguous kernel's, l16 / l32 the references'."""
        from megakernel.program.paged import slots_of, write_step_meta

        c, st, r = self.c, self.st, self.res
        lens = torch.tensor(lengths, dtype=torch.int64)
        lens[self.live:] = 0
        slots = slots_of(self.table, lens, c.tokens, self.pool.block_size, self.live)
        write_step_meta(st.i32, self.prog.buffers, tok.cpu(), lens, self.table, slots)
        out_tok, mine = torch.ops.megakernel.decode_step(*st.tensors().values(), self.kernel,
                                                         st.offsets, True)
        rows = self.live * c.tokens
        mine = mine.view(c.batch * c.tokens, -1)
        s = compare.same_program(mine[:rows], logits[:rows])
        r["paged_max_logit_diff"] = max(r["paged_max_logit_diff"], s["max_diff"])
        r["paged_logit_over"] += s["over"]
        r["paged_identical"] &= bool(torch.equal(mine[:rows], logits[:rows]))
        v = compare.step_verdict(mine[:rows], out_tok.view(-1)[:rows], l16[:rows], l32[:rows])
        r["paged_band_failures"] += not (v["band"]["ok"] and v["written"])
        r["paged_token_mismatches"] += v["greedy"]["clear"] + v["greedy"]["not_own_argmax"]
        r["paged_pad_finite"] &= bool(torch.isfinite(mine[rows:]).all())
        if bool((st.i32[self.prog.buffers.i32["lengths"].offset:][: c.batch].cpu()
                 != lens.to(torch.int32)).any()):
            r["paged_lengths_moved"] = True

    def verdict(self) -> dict[str, Any]:
        """The counters, and whether every page outside the live rows' blocks is untouched."""
        owned = torch.zeros(self.pool.num_blocks, dtype=torch.bool)
        owned[self.table[: self.live].flatten()] = True
        stray = [not torch.equal(t.cpu()[:, ~owned], t0[:, ~owned])
                 for t, t0 in zip((self.st.k_cache, self.st.v_cache), self.initial, strict=True)]
        r = dict(self.res, paged_pages_untouched=not any(stray))
        r["paged_ok"] = (r["paged_logit_over"] == 0 and r["paged_band_failures"] == 0
                         and r["paged_token_mismatches"] == 0 and r["paged_pad_finite"]
                         and r["paged_pages_untouched"] and not r.get("paged_lengths_moved"))
        return r


def _register_build(mk, prog, c, build_dir, pool, emulate: bool = False) -> int:  # noqa: ANN001
    """The paged build of the case (prepared next to the contiguous one, of the contiguous
    kernel's arch), checked against the paged program; `emulate`: on the emulator."""
    from megakernel.launch.checks import check_header, check_records
    from megakernel.launch.device_state import find_build
    from megakernel.launch.torch_op import register_build

    m = find_build(mk.cfg, c.batch, c.tokens, mk.manifest.arch, build_dir, paged=pool)
    check_records(prog.records(), m.spec)
    check_header(prog.header, m.spec)
    return register_build(m, emulate)
