"""`generate` on hybrid models: recurrent and ReplaySSM give the same greedy tokens."""

from __future__ import annotations

import json

import pytest

from megakernel import cli


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("model", ["qwen3.5-tiny", "kimi-linear-tiny", "nemotron-h-tiny"])
def test_replay_window_matches_recurrent(capsys, model):
    args = ("generate", "--model", model, "--prompt-ids", "5,17,3,101;7,1", "--steps", "6",
            "--dtype", "fp32", "--json")
    rc, out, _ = _run(capsys, *args)
    assert rc == 0
    recurrent = json.loads(out.strip().splitlines()[-1])
    rc, out, _ = _run(capsys, *args, "--replay-window", "4")
    assert rc == 0
    replay = json.loads(out.strip().splitlines()[-1])
    assert replay["replay_window"] == 4 and recurrent["replay_window"] == 0
    assert [len(t) for t in replay["tokens"]] == [6, 6]
    assert replay["tokens"] == recurrent["tokens"]


def test_replay_window_on_dense_model_is_refused(capsys):
    rc, _, err = _run(capsys, "generate", "--model", "llama-tiny", "--replay-window", "4")
    assert rc == 2 and "hybrid models only" in err


def test_hybrid_on_unsupported_backend_is_refused(capsys):
    for model in ("qwen3.5-tiny", "kimi-linear-tiny", "nemotron-h-tiny"):
        rc, _, err = _run(capsys, "generate", "--model", model, "--backend", "kernel")
        assert rc == 2 and "does not serve hybrid models" in err


@pytest.mark.parametrize("model, window", [("qwen3.5-tiny", None), ("qwen3.5-tiny", "3"),
                                           ("nemotron-h-tiny", "2"), ("kimi-linear-tiny", None),
                                           ("kimi-linear-tiny", "2")])
def test_cpu_executor_matches_reference(capsys, model, window):
    args = ("generate", "--model", model, "--prompt-ids", "5,17,3,101;7,1", "--steps",
            "5", "--json")
    extra = () if window is None else ("--replay-window", window)
    rc, out, _ = _run(capsys, *args, *extra)
    assert rc == 0
    ref = json.loads(out.strip().splitlines()[-1])
    rc, out, _ = _run(capsys, *args, *extra, "--backend", "cpu-executor")
    assert rc == 0
    ex = json.loads(out.strip().splitlines()[-1])
    assert ex["backend"] == "cpu-executor" and ex["replay_window"] == int(window or 0)
    assert [len(t) for t in ex["tokens"]] == [5, 5]
    assert ex["tokens"] == ref["tokens"]


def test_unknown_model_lists_both_kinds_of_preset(capsys):
    rc, _, err = _run(capsys, "generate", "--model", "no-such-model")
    assert rc == 2 and "llama-tiny" in err and "qwen3.5-tiny" in err
