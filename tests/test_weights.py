"""Weights: layout vs transformers, checkpoint round trips, refusals, memory, random init."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file

import megakernel.weights as mw
from megakernel.config import PRESETS, ConfigError, ModelConfig, RopeConfig
from megakernel.weights import (
    WeightError,
    expected_shapes,
    load_checkpoint,
    load_model,
    random_weights,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def tiny(family: str, tied: bool, layers: int = 2) -> ModelConfig:
    rope = RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 64) if family == "llama" else RopeConfig(1e6)
    return ModelConfig(family, 96, 32, layers, 4, 2, 16, 48, 1e-5, rope, tied, 128, "tiny")


def hf_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls_cfg, cls_model = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[cfg.family]
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**cfg.to_hf_dict(), initializer_range=0.1)).eval()
    with torch.no_grad():  # norms are ones at init: perturb them so a mix-up would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape))
    return model


def save_weights(path: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint directory written by hand (for malformed checkpoints)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


# ---- layout --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_expected_shapes_match_transformers(family: str, tied: bool) -> None:
    cfg = tiny(family, tied)
    hf = {k: tuple(v.shape) for k, v in hf_model(cfg).state_dict().items()}
    if tied:
        assert hf.pop("lm_head.weight") == hf["model.embed_tokens.weight"]
    assert expected_shapes(cfg) == hf


def test_expected_shapes_of_a_real_preset() -> None:
    cfg = PRESETS["qwen3-0.6b"]
    shapes = expected_shapes(cfg)
    assert "lm_head.weight" not in shapes  # tied
    assert shapes["model.layers.27.self_attn.q_proj.weight"] == (2048, 1024)
    assert shapes["model.layers.27.self_attn.o_proj.weight"] == (1024, 2048)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (128,)
    assert sum(torch.Size(s).numel() for s in shapes.values()) == cfg.num_parameters()
    assert "lm_head.weight" in expected_shapes(PRESETS["llama-3.1-8b"])
    assert not any("q_norm" in n for n in expected_shapes(PRESETS["llama-3.1-8b"]))


# ---- round trips through save_pretrained ---------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("disk", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("sharded", [False, True])
def test_round_trip(tmp_path: Path, family: str, tied: bool, disk: str, sharded: bool) -> None:
    cfg = tiny(family, tied)
    model = hf_model(cfg).to(DTYPES[disk])
    model.save_pretrained(tmp_path, max_shard_size="8KB" if sharded else "10GB")
    index = tmp_path / "model.safetensors.index.json"
    if sharded:
        shards = set(json.loads(index.read_text())["weight_map"].values())
        assert index.is_file() and len(shards) > 2
    else:
        assert (tmp_path / "model.safetensors").is_file() and not index.exists()

    want = {k: v for k, v in model.state_dict().items() if k in expected_shapes(cfg)}
    loaded_cfg, w = load_checkpoint(tmp_path)
    assert loaded_cfg == cfg.replace(name=tmp_path.name)
    assert list(w) == list(expected_shapes(cfg))
    for name, t in want.items():
        assert t.dtype == DTYPES[disk] and w[name].dtype == DTYPES[disk], name
        assert torch.equal(w[name], t), name

    _, w32 = load_checkpoint(tmp_path, dtype=torch.float32)
    for name, t in want.items():
        assert w32[name].dtype == torch.float32 and torch.equal(w32[name], t.float()), name


def test_tied_duplicate_head_is_accepted_and_dropped(tmp_path: Path) -> None:
    cfg = tiny("qwen3", tied=True)
    w = random_weights(cfg, seed=3)
    save_weights(tmp_path, cfg, {**w, "lm_head.weight": w["model.embed_tokens.weight"].clone()})
    _, got = load_checkpoint(tmp_path)
    assert "lm_head.weight" not in got
    assert all(torch.equal(got[n], w[n]) for n in w)


def test_tied_head_that_differs_is_refused(tmp_path: Path) -> None:
    cfg = tiny("llama", tied=True)
    w = random_weights(cfg, seed=3)
    head = w["model.embed_tokens.weight"].clone()
    head[5, 7] += 1
    save_weights(tmp_path, cfg, {**w, "lm_head.weight": head})
    with pytest.raises(WeightError, match="'lm_head.weight' differs from 'model.embed_tokens"):
        load_checkpoint(tmp_path)


def test_harmless_rotary_buffers_are_ignored(tmp_path: Path) -> None:
    cfg = tiny("llama", tied=False)
    w = random_weights(cfg, seed=1)
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.rand(8),
             "model.rotary_emb.inv_freq": torch.rand(8)}
    save_weights(tmp_path, cfg, {**w, **extra})
    _, got = load_checkpoint(tmp_path)
    assert set(got) == set(w)


# ---- refusals ------------------------------------------------------------------------------------
def test_missing_tensor_is_named_with_its_shape(tmp_path: Path) -> None:
    cfg = tiny("qwen3", tied=False)
    w = random_weights(cfg)
    del w["model.layers.1.self_attn.k_norm.weight"]
    save_weights(tmp_path, cfg, w)
    with pytest.raises(
        WeightError,
        match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight' "
        r"\(expected shape \[16\]\)",
    ):
        load_checkpoint(tmp_path)


def test_untied_without_head_is_missing_the_head(tmp_path: Path) -> None:
    cfg = tiny("llama", tied=False)
    w = random_weights(cfg)
    del w["lm_head.weight"]
    save_weights(tmp_path, cfg, w)
    want = r"missing tensor 'lm_head\.weight' \(expected shape \[96, 32\]\)"
    with pytest.raises(WeightError, match=want):
        load_checkpoint(tmp_path)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    cfg = tiny("llama", tied=True)
    w = random_weights(cfg)
    w["model.layers.2.mlp.up_proj.weight"] = torch.zeros(48, 32)  # a third layer in a 2-layer model
    save_weights(tmp_path, cfg, w)
    with pytest.raises(
        WeightError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'.*2-layer"
    ):
        load_checkpoint(tmp_path)


def test_qk_norm_in_a_llama_checkpoint_is_unexpected(tmp_path: Path) -> None:
    cfg = tiny("qwen3", tied=True)
    save_weights(tmp_path, tiny("llama", tied=True), random_weights(cfg))  # llama config.json
    want = r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm"
    with pytest.raises(WeightError, match=want):
        load_checkpoint(tmp_path)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path: Path) -> None:
    cfg = tiny("llama", tied=True)
    w = random_weights(cfg)
    w["model.layers.0.self_attn.o_proj.weight"] = w["model.layers.0.self_attn.o_proj.weight"].T
    save_weights(tmp_path, cfg, w)
    with pytest.raises(
        WeightError,
        match=r"'model\.layers\.0\.self_attn\.o_proj\.weight' has shape \[64, 32\], "
        r"expected \[32, 64\]",
    ):
        load_checkpoint(tmp_path)


def test_unsupported_disk_dtype_is_named(tmp_path: Path) -> None:
    cfg = tiny("llama", tied=True)
    w = random_weights(cfg)
    w["model.norm.weight"] = torch.ones(32, dtype=torch.int8)
    save_weights(tmp_path, cfg, w)
    with pytest.raises(WeightError, match=r"'model\.norm\.weight' has dtype I8"):
        load_checkpoint(tmp_path)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(WeightError, match="does not exist"):
        load_checkpoint(tmp_path / "absent")
    with pytest.raises(ConfigError, match="no config.json"):
        load_checkpoint(tmp_path)
    cfg = tiny("llama", tied=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    with pytest.raises(WeightError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(tmp_path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    cfg = tiny("qwen3", tied=False)
    hf_model(cfg).save_pretrained(tmp_path, max_shard_size="8KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightError, match=f"shard {shard.name} listed in .* is missing"):
        load_checkpoint(tmp_path)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    cfg = tiny("llama", tied=True)
    hf_model(cfg).save_pretrained(tmp_path, max_shard_size="8KB")
    index = tmp_path / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    holder = d["weight_map"]["model.norm.weight"]
    d["weight_map"]["model.norm.weight"] = next(f for f in d["weight_map"].values() if f != holder)
    index.write_text(json.dumps(d))
    with pytest.raises(WeightError, match=r"'model\.norm\.weight' is listed .* but absent from"):
        load_checkpoint(tmp_path)


# ---- memory: one tensor at a time ----------------------------------------------------------------
def test_conversion_is_tensor_by_tensor(tmp_path: Path, monkeypatch) -> None:
    """When each raw tensor is read, every earlier raw (unconverted) tensor is already freed.

    A loader that read the whole checkpoint (or a whole shard) before converting it would hold
    several raw tensors alive at once, and so fail here.
    """
    cfg = tiny("qwen3", tied=False, layers=3)
    hf_model(cfg).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="16KB")
    real_open = safetensors.safe_open
    raw: list[weakref.ref] = []
    alive_at_read: list[int] = []

    class SpyFile:
        def __init__(self, *args, **kwargs) -> None:
            self._cm = real_open(*args, **kwargs)

        def __enter__(self) -> SpyFile:
            self._f = self._cm.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self._cm.__exit__(*exc)

        def keys(self) -> list[str]:
            return self._f.keys()

        def get_slice(self, name: str):  # noqa: ANN201
            return self._f.get_slice(name)

        def get_tensor(self, name: str) -> torch.Tensor:
            alive_at_read.append(sum(r() is not None for r in raw))
            t = self._f.get_tensor(name)
            raw.append(weakref.ref(t))
            return t

    def no_bulk(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the loader must not read whole files at once")

    monkeypatch.setattr(safetensors, "safe_open", SpyFile)
    monkeypatch.setattr("safetensors.torch.load_file", no_bulk)
    monkeypatch.setattr("safetensors.torch.load", no_bulk)
    _, w = load_checkpoint(tmp_path, dtype=torch.float32)  # bf16 on disk: every tensor converts
    assert len(alive_at_read) == len(w) == len(expected_shapes(cfg))  # each read exactly once
    assert max(alive_at_read) == 0, alive_at_read
    assert all(t.dtype == torch.float32 for t in w.values())


# ---- random weights ------------------------------------------------------------------------------
def test_random_weights_are_deterministic_and_seeded() -> None:
    cfg = PRESETS["qwen3-tiny"]
    a, b, c = random_weights(cfg, 7), random_weights(cfg, 7), random_weights(cfg, 8)
    assert list(a) == list(expected_shapes(cfg))
    assert all(tuple(a[n].shape) == s for n, s in expected_shapes(cfg).items())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(torch.equal(a[n], c[n]) for n in a)
    flat = [t.flatten()[:64] for t in a.values() if t.dim() == 2]  # tensors differ from each other
    assert len({tuple(t.tolist()) for t in flat}) == len(flat)


def test_random_weights_same_model_in_every_dtype() -> None:
    cfg = PRESETS["llama-tiny"]
    bf = random_weights(cfg, 2, torch.bfloat16)
    for dt in (torch.float32, torch.float16):
        other = random_weights(cfg, 2, dt)
        for n in bf:
            assert other[n].dtype == dt
            torch.testing.assert_close(other[n].float(), bf[n].float(), rtol=1e-3, atol=1e-6)
    f32 = random_weights(cfg, 2, torch.float32)
    assert all(torch.equal(f32[n], bf[n].float()) for n in bf)  # bf16-representable
    with pytest.raises(WeightError, match="unsupported dtype"):
        random_weights(cfg, 2, torch.int8)


def test_random_weight_scales() -> None:
    cfg = PRESETS["llama-mid"]
    w = random_weights(cfg, 0, torch.float32)
    h, i, n_layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers

    def std(name: str) -> float:
        return w[name].std().item()

    gain = mw.QK_GAIN
    assert abs(std("model.layers.0.self_attn.q_proj.weight") * h**0.5 / gain - 1) < 0.05
    assert abs(std("model.layers.0.self_attn.v_proj.weight") * h**0.5 - 1) < 0.05
    assert abs(std("model.layers.1.mlp.up_proj.weight") * h**0.5 - 1) < 0.05
    res = (i * 2 * n_layers) ** 0.5 / mw.RESIDUAL_GAIN
    assert abs(std("model.layers.0.mlp.down_proj.weight") * res - 1) < 0.05
    assert abs(std("model.embed_tokens.weight") * h**0.5 - 1) < 0.05
    norm = w["model.layers.1.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1) < 0.02 and 0.05 < norm.std().item() < 0.15
    qn = random_weights(PRESETS["qwen3-tiny"], 0)["model.layers.0.self_attn.q_norm.weight"].float()
    assert abs(qn.mean().item() / mw.QK_GAIN - 1) < 0.05


def test_random_depth_stability_in_transformers() -> None:
    """32 layers, tiny width: the residual stream's RMS stays in a band after every layer."""
    for family in ("llama", "qwen3"):
        cfg = ModelConfig(family, 256, 64, 32, 4, 2, 16, 160, 1e-5, RopeConfig(1e4), True, 256)
        model = hf_model(cfg)
        model.load_state_dict(random_weights(cfg, 5, torch.float32), strict=False)
        model.tie_weights()
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        assert len(out.hidden_states) == cfg.num_layers + 1
        rms = [h.pow(2).mean().sqrt().item() for h in out.hidden_states[:-1]]  # last is normed
        assert abs(rms[0] * cfg.hidden_size**0.5 - 1) < 0.1  # embedding rows
        assert all(0.08 < r < 2.0 for r in rms), rms
        assert rms[-1] > 0.3, rms  # the layers add to the stream, they do not vanish
        assert all(b < 1.5 * a for a, b in zip(rms[1:], rms[2:], strict=False)), rms  # smooth
        logits = out.logits
        assert torch.isfinite(logits).all() and 0.3 < logits.std().item() < 10


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_random_depth_stability_in_reference(mode: str) -> None:
    """The reference on 32 layers of random weights: finite logits that depend on the prompt."""
    from reference.model import ReferenceModel, generate

    cfg = ModelConfig("qwen3", 512, 64, 32, 4, 2, 16, 160, 1e-6, RopeConfig(1e6), True, 256)
    model = ReferenceModel(cfg, random_weights(cfg, 11), mode=mode)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in range(2, 10)]
    logits = model.prefill(model.new_cache(len(prompts), 16), prompts)  # [B, V]
    assert torch.isfinite(logits).all()
    std = logits.std(dim=-1)
    assert ((std > 0.3) & (std < 10)).all(), std
    corr = torch.corrcoef(logits)  # [B, B]: prompts are not mapped to one output
    off_diag = corr[~torch.eye(len(prompts), dtype=torch.bool)]
    assert off_diag.abs().max() < 0.5, corr
    assert len(set(logits.argmax(-1).tolist())) >= len(prompts) - 2
    echo = sum(int(t) == p[-1] for t, p in zip(logits.argmax(-1), prompts, strict=True))
    assert echo <= 1  # a tied head does not just repeat the input token
    tokens = generate(model, prompts, steps=12)
    assert [t[0] for t in tokens] == logits.argmax(-1).tolist()
    # Greedy decoding of random models falls into loops; sharp attention keeps them rare enough
    # for token-level comparisons (with near-uniform attention this mean is below 2).
    mean_distinct = sum(len(set(t)) for t in tokens) / len(tokens)
    assert mean_distinct >= 4, tokens


def test_random_weights_accept_a_real_preset_shape() -> None:
    """Random weights for a real preset's layer shapes (one layer, to stay fast)."""
    cfg = PRESETS["qwen3-0.6b"].replace(num_layers=1, vocab_size=4096)
    w = random_weights(cfg, 0)
    assert all(tuple(w[n].shape) == s for n, s in expected_shapes(cfg).items())
    assert all(t.dtype == torch.bfloat16 for t in w.values())


# ---- load_model ----------------------------------------------------------------------------------
def test_load_model_preset_and_directory(tmp_path: Path) -> None:
    cfg, w = load_model("llama-tiny", seed=4)
    assert cfg is PRESETS["llama-tiny"]
    ref = random_weights(cfg, 4)
    assert all(torch.equal(w[n], ref[n]) for n in ref)

    model = hf_model(tiny("qwen3", tied=False))
    model.save_pretrained(tmp_path / "ckpt")
    cfg2, w2 = load_model(str(tmp_path / "ckpt"), dtype=torch.float32)
    assert cfg2.family == "qwen3" and w2["lm_head.weight"].dtype == torch.float32
    assert torch.equal(w2["lm_head.weight"], model.state_dict()["lm_head.weight"])

    with pytest.raises(ConfigError, match="'no-such-model' is neither a preset"):
        load_model("no-such-model")

