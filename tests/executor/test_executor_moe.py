"""The MoE's run-time routing on the CPU executor (kimi-linear-tiny: 8 experts, top 3 in the best
2 of 4 groups, one shared expert): the router logits scored by experts over the SMs, the work
list the router writes, the expert records bound to
its slots, router ties, and experts no row picks (their weights are never read).

Each step is compared with the bf16 reference (logits bit-identical, tokens equal, as in
test_executor_mixed.py); the weights read are the executor's own count (`Executor.slab_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import megakernel.reference.layers.moe as ref_moe
from megakernel.executor import Executor
from megakernel.layers.moe import work_list
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from megakernel.program.pack import pack_weights
from megakernel.reference.model import ReferenceModel

NAME = "kimi-linear-tiny"
STEPS = 2


def _expert_bytes(cfg) -> int:  # noqa: ANN001
    """bf16 bytes of one expert's gate/up and down."""
    return 2 * 3 * cfg.moe.intermediate_size * cfg.hidden_size


@dataclass
class Step:
    """What one executor step left: the expert bytes it read, the last MoE layer's expert ids,
    weights and work list, and the reference's expert ids of every MoE layer."""

    expert_bytes: int
    ids: torch.Tensor
    wts: torch.Tensor
    work: torch.Tensor
    ref_ids: list[torch.Tensor]
    rows: int


def _run(w: dict[str, torch.Tensor], batch: int, tokens: int, seed: int, monkeypatch
         ) -> list[Step]:
    """STEPS steps of executor and bf16 reference from the same prefill; asserts equal logits
    and tokens."""
    cfg = preset(NAME)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    route = ref_moe.route
    monkeypatch.setattr(ref_moe, "route", lambda *a: seen.append(route(*a)) or seen[-1])
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 6, (batch,), generator=g).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    s_max = max(lens) + STEPS * tokens
    ref = ReferenceModel(cfg, w, mode="bf16")
    cache = ref.new_cache(batch, s_max, max_step_tokens=tokens)
    ref.prefill(cache, prompts)
    prog = compile_program(cfg, batch, gpu("h100").with_sms(8), tokens=tokens, max_seq_len=s_max)
    ex = Executor(prog, pack_weights(cfg, w))
    ex.load_cache(cache)
    out, n_moe = [], sum(1 for blk in cfg.blocks if blk.kind == "moe")
    for step in range(STEPS):
        toks = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=g)
        seen.clear()
        logits = ref.decode(cache, toks)  # [B, T, V]; the last n_moe routings are this step's
        mine = ex.step(toks, seed=step)
        assert torch.equal(ex.logits.view_as(logits), logits.float()), step
        assert torch.equal(mine, logits.argmax(-1)), step
        out.append(Step(ex.slab_bytes["expert"], ex.region("i32", "moe_ids").long(),
                        ex.region("f32", "moe_w").clone(), ex.region("i32", "moe_work").clone(),
                        [ids for _, ids in seen[-n_moe:]], prog.rows))
    return out


SHAPES = [(1, 1), (1, 4), (4, 1), (4, 4), (2, 1)]  # (B, T)


@pytest.mark.parametrize(("batch", "tokens"), SHAPES)
def test_unpicked_experts_are_never_read(batch: int, tokens: int, monkeypatch) -> None:
    """Random routing with fewer picks than experts: the executor reads exactly the experts the
    rows picked (the reference's, layer by layer) and the shared expert, and the last layer's
    work list is the one its expert ids define."""
    cfg = preset(NAME)
    w = random_weights(cfg, seed=7)
    e, unpicked = cfg.moe, 0
    for st in _run(w, batch, tokens, seed=4, monkeypatch=monkeypatch):
        distinct = [len(torch.unique(i)) for i in st.ref_ids]
        unpicked += sum(e.num_experts - d for d in distinct)
        assert st.expert_bytes == (sum(distinct) + len(distinct)) * _expert_bytes(cfg)
        assert torch.equal(st.ids, st.ref_ids[-1])
        assert torch.equal(st.work, work_list(st.ids, e.num_experts))
    if batch * tokens < 16:  # 16 rows of top 3 of 8 experts pick them all
        assert unpicked > 0  # some experts went unpicked: the case this test is about


@pytest.mark.parametrize(("batch", "tokens"), SHAPES[:4])
def test_router_ties_go_to_the_lower_expert(batch: int, tokens: int, monkeypatch) -> None:
    """Every expert's router row and bias equal: all experts tie for every row, in every group.
    The router keeps the lower groups and the lower experts (0 .. top_k - 1), equally weighted;
    the executor agrees with the reference, and reads those experts only."""
    cfg = preset(NAME)
    e = cfg.moe
    w = random_weights(cfg, seed=8)
    for blk in cfg.blocks:
        if blk.kind == "moe":
            p = blk.prefix + "gate."
            w[p + "weight"] = w[p + "weight"][:1].expand_as(w[p + "weight"]).clone()
            w[p + "e_score_correction_bias"] = w[p + "e_score_correction_bias"][:1].expand(
                e.num_experts).clone()
    for st in _run(w, batch, tokens, seed=6, monkeypatch=monkeypatch):
        for i in st.ref_ids + [st.ids]:
            assert i.tolist() == [list(range(e.top_k))] * st.rows
        want = torch.full_like(st.wts, e.routed_scaling_factor / e.top_k)
        assert torch.allclose(st.wts, want, rtol=1e-6, atol=0)
        assert st.expert_bytes == len(st.ref_ids) * (e.top_k + 1) * _expert_bytes(cfg)
        assert st.work[: e.top_k, :2].tolist() == [[x, st.rows] for x in range(e.top_k)]
        assert bool((st.work[e.top_k :, 0] == -1).all())
