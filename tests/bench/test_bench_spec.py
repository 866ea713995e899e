"""bench/spec.py: the speculative step against the plain one in the cost model, the tokens/s
arithmetic, and the targets judged on the rows (met and not met both reported)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megakernel.program.gpus import gpu

_spec = importlib.util.spec_from_file_location(
    "bench_spec", Path(__file__).resolve().parents[2] / "bench" / "spec.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_spec"] = bench
_spec.loader.exec_module(bench)

H100 = gpu("h100")


def test_rows_are_the_programs_predictions():
    from megakernel.models import preset
    from megakernel.program.compiler import compile_program

    rows = bench.bench_model("llama-tiny", [1, 3], [1], H100, 0.5, 16)
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 1), (1, 3)]
    plain = compile_program(preset("llama-tiny"), 1, H100).cost.predicted_s
    three = compile_program(preset("llama-tiny"), 1, H100, drafts=3, ngram=3).cost.predicted_s
    r = rows[1]
    assert r["plain_step_us"] == round(plain * 1e6, 2)
    assert r["spec_step_us"] == round(three * 1e6, 2)
    assert r["tokens_per_step"] == pytest.approx(1.875)
    assert r["speedup"] == pytest.approx(1.875 * plain / three, rel=1e-3)
    assert r["replay_window"] == 0


def test_recurrent_models_use_replay():
    rows = bench.bench_model("qwen3.5-tiny", [2], [1], H100, 0.7, 8)
    assert rows[0]["replay_window"] == 8 and rows[0]["spec_step_us"] > 0


def row(model: str, k: int, ratio: float, speedup: float, batch: int = 1) -> dict:
    return dict(model=model, batch=batch, k=k, step_ratio=ratio, speedup=speedup,
                acceptance=0.7)


def test_targets_judge_the_worst_small_k_and_the_best_speedup():
    rows = [row("llama-3.2-1b", 1, 1.10, 1.4), row("llama-3.2-1b", 3, 1.20, 1.9),
            row("llama-3.2-1b", 5, 2.0, 1.2), row("llama-3.2-1b", 3, 1.0, 3.0, batch=8),
            row("qwen3.5-0.8b", 2, 1.05, 1.5)]
    t = {(x["model"], x["target"].split()[0]): x for x in bench.targets(rows)}
    step = t[("llama-3.2-1b", "1")]
    assert step["value"] == 1.20 and step["at"] == "k = 3" and not step["met"]
    fast = t[("llama-3.2-1b", "tokens/s")]
    assert fast["value"] == 1.9 and fast["met"]  # the B = 8 row is not judged
    assert t[("qwen3.5-0.8b", "1")]["met"] and not t[("qwen3.5-0.8b", "tokens/s")]["met"]
    assert not any(x["model"] == "nemotron-h-8b" for x in bench.targets(rows))


def test_main_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert bench.main(["--models", "llama-tiny", "--ks", "1", "--gpu", "h100",
                       "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| llama-tiny | 1 | 1 |" in text and "runtime" in text
    data = json.loads(out.read_text())
    assert data["rows"][0]["k"] == 1 and data["acceptance"] == 0.7


@pytest.mark.parametrize("argv,needle", [(["--ks", "8"], "--ks must be in [1, 7]"),
                                         (["--acceptance", "2"], "a probability in [0, 1]")])
def test_bad_arguments(argv, needle):
    from megakernel.common.errors import UserError

    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        bench.main(["--models", "llama-tiny", *argv])
