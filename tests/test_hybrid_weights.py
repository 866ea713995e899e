"""Hybrid weights: what transformers' save_pretrained writes loads through our loader (and runs to
the same logits), published layouts (multimodal Qwen3.5 prefix, sharded files, renamed prefixes)
load, bad checkpoints are refused with a message naming the tensor, random init is deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megakernel.hybrid.config import preset
from megakernel.hybrid.weights import (
    WeightError,
    expected_shapes,
    load_checkpoint,
    load_model,
    random_weights,
    save_checkpoint,
)
from reference.hybrid import build_model

TINY = ["qwen3.5-tiny", "kimi-linear-tiny", "nemotron-h-tiny"]


@pytest.mark.parametrize("name", TINY)
def test_transformers_checkpoint_loads_and_runs(name: str, tmp_path: Path) -> None:
    """A transformers-initialised model, saved by save_pretrained (which reverts its load-time
    conversions: unfused experts, split convs, `backbone.`), loads and gives its logits."""
    import transformers

    cfg = preset(name)
    cls = {"qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
           "kimi_linear": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM),
           "nemotron_h": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM)}
    cfg_cls, model_cls = cls[cfg.family]
    torch.manual_seed(5)
    hf = model_cls(cfg_cls(**cfg.to_hf_dict(), initializer_range=0.2)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():  # perturb what HF initialises to constants
            if p.dim() == 1 and not n.endswith(("A_log", "dt_bias", "D")):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    loaded_cfg, weights = load_checkpoint(tmp_path, dtype=torch.float32)
    assert loaded_cfg.replace(name=name) == cfg
    assert {n: tuple(t.shape) for n, t in weights.items()} == expected_shapes(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = hf(prompt).logits[0, -1]
    model = build_model(cfg, weights)
    got = model.prefill(model.new_cache(1, 16), prompt.tolist())[0]
    assert want.std() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_qwen35_multimodal_layout(tmp_path: Path) -> None:
    """Published Qwen3.5 checkpoints: nested text_config, `model.language_model.` prefix, vision
    tower and MTP head present (skipped), two shards with an index."""
    cfg = preset("qwen3.5-tiny")
    weights = random_weights(cfg, seed=3, dtype=torch.bfloat16)
    renamed = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n:
               t for n, t in weights.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(6, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for fname, part in shards.items():
        save_file({n: renamed[n] for n in part}, str(tmp_path / fname))
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    text = cfg.to_hf_dict()
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": False, "text_config": {**text, "architectures": None},
           "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(top))
    loaded_cfg, loaded = load_checkpoint(tmp_path)
    assert loaded_cfg.replace(name="qwen3.5-tiny") == cfg
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[n], weights[n]) for n in weights)
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())


def test_alternative_prefixes(tmp_path: Path) -> None:
    """Nemotron-H under transformers' `model.` names; Kimi's dense MLP under `mlp.`."""
    cfg = preset("nemotron-h-tiny")
    weights = random_weights(cfg, seed=4, dtype=torch.float32)
    path = save_checkpoint(cfg, weights, tmp_path / "nemo")
    save_file({n.replace("backbone.", "model.", 1): t for n, t in weights.items()},
              str(path / "model.safetensors"))
    _, loaded = load_checkpoint(path)
    assert all(torch.equal(loaded[n], weights[n]) for n in weights)
    kimi = preset("kimi-linear-tiny")
    kw = random_weights(kimi, seed=4, dtype=torch.float32)
    assert "model.layers.0.mlp.gate_proj.weight" in kw
    _, loaded = load_checkpoint(save_checkpoint(kimi, kw, tmp_path / "kimi"))
    assert all(torch.equal(loaded[n], kw[n]) for n in kw)


def _broken(tmp_path: Path, edit) -> Path:
    cfg = preset("kimi-linear-tiny")
    weights = random_weights(cfg, seed=8, dtype=torch.float32)
    edit(weights)
    return save_checkpoint(cfg, weights, tmp_path)


def test_bad_checkpoints_are_refused(tmp_path: Path) -> None:
    moe = "model.layers.1.block_sparse_moe."
    path = _broken(tmp_path / "a", lambda w: w.pop(moe + "experts.5.w3.weight"))
    with pytest.raises(WeightError, match=r"missing tensor 'model.layers.1.block_sparse_moe."
                                          r"experts.5.w3.weight' \(expected shape \[32, 64\]\)"):
        load_checkpoint(path)
    path = _broken(tmp_path / "b", lambda w: w.update(
        {"model.layers.0.self_attn.A_log": torch.zeros(2)}))
    with pytest.raises(WeightError, match=r"tensor 'model.layers.0.self_attn.A_log' has shape "
                                          r"\[2\], expected \[1, 1, 2, 1\]"):
        load_checkpoint(path)
    path = _broken(tmp_path / "c", lambda w: w.update({moe + "experts.8.w1.weight":
                                                        torch.zeros(32, 64)}))
    with pytest.raises(WeightError, match=r"unexpected tensor 'model.layers.1.block_sparse_moe."
                                          r"experts.8.w1.weight'"):
        load_checkpoint(path)
    with pytest.raises(WeightError, match=r"does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(preset("qwen3.5-tiny").to_hf_dict()))
    with pytest.raises(WeightError, match=r"no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(tmp_path / "d")
    cfg = preset("qwen3.5-tiny")
    weights = random_weights(cfg, dtype=torch.float32)
    weights.pop("model.norm.weight")
    with pytest.raises(WeightError, match=r"missing tensor 'model.norm.weight'"):
        build_model(cfg, weights)


def test_random_weights() -> None:
    cfg = preset("kimi-linear-tiny")
    a = random_weights(cfg, seed=1, dtype=torch.float32)
    b = random_weights(cfg, seed=1, dtype=torch.bfloat16)
    c = random_weights(cfg, seed=2, dtype=torch.float32)
    assert {n: tuple(t.shape) for n, t in a.items()} == expected_shapes(cfg)
    for n in a:
        assert torch.equal(a[n], b[n].float()), n  # one model for both dtypes
        assert not torch.equal(a[n], c[n]), n
    a_log = a["model.layers.0.self_attn.A_log"]
    assert (a_log >= 0).all() and (a_log.exp() <= 16.1).all()
    dt = torch.nn.functional.softplus(a["model.layers.0.self_attn.dt_bias"])
    assert (dt > 5e-4).all() and (dt < 0.2).all()
    with pytest.raises(WeightError, match=r"unsupported dtype torch.int8"):
        random_weights(cfg, dtype=torch.int8)
    cfg2, w2 = load_model("nemotron-h-tiny", seed=3, dtype=torch.float32)
    assert cfg2 is preset("nemotron-h-tiny") and w2.keys() == expected_shapes(cfg2).keys()
