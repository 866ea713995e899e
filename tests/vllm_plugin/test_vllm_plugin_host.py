"""The plugin's host side without vLLM (the fast lane; make test-vllm serves a model through
stock vLLM): the weights read back from vLLM-style fused parameters, the batch buckets, the
architectures it registers."""

from __future__ import annotations

import pytest
import torch

from megakernel.models import preset
from megakernel.models.registry import load_all
from megakernel.models.weights import random_weights
from megakernel.vllm_plugin import ARCHITECTURES
from megakernel.vllm_plugin.decode import bucket_of
from megakernel.vllm_plugin.weights import hf_weights

VOCAB_PAD = 64  # vLLM pads its embedding and LM head rows


def vllm_style(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are named and fused as vLLM's Llama: qkv_proj = [q | k | v],
    gate_up_proj = [gate | up], the embedding padded with rows of garbage."""
    params: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if ".q_proj." in name:
            fused = torch.cat([t, weights[name.replace("q_proj", "k_proj")],
                               weights[name.replace("q_proj", "v_proj")]])
            params[name.replace("q_proj", "qkv_proj")] = fused
        elif ".gate_proj." in name:
            params[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [t, weights[name.replace("gate_proj", "up_proj")]])
        elif ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        elif name.endswith("embed_tokens.weight"):
            params[name] = torch.cat([t, torch.full((VOCAB_PAD, t.shape[1]), 7.0,
                                                    dtype=t.dtype)])
        else:
            params[name] = t
    return module_of(params)


def module_of(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose named_parameters are `params` (dotted names become submodules)."""
    m = torch.nn.Module()
    for name, t in params.items():
        parent = m
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return m


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_weights_come_back_from_vllms_fused_parameters(name: str) -> None:
    cfg = preset(name)
    want = random_weights(cfg, seed=3)
    got = hf_weights(cfg, vllm_style(want))
    assert got.keys() == want.keys()
    for n, t in want.items():
        assert torch.equal(got[n], t), n


def test_a_missing_tensor_is_named() -> None:
    cfg = preset("llama-tiny")
    want = random_weights(cfg, seed=3)
    del want["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        hf_weights(cfg, vllm_style(want))


def test_buckets_are_the_powers_of_two_that_hold_the_batch() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_every_architecture_serves_a_registered_family() -> None:
    archs = {a for f in load_all().values() for a in f.architectures}
    assert set(ARCHITECTURES.values()) <= archs
    assert all(ours == f"Megakernel{stock}" for ours, stock in ARCHITECTURES.items())


# A speculative verify step as vLLM-CPU lays it out (ngram drafting, k = 3): per sequence the
# last sampled token and its drafts, at consecutive positions after the cached ones; the query
# lengths are ragged (a sequence whose ngram found fewer drafts, or none, brings fewer tokens).
VERIFY_CACHED = (6, 9, 3, 5)  # tokens in the cache before the step
VERIFY_QUERY = (4, 1, 4, 3)  # tokens each sequence brings: 1 + its drafts
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 24, 4
LOGIT_TOL = 0.01  # |verify - token by token| per logit: measured <= 7.3e-4 (fp32 sum order)


def _vllm_caches(cfg) -> list[torch.Tensor]:  # noqa: ANN001
    """One vLLM-CPU cache [num_blocks, Hkv, block_size, 2 D] per attention layer, random."""
    attn = cfg.kind_config("attention")
    g = torch.Generator().manual_seed(7)
    shape = (NUM_BLOCKS, attn.num_kv_heads, BLOCK_SIZE, 2 * attn.head_dim)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(cfg.num_layers)]


def _slots(table: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """vLLM's slot mapping of one sequence's positions through its block table row."""
    return torch.tensor([int(table[j // BLOCK_SIZE]) * BLOCK_SIZE + j % BLOCK_SIZE
                         for j in positions])


def _one_by_one(dec, tokens: list[list[int]], table: torch.Tensor, upto: list[int],  # noqa: ANN001
                start: list[int], caches: list[torch.Tensor]
                ) -> dict[tuple[int, int], torch.Tensor]:
    """Single-token steps (the plugin's decode path) over positions start[b] .. upto[b] - 1 of
    every sequence, the sequences still going batched together: {(b, position): logits}."""
    out = {}
    for j in range(min(start), max(upto)):
        live = [b for b in range(len(tokens)) if start[b] <= j < upto[b]]
        logits = dec.step(torch.tensor([tokens[b][j] for b in live]),
                          torch.tensor([j + 1] * len(live)), table[live],
                          torch.cat([_slots(table[b], [j]) for b in live]), caches)
        out.update({(b, j): logits[i] for i, b in enumerate(live)})
    return out


def test_a_ragged_verify_step_matches_single_token_steps() -> None:
    """The plugin's verify path (sequences grouped by query length, one program of (bucket, T)
    per group) gives every row of the step the logits that single-token steps give the same
    tokens, and writes the same K/V pages (untouched elsewhere)."""
    from megakernel.program.pack import pack_weights
    from megakernel.program.paged import PagedKV
    from megakernel.vllm_plugin.decode import PagedDecoder

    cfg = preset("llama-tiny")
    dec = PagedDecoder(cfg, pack_weights(cfg, random_weights(cfg, seed=5)),
                       PagedKV(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS))
    g = torch.Generator().manual_seed(3)
    n = len(VERIFY_CACHED)
    table = torch.randperm(NUM_BLOCKS, generator=g)[: n * MAX_BLOCKS].view(n, MAX_BLOCKS)
    total = [c + q for c, q in zip(VERIFY_CACHED, VERIFY_QUERY, strict=True)]
    tokens = [torch.randint(0, cfg.vocab_size, (t,), generator=g).tolist() for t in total]
    caches = _vllm_caches(cfg)
    _one_by_one(dec, tokens, table, list(VERIFY_CACHED), [0] * n, caches)  # the cached part
    before = [c.clone() for c in caches]
    want = _one_by_one(dec, tokens, table, total, list(VERIFY_CACHED), caches)

    rows = [(b, j) for b in range(n) for j in range(VERIFY_CACHED[b], total[b])]
    got = dec.step(torch.tensor([tokens[b][j] for b, j in rows]), torch.tensor(total), table,
                   torch.cat([_slots(table[b], [j]) for b, j in rows]), before,
                   torch.tensor(VERIFY_QUERY))
    assert dec.verify_steps == 1
    assert dec.verify_stats == {(1, 1): 1, (2, 4): 1, (1, 3): 1}
    for i, key in enumerate(rows):
        diff = (got[i] - want[key]).abs().max().item()
        assert diff <= LOGIT_TOL, f"sequence {key[0]} position {key[1]}: logits differ by {diff}"
        assert int(got[i].argmax()) == int(want[key].argmax()), key
    for mine, theirs in zip(before, caches, strict=True):  # the same pages, bit for bit
        assert torch.equal(mine, theirs)


# A hybrid model's decode steps (docs/VLLM.md, "Hybrid models"): the recurrent layers' state
# lives in the caller's slots, one per request, which the decoder stages into the program's rows
# and back. Sequences sit in scattered slots, per layer others (vLLM: per KV cache group), among
# slots of other requests (random, never read or written by this step), in a bucket with a
# padding row.
HYBRID_SLOTS = (5, 1, 3)  # the state slots of the sequences (rotated from layer to layer)
NUM_STATE_SLOTS, HYBRID_STEPS = 7, 7


def _state_slots(dec):  # noqa: ANN001, ANN202
    """Random slots [NUM_STATE_SLOTS, ...] per recurrent layer and state region, in the layout
    of the decoder's bucket-4 program; the sequences' own slots zeroed (a new request)."""
    from megakernel.vllm_plugin.decode import StateSlots

    st = dec._state(4)
    g = torch.Generator().manual_seed(13)
    layers, index = {}, {}
    for i, (layer, regions) in enumerate(st.prog.buffers.state.items()):
        index[layer] = torch.tensor(HYBRID_SLOTS).roll(i)  # each layer its own slots (vLLM)
        layers[layer] = {}
        for name in regions:
            t = torch.randn(NUM_STATE_SLOTS, *st.state_region(layer, name).shape[1:],
                            generator=g)
            t[index[layer]] = 0
            layers[layer][name] = t
    return StateSlots(layers, index)


@pytest.mark.parametrize("name", ["nemotron-h-tiny", "qwen3.5-tiny"])
def test_hybrid_decode_steps_keep_the_state_in_the_callers_slots(name: str) -> None:
    """Three sequences decoded token by token from empty slots give, at every step, exactly
    the logits of the contiguous program of the same batch run on its own state (the state
    carried in the caller's slots from one step to the next, only the addressing differs; the
    contiguous program against the reference: tests/executor/test_executor_paged.py), and no
    other slot changes."""
    from megakernel.executor import Executor, executor_gpu
    from megakernel.program.compiler import compile_program
    from megakernel.program.pack import pack_weights
    from megakernel.program.paged import PagedKV
    from megakernel.vllm_plugin.decode import PagedDecoder

    cfg = preset(name)
    packed = pack_weights(cfg, random_weights(cfg, seed=5))
    paged = PagedKV(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS)
    dec = PagedDecoder(cfg, packed, paged)
    flat = Executor(compile_program(cfg, 4, executor_gpu(), max_seq_len=paged.max_seq_len),
                    packed)
    n = len(HYBRID_SLOTS)
    g = torch.Generator().manual_seed(3)
    table = torch.randperm(NUM_BLOCKS, generator=g)[: n * MAX_BLOCKS].view(n, MAX_BLOCKS)
    tokens = torch.randint(0, cfg.vocab_size, (4, HYBRID_STEPS), generator=g)
    states = _state_slots(dec)
    caches = _vllm_caches(cfg)[: len(dec._state(4).prog.buffers.kv_slot)]
    others = [s for s in range(NUM_STATE_SLOTS) if s not in HYBRID_SLOTS]
    before = {k: {r: t[others].clone() for r, t in v.items()} for k, v in states.layers.items()}
    assert len({tuple(i.tolist()) for i in states.index.values()}) > 1
    for j in range(HYBRID_STEPS):
        got = dec.step(tokens[:n, j], torch.full((n,), j + 1), table,
                       torch.cat([_slots(table[b], [j]) for b in range(n)]), caches,
                       states=states)
        flat.step(tokens[:, j : j + 1], seed=j)
        assert torch.equal(got, flat.logits.view(4, -1)[:n]), f"step {j}"
    assert dec.stats == {4: HYBRID_STEPS}
    for layer, regions in states.layers.items():
        for r, t in regions.items():
            assert torch.equal(t[others], before[layer][r]), f"layer {layer} {r}: another slot"


def test_a_hybrid_step_the_decoder_cannot_stage_is_refused_by_name() -> None:
    """No state slots, slots for other layers or of another shape, or a step of two tokens for
    a sequence (its recurrent layers would commit both): a ValueError naming it, before any
    program runs."""
    from dataclasses import replace

    from megakernel.program.pack import pack_weights
    from megakernel.program.paged import PagedKV
    from megakernel.vllm_plugin.decode import PagedDecoder

    cfg = preset("nemotron-h-tiny")
    dec = PagedDecoder(cfg, pack_weights(cfg, random_weights(cfg, seed=5)),
                       PagedKV(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS))
    states = _state_slots(dec)
    n = len(HYBRID_SLOTS)
    table = torch.arange(n * MAX_BLOCKS).view(n, MAX_BLOCKS)
    caches = _vllm_caches(cfg)[: len(dec._state(4).prog.buffers.kv_slot)]
    first = min(states.layers)
    squeezed = {k: {r: t[:, :1] for r, t in v.items()} for k, v in states.layers.items()}
    step = dict(input_ids=torch.zeros(n, dtype=torch.long),
                seq_lens=torch.ones(n, dtype=torch.long), block_table=table,
                slot_mapping=table[:, 0] * BLOCK_SIZE, layer_caches=caches)
    for bad, match in (
            (dict(), "need the caller's state slots"),
            (dict(states=replace(states, layers={first: states.layers[first]})),
             "state slots for layers"),
            (dict(states=replace(states, layers=squeezed)), "state slots of shape"),
            (dict(states=states, query_lens=torch.tensor([2, 1, 1]),
                  input_ids=torch.zeros(n + 1, dtype=torch.long),
                  slot_mapping=torch.arange(n + 1)), "one token per sequence")):
        with pytest.raises(ValueError, match=match):
            dec.step(**dict(step, **bad))
    assert dec.stats == {}
