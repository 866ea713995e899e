"""Shared fixtures: tiny Hugging Face oracle models saved and reloaded through our loader, the
fast lane's one kernel build per arch (`lane_build`).

Also decides each test's lane (tests/lanes.py: `slow` from what the test uses; `make test` runs
the rest) and collects numerics measurements (`record_numerics`), printed at the end of the run
so that the measured errors appear in every test log without `-s`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megakernel.models import ModelConfig
from tests import lanes

_NUMERICS: list[tuple[str, str]] = []

# module -> pip package: a CI run where one of these does not import fails instead of skipping
# the tests that need it. Without torch this conftest does not import at all (also an error).
HARD_DEPENDENCIES = {"torch": "torch", "safetensors": "safetensors",
                     "cutlass": "nvidia-cutlass-dsl"}
WITHOUT_DSL = "MEGAKERNEL_TEST_WITHOUT_DSL"  # =1: a machine that cannot install the DSL


def pytest_sessionstart(session) -> None:  # noqa: ANN001 (pytest hook)
    """Fail the run, naming the package, when a hard dependency does not import (the DSL's tests
    would otherwise skip and the suite pass). WITHOUT_DSL=1 waives the DSL only: its tests skip."""
    waived = {"cutlass"} if os.environ.get(WITHOUT_DSL) == "1" else set()
    problems = []
    for module, package in HARD_DEPENDENCIES.items():
        if module in waived:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 (a broken install raises more than ImportError)
            problems.append(f"{module} (pip package {package}) does not import: "
                            f"{type(e).__name__}: {e}")
    if problems:
        pytest.exit("; ".join(problems) + f". Install it (make setup); for the DSL only, "
                    f"{WITHOUT_DSL}=1 runs the suite with the DSL's tests skipped.",
                    returncode=pytest.ExitCode.USAGE_ERROR)


# fixtures the fast lane may use although they build the kernel: its one small build per arch
FAST_FIXTURES = frozenset({"lane_build"})
LANES = pytest.StashKey[dict]()  # nodeid -> (slow reasons, megakernel packages its module imports)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 (pytest hook)
    """Mark `slow` every test that uses a slow resource (tests/lanes.py), with the reason; keep
    what each test touches for test_lanes.py's coverage check."""
    info = {}
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs if fixtures else {}
        funcs = [getattr(item, "function", None)] + [
            d[-1].func for name, d in defs.items() if d and name not in FAST_FIXTURES]
        names = lanes.uses(funcs, extra=set(getattr(item, "fixturenames", ())) - FAST_FIXTURES)
        callspec = getattr(item, "callspec", None)
        names |= lanes.param_names(callspec.params) if callspec else set()
        reasons = sorted(set(lanes.slow_reasons(names))
                         | set(lanes.param_reasons(callspec.params if callspec else {})))
        if item.get_closest_marker("slow"):  # `make test-slow` runs what a test marks itself
            reasons = reasons or ["marked slow"]
        elif reasons:
            item.add_marker(pytest.mark.slow(reason=", ".join(reasons)))
        info[item.nodeid] = (reasons, lanes.packages(item.module) if hasattr(item, "module")
                             else set())
    config.stash[LANES] = info


@pytest.fixture(scope="session")
def lane_info(request) -> dict:  # noqa: ANN001
    """nodeid -> (slow reasons, megakernel packages its module imports) of this collection."""
    return request.config.stash[LANES]


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tests run tiny ops: one intra-op thread is much faster than two fighting over two cores.
    Session-scoped, so that module-scoped fixtures run on one thread too."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@dataclass
class HFCheckpoint:
    """A tiny random Hugging Face model, its saved directory, and the weights our loader read."""

    hf_model: torch.nn.Module  # fp32, eager attention, eval mode
    path: Path
    cfg: ModelConfig  # as read back from config.json by load_checkpoint
    weights: dict[str, torch.Tensor]  # as read back by load_checkpoint


BIAS_STD = 0.5  # q/k/v biases of the oracle models: comparable to the projections' outputs


def build_hf_model(cfg: ModelConfig, seed: int, init_std: float) -> torch.nn.Module:
    """HF LlamaForCausalLM / Qwen3ForCausalLM / Qwen2ForCausalLM for a dense `cfg` with HF's
    random init at `init_std`.

    HF initialises norm weights to ones and biases to zeros; they are perturbed to
    1 + N(0, 0.1^2) and N(0, BIAS_STD^2), so that a model which ignored a norm weight or a bias
    would not match.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    cls_cfg, cls_model = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[cfg.family]
    hf_cfg = cls_cfg(**cfg.to_hf_dict(), initializer_range=init_std)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls_model(hf_cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(BIAS_STD * torch.randn(p.shape, generator=gen))
    return model


def _load(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a checkpoint back through the project's loader (fp32)."""
    from megakernel.models.weights import load_checkpoint

    return load_checkpoint(path, dtype=torch.float32)


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Callable[..., HFCheckpoint]:
    """Factory: (cfg, seed, init_std) -> HFCheckpoint, saved with save_pretrained (safetensors)."""

    def make(cfg: ModelConfig, seed: int = 0, init_std: float = 0.1) -> HFCheckpoint:
        model = build_hf_model(cfg, seed, init_std)
        path = tmp_path / f"{cfg.family}-seed{seed}"
        model.save_pretrained(path)
        assert (path / "model.safetensors").is_file(), sorted(p.name for p in path.iterdir())
        loaded_cfg, weights = _load(path)
        return HFCheckpoint(model, path, loaded_cfg, weights)

    return make


@pytest.fixture
def record_numerics(request) -> Callable[[str, str], None]:  # noqa: ANN001
    """record_numerics(label, text): print now and repeat in the end-of-run summary (carried in
    the test's report, so that it reaches the summary from a pytest-xdist worker too)."""

    def record(label: str, text: str) -> None:
        print(f"{label}: {text}")
        request.node.user_properties.append(("numerics", (label, text)))

    return record


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 (pytest hook)
    if report.when == "call":
        _NUMERICS.extend(v for k, v in report.user_properties if k == "numerics")


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 (pytest hook)
    if _NUMERICS:
        terminalreporter.section("reference numerics (measured)")
        for label, text in _NUMERICS:
            terminalreporter.write_line(f"{label}: {text}")
