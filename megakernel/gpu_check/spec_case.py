"""A speculative gpu-check case (Case.drafts): the kernel's speculative step (ACCEPT, the recurrent
layers' COMMIT records, NGRAM) against the plain kernel and the CPU executor.

The plain kernel (T = 1) decodes the prompts first: its tokens are the truth (greedy speculative
decoding emits exactly the plain greedy tokens). The speculative program then runs from the same
prefill: with host drafts, step s of sequence b proposes the plain run's next a = (s + b) mod
(k + 1) tokens and a wrong one after them, so every accepted count 0..k occurs and the accepted
counts are known; with the device drafter (Case.ngram) whatever NGRAM proposes. Per step: the
emitted tokens equal the plain run's, the accepted counts the scripted ones, and (the first
executor_steps steps) the executor's run of the same program from the same cache gives the same
greedy tokens and accepted counts and, after ACCEPT and COMMIT, the same recurrent state arena
(compare.state_parity) and lengths.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from megakernel.gpu_check import compare
from megakernel.gpu_check.cases import Case


def scripted_drafts(plain: list[list[int]], done: list[int], step: int, k: int,
                    vocab: int) -> tuple[torch.Tensor, list[int]]:
    """[B, k] drafts and the accepted counts they make: sequence b's first a of the plain run's
    next tokens (after the `done[b]` it has emitted), then a wrong token, then filler."""
    rows, want = [], []
    for b, seq in enumerate(plain):
        a = min((step + b) % (k + 1), len(seq) - done[b] - 1)
        nxt = seq[done[b] : done[b] + k + 1]
        row = [int(nxt[i]) for i in range(a)]
        if a < k:
            row.append((int(nxt[a]) + 1) % vocab)  # the first draft that fails
        row += [(row[-1] + 7) % vocab] * (k - len(row)) if row else [0] * k
        rows.append(row)
        want.append(a)
    return torch.tensor(rows, dtype=torch.int32), want


def run_speculative_case(c: Case, build_dir: Path | None, weights, simulate: bool = False,  # noqa: ANN001
                         seed: int = 0, emulate: bool = False) -> dict[str, Any]:
    from megakernel.executor import Executor
    from megakernel.gpu_check.case import SIMULATED_STEPS, _to_cpu, config
    from megakernel.reference.model import ReferenceModel
    from megakernel.serve.kernel_backend import Megakernel

    t0 = time.perf_counter()
    cfg = config(c, simulate)
    dev = torch.device("cpu") if simulate else torch.device("cuda", torch.cuda.current_device())
    steps = min(c.steps, SIMULATED_STEPS) if simulate else c.steps
    k, window = c.drafts, c.replay_window or None
    w = weights.get(cfg, seed)
    g = torch.Generator().manual_seed(seed + 7)
    lens = [int(x) for x in torch.randint(2, 24, (c.batch,), generator=g)]
    vocab = cfg.vocab_size if not c.ngram else min(cfg.vocab_size, 5)  # repetitive for NGRAM
    prompts = [[int(t) for t in torch.randint(0, vocab, (n,), generator=g)] for n in lens]
    s_max = max(lens) + steps * (k + 1) + 2 * (k + 1) + 8
    how = dict(build_dir=build_dir, device=dev, max_seq_len=s_max, replay_window=window,
               emulate=emulate)
    # the truth: the plain kernel's greedy tokens, enough for every speculative step
    plain_mk = Megakernel(cfg, w, batch=c.batch, tokens=1, **how)
    first = plain_mk.prefill(prompts)
    plain = [[int(t)] for t in first.tolist()]
    tok = first[:, None].to(dev)
    for _ in range(steps * (k + 1)):
        out = plain_mk.step(tok)[0].view(c.batch, 1).long()
        for b in range(c.batch):
            plain[b].append(int(out[b, 0]))
        tok = out
    mk = Megakernel(cfg, w, batch=c.batch, drafts=k, ngram=c.ngram, **how)
    mk.prefill(prompts)
    ref = ReferenceModel(cfg, w, mode="bf16", device=dev, replay_window=window)
    cache = ref.new_cache(c.batch, mk.max_seq_len)
    ref.prefill(cache, prompts)
    ex = None
    if c.executor_steps:
        ex = Executor(mk.prog, mk.args.packed, check=True)
        ex.load_cache(_to_cpu(cache))
    tin = mk._region("i32", "tokens_in").view(c.batch, 1 + k)
    tin[:, 0] = first.to(tin.device, torch.int32)  # the first step's input 0
    if c.ngram:  # the device drafter reads the history: the prompts and the first token
        hist = mk._region("i32", "history").view(c.batch, -1)
        for b, p in enumerate(prompts):
            hist[b, : len(p) + 1] = torch.tensor(p + [plain[b][0]], dtype=torch.int32)
        if ex is not None:
            ex.region("i32", "history").view(c.batch, -1).copy_(hist.cpu())
    res: dict[str, Any] = dict(
        case=c.name, model=c.model, layers=cfg.num_layers, batch=c.batch, tokens=1 + k,
        drafts=k, ngram=c.ngram, prompt_lengths=lens, steps=0, token_mismatches=0,
        accept_mismatches=0, accepted_seen=[], executor_token_mismatches=0,
        executor_state_max_diff=0.0, executor_state_ok=True, first_failure_step=None,
        simulated=simulate, emulated=emulate)
    done = [1] * c.batch  # plain tokens emitted so far per sequence (the first by the prefill)
    seen: set[int] = set()
    for step in range(steps):
        drafts, want = (None, None) if c.ngram else scripted_drafts(plain, done, step, k, vocab)
        row0 = tin[:, 0].clone()
        if drafts is not None:
            tin[:, 1:] = drafts.to(tin.device)
        ex_in = tin.clone().cpu()  # the step's inputs (NGRAM's drafts from the last step)
        greedy, accepted = mk.speculative_step(drafts)
        greedy, accepted = greedy.cpu().long(), accepted.cpu().long()
        bad = 0
        for b in range(c.batch):
            a = int(accepted[b])
            seen.add(a)
            emitted = greedy[b, : a + 1].tolist()
            if emitted != plain[b][done[b] : done[b] + a + 1]:
                bad += 1
            if want is not None and a != want[b]:
                res["accept_mismatches"] += 1
            done[b] += a + 1
        res["token_mismatches"] += bad
        if ex is not None and step < c.executor_steps:
            ex_in[:, 0] = row0.cpu()
            ex_tok = ex.step(ex_in)
            res["executor_token_mismatches"] += int((ex_tok != greedy).sum())
            st = compare.state_parity(mk.state, ex.state)
            res["executor_state_max_diff"] = max(res["executor_state_max_diff"], st["max_diff"])
            res["executor_state_ok"] = res["executor_state_ok"] and st["ok"] and (
                ex.lengths.tolist() == [int(x) for x in mk._region("i32", "lengths").tolist()])
        if (bad or res["accept_mismatches"]) and res["first_failure_step"] is None:
            res["first_failure_step"] = step
        res["steps"] += 1
        if max(done) + k + 1 >= len(plain[0]):
            break
    if not simulate:
        torch.cuda.synchronize()
    res["accepted_seen"] = sorted(seen)
    # scripted drafts: every count 0..k (a short simulated run: as many as it had steps)
    res["accept_coverage_ok"] = bool(c.ngram) or len(seen) >= min(k + 1, res["steps"])
    res["seconds"] = round(time.perf_counter() - t0, 2)
    res["ok"] = (res["steps"] > 0 and res["token_mismatches"] == 0
                 and res["accept_mismatches"] == 0 and res["accept_coverage_ok"]
                 and res["executor_token_mismatches"] == 0 and res["executor_state_ok"])
    return res
