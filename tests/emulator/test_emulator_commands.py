"""The emulator as a user reaches it: `generate --backend emulator` (the build made here through the
DSL) and `gpu-check --emulate` end to end on the prepared stage-0 builds (slow lane: builds and
subprocesses, as a user runs them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def cli(*argv: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megakernel", *argv], capture_output=True,
                          text=True, timeout=timeout)


def new_tokens(out: str) -> list[int]:
    line = next(s for s in out.splitlines() if "new tokens [" in s)
    return json.loads(line.split("new tokens ", 1)[1])


def test_generate_on_the_emulator_gives_the_executors_tokens(tmp_path: Path) -> None:
    args = ("generate", "--model", "qwen3.5-tiny", "--prompt-ids", "5,17,3", "--steps", "3",
            "--replay-window", "4")
    emu = cli(*args, "--backend", "emulator")
    assert emu.returncode == 0, emu.stderr[-3000:]
    assert "backend emulator" in emu.stdout
    ex = cli(*args, "--backend", "cpu-executor")
    assert ex.returncode == 0, ex.stderr[-3000:]
    assert new_tokens(emu.stdout) == new_tokens(ex.stdout)
    assert len(new_tokens(emu.stdout)) == 3


def test_gpu_check_emulate_runs_stage_0_on_both_variants(tmp_path: Path) -> None:
    builds, out = tmp_path / "builds", tmp_path / "report"
    p = cli("gpu-check", "--prepare", "--stages", "0", "--build-dir", str(builds),
            "--arch", "sm_90a")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = cli("gpu-check", "--emulate", "--stages", "0", "--build-dir", str(builds),
            "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gpu-check (emulated) PASS: 2/2" in r.stdout
    d = json.loads((out / "gpu_check.json").read_text())
    assert d["emulated"] and d["device"] == "PTX emulator"
    by_variant = {c["variant"]: c for c in d["cases"]}
    assert set(by_variant) == {"global", "default"}
    assert by_variant["global"]["smem_stages"] == 0 and by_variant["default"]["smem_stages"] > 0
    for c in d["cases"]:  # the real verdicts ran: the references and the executor
        assert c["emulated"] and c["ok"] and c["executor_ok"] and c["deterministic"]
        assert c["steps"] >= 3 and 0 < c["max_err_kernel"] <= c["max_allowed"]
    assert "EMULATED" in (out / "gpu_check.md").read_text()


def test_gpu_check_emulate_without_builds_skips_every_case_by_name(tmp_path: Path) -> None:
    r = cli("gpu-check", "--emulate", "--stages", "0", "--build-dir", str(tmp_path / "none"),
            "--out", str(tmp_path / "report"))
    d = json.loads((tmp_path / "report" / "gpu_check.json").read_text())
    assert not d["cases"] and len(d["skipped"]) == 2
    assert all("no sm_90a build" in s["why"] for s in d["skipped"])
    assert r.returncode != 0  # nothing ran: not a pass
