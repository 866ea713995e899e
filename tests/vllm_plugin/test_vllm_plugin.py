"""The vLLM plugin on the CPU (make test-vllm; skipped where vllm does not import): a tiny
random checkpoint served by stock vLLM and by the plugin, ragged prompts with different
max_tokens so that the decode batch shrinks through the buckets 8, 4, 2, 1.

Greedy tokens must be equal, except from a step where stock vLLM's own top-2 logprob margin is
below NEAR_TIE (a near-tie that bf16 rounding can flip; the rest of that sequence is then not
compared). Up to there both engines are fed the same tokens (teacher-forced), and the chosen
token's logprob must agree within LOGPROB_TOL: vLLM's bf16 model and the program round at
different points, so they differ by the bf16 band, not bit for bit. The megakernel path must
have served decode steps, in exactly the buckets the shrinking batch passes through.

FP8 checkpoints (each form vLLM loads: compressed-tensors per channel W8A8 and W8A16, fp8 block,
fp8 per tensor) are compared the same way with vLLM's FP8 GEMM run as W8A16 in both engines
(the comment above FP8_FORMS says why), and the plugin's packed weights must equal what
megakernel's own loader packs from the checkpoint. An FP8 config the plugin does not parse must
leave every step on vLLM's model, with one warning.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("vllm")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: read its stats
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.triton_utils import dispatcher  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402

from megakernel.models import fp8, preset  # noqa: E402
from megakernel.models.weights import (  # noqa: E402
    load_checkpoint,
    random_weights,
    save_checkpoint,
)
from megakernel.program.pack import pack_weights  # noqa: E402
from megakernel.vllm_plugin.decode import bucket_of  # noqa: E402

PROMPT_LENS = (3, 9, 5, 12, 7)
MAX_TOKENS = (2, 4, 6, 8, 10)  # the batch shrinks 5 -> 4 -> 3 -> 2 -> 1
NEAR_TIE = 0.05  # nats between stock vLLM's top-2 logprobs
LOGPROB_TOL = 0.08  # |plugin - stock| logprob of one token, one prefix: measured 0.025-0.042
ARCHS = {"llama-tiny": "MegakernelLlamaForCausalLM", "qwen3-tiny": "MegakernelQwen3ForCausalLM",
         "qwen2-tiny": "MegakernelQwen2ForCausalLM",
         "nemotron-h-tiny": "MegakernelNemotronHForCausalLM"}


def _vec_isa(*args, **kw) -> str:  # noqa: ANN002, ANN003
    """vLLM-CPU's attention ISA with "amx" replaced by "vec": on a CPU with AMX tiles vLLM picks
    its AMX page layout, which the plugin does not read (its decode steps then stay on vLLM's
    model, with a warning); both engines of the comparison are served with the vec layout."""
    isa = _ATTN_ISA(*args, **kw)
    return "vec" if isa == "amx" else isa


_ATTN_ISA = cpu_attn._get_attn_isa


class _ModulesWithoutLlvmlite:
    """`sys` as vLLM's kernel-override scan (triton_utils.dispatcher, run at every engine start)
    sees it: without llvmlite's modules, which hold no vLLM kernel. Once numba has compiled
    (vLLM's ngram proposer does, at its start), `vars(llvmlite.binding.ffi.lib)` is a C function
    wrapper, not a dict, and the scan's `vars(value).get(...)` raises AttributeError: every later
    engine in the process would fail to start."""

    @property
    def modules(self) -> dict[str, object]:
        return {k: m for k, m in sys.modules.items() if k.split(".")[0] != "llvmlite"}


def _serve(path: str, prompts: list[list[int]], arch: str | None,  # noqa: ANN202
           patch=None, max_tokens=MAX_TOKENS, spec: dict | None = None,  # noqa: ANN001
           probe=None, **llm_kw):  # noqa: ANN001, ANN003
    """Generate with stock vLLM (arch None) or the plugin; `patch(monkeypatch)` is applied for
    the whole run, `spec` is vLLM's speculative_config, `probe(model)` what comes back of the
    plugin's model (default: its decode steps per bucket and its packed weights); `llm_kw`
    more of vLLM's engine arguments."""
    kw = {"hf_overrides": {"architectures": [arch]}} if arch else {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_attn, "_get_attn_isa", _vec_isa)
        mp.setattr(dispatcher, "sys", _ModulesWithoutLlvmlite())
        if patch is not None:
            patch(mp)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                  max_model_len=256, block_size=32, num_gpu_blocks_override=32, max_logprobs=2,
                  seed=0, speculative_config=spec, **kw, **llm_kw)
        params = [SamplingParams(temperature=0, max_tokens=m, logprobs=2, ignore_eos=True,
                                 detokenize=False) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        # the model lives in this process: its decode steps per bucket and its packed weights
        probe = probe or (lambda m: (m.megakernel_stats(), m._mk_packed))
        mk = llm.apply_model(probe)[0] if arch else None
        del llm
    return [o.outputs[0] for o in outs], mk


def _prompts(cfg) -> list[list[int]]:  # noqa: ANN001
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _compare(name: str, path: str, prompts: list[list[int]], patch=None):  # noqa: ANN001, ANN202
    """Stock vLLM vs the plugin on the checkpoint at `path`: the decode buckets, greedy tokens
    up to near ties, the chosen tokens' logprobs within the bf16 band (module docstring).
    Returns the plugin's packed weights."""
    stock, _ = _serve(path, prompts, None, patch)
    mine, (stats, packed) = _serve(path, prompts, ARCHS[name], patch)

    # decode steps (the first token is the prefill's, on vLLM's model in both): one per batch
    sizes = [sum(m > s for m in MAX_TOKENS) for s in range(1, max(MAX_TOKENS))]
    want: dict[int, int] = {}
    for n in sizes:
        want[bucket_of(n)] = want.get(bucket_of(n), 0) + 1
    assert stats == want, f"megakernel decode steps per bucket {stats}, expected {want}"

    _same_greedy(name, stock, mine, MAX_TOKENS)
    return packed


def _same_greedy(name: str, stock: list, mine: list, max_tokens: tuple[int, ...]) -> int:
    """Greedy tokens equal up to near ties, the chosen tokens' logprobs within the bf16 band
    (module docstring). Returns the number of near-tie flips."""
    worst, flips = 0.0, 0
    for s, (a, b) in enumerate(zip(stock, mine, strict=True)):
        assert len(b.token_ids) == max_tokens[s]
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
    return flips


@pytest.mark.parametrize("name", list(ARCHS))
def test_plugin_matches_stock_vllm(name: str, tmp_path) -> None:
    """Stock vLLM vs the plugin (_compare), and the plugin's packed weights bit for bit what
    megakernel's own loader packs from the checkpoint (vLLM's names, fusing and transformed
    parameters read back: Nemotron-H's A = -exp(A_log))."""
    cfg = preset(name)
    save_checkpoint(cfg, random_weights(cfg, seed=5), tmp_path)
    packed = _compare(name, str(tmp_path), _prompts(cfg))
    want = pack_weights(*load_checkpoint(tmp_path))
    assert packed.layout == want.layout
    assert torch.equal(packed.arena.view(torch.int16), want.arena.view(torch.int16)), (
        "the plugin's packed weights differ from the checkpoint's")


def test_hybrid_state_slots_pass_from_request_to_request(tmp_path) -> None:
    """Nemotron-H with at most two requests running: five requests pass through two state
    slots, each slot reused by a later request (whose prefill, on vLLM's model, starts it
    clean) while the other request decodes; steps that mix a prefill with a decode run on
    vLLM's model, reading and writing the same slots as the plugin's decode steps. Greedy
    tokens as stock vLLM's under the same settings, up to near ties."""
    name = "nemotron-h-tiny"
    cfg = preset(name)
    save_checkpoint(cfg, random_weights(cfg, seed=5), tmp_path)
    prompts = _prompts(cfg)
    from megakernel.vllm_plugin.decode import PagedDecoder

    slots: set[tuple[int, int]] = set()  # (layer, slot) the plugin's decode steps used
    step = PagedDecoder.step

    def record(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        slots.update((i, int(s)) for i, t in args[-1].index.items() for s in t)
        return step(self, *args, **kw)

    stock, _ = _serve(str(tmp_path), prompts, None, max_num_seqs=2)
    mine, (stats, _) = _serve(str(tmp_path), prompts, ARCHS[name],
                              lambda mp: mp.setattr(PagedDecoder, "step", record),
                              max_num_seqs=2)
    print(f"decode steps per bucket {stats}, (layer, slot) used {sorted(slots)}")
    assert set(stats) == {1, 2}, stats  # two running, then the last one alone
    # four requests at least have a decode step of their own (max_tokens >= 4): a layer with
    # fewer slots in use passed one from a finished request to a new one
    per_layer = {i: sum(1 for j, _ in slots if j == i) for i, _ in slots}
    assert min(per_layer.values()) < 4, f"no slot was reused: {sorted(slots)}"
    assert sum(stats.values()) < sum(m - 1 for m in MAX_TOKENS), "no step mixed prefill and decode"
    _same_greedy(f"{name}, two state slots", stock, mine, MAX_TOKENS)


# Speculative decoding (docs/VLLM.md, "Speculative decoding"): vLLM drafts with its ngram
# proposer and accepts with its rejection sampler (greedy) in both engines; the plugin's model
# runs the verify steps, each sequence bringing 1 + its drafts (0 .. k) tokens. Three prompts
# repeat a token the random model (llama-tiny, seed 5) itself repeats greedily (margins 0.44 to
# 0.69), so every draft is accepted and those sequences bring 1 + k tokens a step; two repeat a
# random pattern, which the ngram lookup drafts from but the model mostly does not follow, so
# the steps are ragged (1 .. 1 + k tokens per sequence) until those two finish.
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 2}
SPEC_LOOPS = ((50, 8), (394, 11), (454, 9))  # (token, prompt length)
SPEC_PATTERNS = (4, 6)  # pattern lengths; each such prompt is its pattern 4 times
SPEC_MAX_TOKENS = (32, 28, 24, 12, 16)


def _spec_prompts(cfg) -> list[list[int]]:  # noqa: ANN001
    g = torch.Generator().manual_seed(11)
    return ([[t] * n for t, n in SPEC_LOOPS]
            + [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() * 4
               for n in SPEC_PATTERNS])


def _step_widths(seen: list[int]):  # noqa: ANN202
    """A patch recording, per forward of vLLM's own Llama, the most tokens a sequence brings
    (max_query_len; the plugin's model reaches it only for what the plugin does not serve)."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.models.llama import LlamaForCausalLM

    stock_forward = LlamaForCausalLM.forward

    def forward(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict) and meta:  # not a dummy run
            seen.append(next(iter(meta.values())).max_query_len)
        return stock_forward(self, *args, **kw)

    return lambda mp: mp.setattr(LlamaForCausalLM, "forward", forward)


def test_speculative_verify_steps_match_stock_vllm(tmp_path) -> None:
    """Stock vLLM and the plugin, the same ngram speculative_config: greedy tokens equal up to
    near ties, and on the plugin every decode and verify step ran on the megakernel (vLLM's own
    model ran prefills only), verify steps with 1 + k tokens per sequence among them."""
    cfg = preset("llama-tiny")
    save_checkpoint(cfg, random_weights(cfg, seed=5), tmp_path)
    prompts = _spec_prompts(cfg)
    width = 1 + SPEC["num_speculative_tokens"]
    on_stock, on_vllm = [], []
    stock, _ = _serve(str(tmp_path), prompts, None, _step_widths(on_stock), SPEC_MAX_TOKENS,
                      SPEC)
    mine, (stats, (verify, runs)) = _serve(
        str(tmp_path), prompts, ARCHS["llama-tiny"], _step_widths(on_vllm), SPEC_MAX_TOKENS,
        SPEC, probe=lambda m: (m.megakernel_stats(), m.megakernel_verify_stats()))
    flips = _same_greedy("llama-tiny, ngram speculative", stock, mine, SPEC_MAX_TOKENS)
    print(f"decode steps {stats}, verify steps {verify}, runs per (bucket, T) {runs}")

    assert any(1 < w <= width for w in on_stock), f"stock vLLM ran no verify step: {on_stock}"
    assert all(w > width for w in on_vllm), f"steps left on vLLM's model: {on_vllm}"
    assert verify > 0 and any(t == width for _, t in runs), runs
    assert sum(stats.values()) + verify < max(SPEC_MAX_TOKENS) - 1, "no draft was accepted"
    if flips == 0:  # the same tokens: the same drafts, so the same steps
        assert sum(stats.values()) + verify == sum(w <= width for w in on_stock)


# FP8 checkpoints (docs/VLLM.md, "FP8 checkpoints"). vLLM-CPU 0.32 without AMX runs one FP8
# form, compressed-tensors per channel with dynamic per-token e4m3 activations (W8A8,
# CompressedTensorsW8A8Fp8 on torch._scaled_mm). It refuses the others: weight-only (W8A16) has
# no CPU kernel, the block form's kernels need AMX tiles, per-tensor scales of fused layers are
# requantized with a CUDA-only op. megakernel is weight-only FP8 (bf16 activations): against
# vLLM's W8A8 GEMM its decode steps differ by the activation rounding (measured up to 0.23
# nats, greedy flips at margins up to 0.19), a band in which a dropped or misplaced scale hides.
# So both engines run vLLM's own loader and model with its FP8 GEMM replaced by the W8A16
# kernel vLLM-CPU lacks, emulated from vLLM's loaded parameters: x @ (code * scale) in fp32,
# rounded to bf16 (prefill in both; the plugin's decode steps never call it). The bf16 band
# applies, and the plugin's packed weights must be what megakernel's own loader packs.
FP8_FORMS = {  # form -> megakernel's scale granularity
    "ct-w8a8-channel": "channel",  # llm-compressor FP8_DYNAMIC: runs natively on vLLM-CPU
    "ct-w8a16-channel": "channel",  # save_checkpoint's channel form
    "fp8-block": "block",  # transformers' fine-grained fp8 (save_checkpoint's block form)
    "fp8-tensor": "channel",  # fp8 without a block size: one scale per matrix
}
FP8_CASES = [("llama-tiny", "ct-w8a8-channel"), ("qwen3-tiny", "ct-w8a8-channel"),
             ("llama-tiny", "ct-w8a16-channel"), ("qwen3-tiny", "fp8-block"),
             ("llama-tiny", "fp8-tensor")]


def _dequantized(layer) -> torch.Tensor:  # noqa: ANN001
    """vLLM's FP8 linear layer's weight as loaded, [N, K] fp32: codes times the block grid
    (weight_scale_inv), the channel column or the per-shard scalars (weight_scale)."""
    w = layer.weight.detach().float()
    n, k = w.shape
    if hasattr(layer, "weight_scale_inv"):
        s = layer.weight_scale_inv.detach().float()
        s = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    else:
        s = layer.weight_scale.detach().float()
        if s.dim() <= 1:  # per tensor: one per fused shard
            s = torch.cat([v.expand(r) for v, r in zip(s.reshape(-1), layer.logical_widths,
                                                       strict=True)])[:, None]
    return w * s


def _w8a16(mp: pytest.MonkeyPatch) -> None:
    """vLLM's FP8 linear methods as W8A16 on any CPU (the comment above)."""
    from vllm.model_executor.layers.quantization import fp8 as fp8_method
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a8_fp8 as w8a8,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a16_fp8 as w8a16,
    )

    def process(self, layer) -> None:  # noqa: ANN001
        layer.mk_w32 = _dequantized(layer)

    def apply(self, layer, x, bias=None):  # noqa: ANN001, ANN202
        b = None if bias is None else bias.float()
        return torch.nn.functional.linear(x.float(), layer.mk_w32, b).to(x.dtype)

    mp.setattr(fp8_method, "init_fp8_linear_kernel", lambda **kw: None)
    mp.setattr(w8a16, "init_wfp8_a16_linear_kernel", lambda *a, **kw: None)
    for cls, method in ((fp8_method.Fp8LinearMethod, "apply"),
                        (w8a8.CompressedTensorsW8A8Fp8, "apply_weights"),
                        (w8a16.CompressedTensorsW8A16Fp8, "apply_weights")):
        mp.setattr(cls, "process_weights_after_loading", process)
        mp.setattr(cls, method, apply)


def _fp8_checkpoint(name: str, form: str, path) -> None:  # noqa: ANN001
    """A tiny FP8 checkpoint of `form` (FP8_FORMS) of a preset quantized by megakernel:
    save_checkpoint's own form, with activations per token (W8A8) or one scale per matrix."""
    cfg = preset(name).replace(quant=fp8.Fp8Format(FP8_FORMS[form]))
    weights = fp8.QuantizedWeights(cfg, random_weights(preset(name), seed=5))
    w = {n: weights[n] for n in weights}
    if form == "fp8-tensor":
        for n in fp8.quantized_names(cfg):
            codes, s = fp8.quantize(weights.base[n].reshape(1, -1), cfg.quant)
            w[n], w[fp8.scale_name(n)] = codes.view(w[n].shape), s.reshape(1)
    save_checkpoint(cfg, w, path)
    conf = json.loads((path / "config.json").read_text())
    if form == "ct-w8a8-channel":
        conf["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
            "symmetric": True}
    if form == "fp8-tensor":
        conf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                       "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(conf, indent=1))


@pytest.mark.parametrize("name,form", FP8_CASES)
def test_fp8_checkpoint_matches_stock_vllm(name: str, form: str, tmp_path) -> None:
    """The plugin's packed program holds exactly the checkpoint's FP8 model (codes and
    scales, bit for bit what megakernel's own loader packs), and serves it as vLLM's model
    with W8A16 linear layers (above) within the bf16 band."""
    _fp8_checkpoint(name, form, tmp_path)
    cfg, weights = load_checkpoint(tmp_path)
    assert cfg.quant == fp8.Fp8Format(FP8_FORMS[form])
    packed = _compare(name, str(tmp_path), _prompts(cfg), _w8a16)
    want = pack_weights(cfg, weights)
    assert packed.layout == want.layout
    assert torch.equal(packed.arena.view(torch.int16), want.arena.view(torch.int16)), (
        "the plugin's packed FP8 weights differ from the checkpoint's")


def test_an_fp8_config_the_plugin_does_not_serve_stays_on_vllms_model(tmp_path, caplog) -> None:
    """A quantization_config vLLM-CPU runs (W8A8, unpatched) but megakernel does not parse (two
    compressed-tensors groups): one warning, every decode step on vLLM's model."""
    _fp8_checkpoint("llama-tiny", "ct-w8a8-channel", tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    qc = conf["quantization_config"]
    group = qc["config_groups"].pop("group_0")
    qc["config_groups"] = {"attention": dict(group, targets=["re:.*self_attn.*"]),
                           "mlp": dict(group, targets=["re:.*mlp.*"])}
    (tmp_path / "config.json").write_text(json.dumps(conf, indent=1))
    prompts = _prompts(preset("llama-tiny"))
    with caplog.at_level("WARNING", logger="megakernel.vllm_plugin.models"):
        out, (stats, packed) = _serve(str(tmp_path), prompts, ARCHS["llama-tiny"])
    assert stats == {} and packed is None
    assert [len(o.token_ids) for o in out] == list(MAX_TOKENS)
    warned = [r.getMessage() for r in caplog.records
              if r.name == "megakernel.vllm_plugin.models"]
    assert len(warned) == 1 and "config group" in warned[0], warned
