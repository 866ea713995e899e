"""Speculative builds (layers/speculative.py; kernel/device/speculative.py, commit.py, ACCEPT in
megakernel.py) for both archs within the budgets: the configurations the brief lists, each with
its handlers compiled in (ACCEPT in place of ARGMAX, NGRAM with the device drafter, the kinds'
COMMIT), and the PTX of an n-gram build holding the drafter's warp maxima. Slow lane (kernel
builds; tests/lanes.py)."""

from __future__ import annotations

import pytest

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.models import preset
from tests.kernel.helpers import specs_within_budgets

# (model, batch, drafts, ngram, replay window); llama-3.2-1b's k = 3 takes attention's
# several-queries-a-warp path (QB = 2) and the drafter
BUILDS = [("qwen3.5-tiny", 1, 3, 0, 16),
          ("nemotron-h-tiny", 1, 3, 0, 16), ("kimi-linear-tiny", 2, 1, 0, 16),
          ("llama-3.2-1b", 1, 3, 3, 0)]


@pytest.mark.parametrize("model,batch,drafts,ngram,window", BUILDS)
def test_speculative_builds_within_budgets(kernel_build, model, batch, drafts, ngram, window):
    builds = {arch: kernel_build(preset(model), arch, batch, 1 + drafts, drafts=drafts,
                                 ngram=ngram, replay_window=window) for arch in ARCHS}
    for arch, spec in specs_within_budgets(builds).items():
        names = {isa.spec(op).name for op in spec.ops}
        assert spec.drafts == drafts and spec.ngram == ngram and spec.tokens == 1 + drafts
        assert "ACCEPT" in names and "ARGMAX" not in names and ("NGRAM" in names) == bool(ngram)
        commits = {n for n in names if n.endswith("_COMMIT")}
        assert bool(commits) == bool(window), (arch, commits)
        if ngram:  # the drafter's butterfly max and the shared-memory words
            ptx = (builds[arch][0] / "megakernel.ptx").read_text()
            assert "shfl.sync.bfly" in ptx
