"""The vLLM plugin on the CPU (make test-vllm; skipped where vllm does not import): a tiny
random checkpoint served by stock vLLM and by the plugin, ragged prompts with different
max_tokens so that the decode batch shrinks through the buckets 8, 4, 2, 1.

Greedy tokens must be equal, except from a step where stock vLLM's own top-2 logprob margin is
below NEAR_TIE (a near-tie that bf16 rounding can flip; the rest of that sequence is then not
compared). Up to there both engines are fed the same tokens (teacher-forced), and the chosen
token's logprob must agree within LOGPROB_TOL: vLLM's bf16 model and the program round at
different points, so they differ by the bf16 band, not bit for bit. The megakernel path must
have served decode steps, in exactly the buckets the shrinking batch passes through.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: read its stats
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402

from megakernel.models import preset  # noqa: E402
from megakernel.models.weights import random_weights, save_checkpoint  # noqa: E402
from megakernel.vllm_plugin.decode import bucket_of  # noqa: E402

PROMPT_LENS = (3, 9, 5, 12, 7)
MAX_TOKENS = (2, 4, 6, 8, 10)  # the batch shrinks 5 -> 4 -> 3 -> 2 -> 1
NEAR_TIE = 0.05  # nats between stock vLLM's top-2 logprobs
LOGPROB_TOL = 0.08  # |plugin - stock| logprob of one token, one prefix: measured 0.025-0.042
ARCHS = {"llama-tiny": "MegakernelLlamaForCausalLM", "qwen3-tiny": "MegakernelQwen3ForCausalLM",
         "qwen2-tiny": "MegakernelQwen2ForCausalLM"}


def _vec_isa(*args, **kw) -> str:  # noqa: ANN002, ANN003
    """vLLM-CPU's attention ISA with "amx" replaced by "vec": on a CPU with AMX tiles vLLM picks
    its AMX page layout, which the plugin does not read (its decode steps then stay on vLLM's
    model, with a warning); both engines of the comparison are served with the vec layout."""
    isa = _ATTN_ISA(*args, **kw)
    return "vec" if isa == "amx" else isa


_ATTN_ISA = cpu_attn._get_attn_isa


def _serve(path: str, prompts: list[list[int]], arch: str | None):  # noqa: ANN202
    kw = {"hf_overrides": {"architectures": [arch]}} if arch else {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_attn, "_get_attn_isa", _vec_isa)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                  max_model_len=256, block_size=32, num_gpu_blocks_override=32, max_logprobs=2,
                  seed=0, **kw)
    params = [SamplingParams(temperature=0, max_tokens=m, logprobs=2, ignore_eos=True,
                             detokenize=False) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.apply_model(lambda m: m.megakernel_stats())[0] if arch else None
    del llm
    return [o.outputs[0] for o in outs], stats


@pytest.mark.parametrize("name", list(ARCHS))
def test_plugin_matches_stock_vllm(name: str, tmp_path) -> None:
    cfg = preset(name)
    save_checkpoint(cfg, random_weights(cfg, seed=5), tmp_path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENS]
    stock, _ = _serve(str(tmp_path), prompts, None)
    mine, stats = _serve(str(tmp_path), prompts, ARCHS[name])

    # decode steps (the first token is the prefill's, on vLLM's model in both): one per batch
    sizes = [sum(m > s for m in MAX_TOKENS) for s in range(1, max(MAX_TOKENS))]
    want: dict[int, int] = {}
    for n in sizes:
        want[bucket_of(n)] = want.get(bucket_of(n), 0) + 1
    assert stats == want, f"megakernel decode steps per bucket {stats}, expected {want}"

    worst, flips = 0.0, 0
    for s, (a, b) in enumerate(zip(stock, mine, strict=True)):
        assert len(b.token_ids) == MAX_TOKENS[s]
        for t, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            top = sorted((lp.logprob for lp in a.logprobs[t].values()), reverse=True)
            if ta != tb:
                assert top[0] - top[1] < NEAR_TIE, (
                    f"sequence {s} step {t}: plugin {tb} != stock {ta}, margin "
                    f"{top[0] - top[1]:.3g}")
                flips += 1
                break
            worst = max(worst, abs(a.logprobs[t][ta].logprob - b.logprobs[t][tb].logprob))
    print(f"\n{name}: worst logprob difference {worst:.3g}, near-tie flips {flips}")
    assert worst <= LOGPROB_TOL, f"logprobs differ by {worst:.3g} > {LOGPROB_TOL}"
