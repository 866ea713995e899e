"""The chunked prefill (megakernel.serve.engine.program_generate) at the chunk boundary.

The T-token program consumes the prompts' common prefix as far as the shortest prompt allows while
leaving it at least one token: the T = 1 program must still run that prompt's last token, whose
output is the row's first new token. An off-by-one there shows only when the shortest prompt's
length is a multiple of the chunk size (one chunk too many eats its last token: a wrong first
token), so these prompts are: shortest a multiple of PREFILL_CHUNK, and a multiple plus one. Each
runs through the three callers of the engine (the executor backend, the Python API, the kernel
path on CPU tensors), counted step by step, and its tokens are checked against the bf16
reference: the first one at the prompt's last token, the later ones teacher-forced with the
program's own tokens (equal everywhere iff the free-running generations are equal).
"""

from __future__ import annotations

import pytest
import torch

import megakernel as mk
from megakernel.models.sources import load_model
from megakernel.reference.model import ReferenceModel, greedy
from megakernel.serve.engine import PREFILL_CHUNK

STEPS = 3
MODEL = "llama-tiny"


def prompts_with_shortest(n: int, vocab: int) -> list[list[int]]:
    """Three ragged random prompts, the shortest (the second) n tokens long."""
    g = torch.Generator().manual_seed(n)
    return [[int(t) for t in torch.randint(0, vocab, (m,), generator=g)] for m in (n + 3, n, n + 6)]


def reference_agrees(cfg, w, prompts: list[list[int]], tokens: list[list[int]]) -> None:  # noqa: ANN001
    """Each row's first new token is the bf16 reference's greedy token at its prompt's last
    token; each later one the reference's after the program's own earlier tokens."""
    ref = ReferenceModel(cfg, w, mode="bf16")
    cache = ref.new_cache(len(prompts), max(len(p) for p in prompts) + STEPS)
    assert [t[0] for t in tokens] == greedy(ref.prefill(cache, prompts)).tolist(), "first token"
    for s in range(1, STEPS):
        logits = ref.decode(cache, torch.tensor([[t[s - 1]] for t in tokens]))
        assert [t[s] for t in tokens] == greedy(logits)[:, 0].tolist(), f"token {s}"


@pytest.mark.parametrize("shortest", [2 * PREFILL_CHUNK, 2 * PREFILL_CHUNK + 1])
@pytest.mark.parametrize("path", ["executor", "api", "kernel"])
def test_chunked_prefill_at_the_chunk_boundary(path: str, shortest: int,
                                               executor_steps: dict[int, int]) -> None:
    """Shortest prompt a multiple of the chunk (one chunk fewer than it holds: its last token
    stays for T = 1) or a multiple plus one (every whole chunk): tokens equal the reference's,
    and the chunk and single steps are exactly those the boundary calls for."""
    cfg, w = load_model(MODEL, seed=0)
    prompts = prompts_with_shortest(shortest, cfg.vocab_size)
    longest = max(len(p) for p in prompts)
    if path == "executor":
        from megakernel.serve.executor_backend import generate

        tokens = generate(cfg, w, prompts, STEPS, check=False)
    elif path == "api":
        llm = mk.load(MODEL, backend="cpu-executor", max_batch=3, max_seq_len=32)
        tokens = llm.generate(prompts, max_new_tokens=STEPS).tokens
    else:
        from megakernel.serve.kernel_backend import Megakernel

        k = Megakernel(cfg, w, batch=3, max_seq_len=32, device="cpu", gpu="h100")
        tokens = k.generate_program(prompts, STEPS, chunk_tokens=PREFILL_CHUNK).tokens
    assert [len(t) for t in tokens] == [STEPS] * 3
    reference_agrees(cfg, w, prompts, tokens)
    chunks = (shortest - 1) // PREFILL_CHUNK  # every whole chunk that leaves a token
    assert chunks == (2 if shortest % PREFILL_CHUNK else 1)
    assert executor_steps == {PREFILL_CHUNK: chunks,
                          1: longest - chunks * PREFILL_CHUNK + STEPS - 1}, executor_steps
