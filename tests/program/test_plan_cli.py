"""`python -m megakernel plan`: every family, JSON and errors."""

from __future__ import annotations

import json

import pytest


def test_plan_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    from megakernel.cli.main import main

    assert main(["plan", "--model", "llama-tiny", "--gpu", "h100", "--batch", "2", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    for key in ("predicted_step_us", "floor_us", "predicted_efficiency", "bytes_per_step"):
        assert key in r
    assert r["predicted_efficiency"] == pytest.approx(r["floor_us"] / r["predicted_step_us"],
                                                      abs=1e-3)
    assert r["tokens_per_s_per_user"] == pytest.approx(1e6 / r["predicted_step_us"], rel=1e-3)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(2 * r["tokens_per_s_per_user"], rel=1e-3)
    assert any("instructions per opcode" in line for line in out)
    assert any("tokens/s per GPU" in line for line in out)


def test_plan_cli_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    from megakernel.cli.main import main

    assert main(["plan", "--model", "llama-tiny", "--gpu", "a100"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--batch", "256",
                 "--max-seq-len", "8192"]) == 2
    assert "too many sequences" in capsys.readouterr().err


@pytest.mark.parametrize("name,window", [("qwen3.5-tiny", None), ("nemotron-h-tiny", 4),
                                         ("kimi-linear-tiny", 2)])
def test_plan_takes_every_family(name: str, window: int | None,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    from megakernel.cli.main import main

    argv = ["plan", "--model", name, "--gpu", "h200", "--batch", "2", "--json"]
    if window:
        argv += ["--replay-window", str(window)]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["family"] == preset_family(name) and r["replay_window"] == (window or 0)
    assert r["predicted_step_us"] > r["floor_us"] > 0
    cats = r["bytes_by_category"]
    assert cats["state_read"] > 0 and cats["total"] == pytest.approx(r["bytes_per_step"], abs=1)


def preset_family(name: str) -> str:
    from megakernel.models import preset

    return preset(name).family


def test_plan_refuses_a_replay_window_without_recurrent_layers(
        capsys: pytest.CaptureFixture[str]) -> None:
    from megakernel.cli.main import main

    assert main(["plan", "--model", "llama-tiny", "--replay-window", "4"]) == 2
    assert "replay_window applies to models with recurrent layers" in capsys.readouterr().err
