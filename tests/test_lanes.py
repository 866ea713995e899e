"""The test lanes (tests/lanes.py): a test's lane follows from what it uses, and every package under
megakernel/ has a fast test."""

from __future__ import annotations

import pytest

from tests import lanes

PLANTED = """
import subprocess

def runs_the_cli():
    return subprocess.run(["true"], check=False)

def calls_a_helper_that_runs_the_cli():
    return runs_the_cli()

def plain():
    return sum(range(3))
"""


def planted() -> dict:
    """The plants as functions of a module of the test tree (compiled here, so that this test's
    own code uses none of them and stays in the fast lane)."""
    ns: dict = {}
    exec(compile(PLANTED, str(lanes.TESTS / "planted.py"), "exec"), ns)  # noqa: S102
    return ns


def test_a_test_is_slow_for_what_it_uses_and_through_its_helpers():
    """Planted uses: a subprocess two helpers deep, a kernel build named as a fixture or a
    function, a transformers checkpoint; a test without them is fast."""
    ns = planted()
    deep, plain = ns["calls_a_helper_that_runs_the_cli"], ns["plain"]
    assert lanes.slow_reasons(lanes.uses([deep])) == ["subprocess"]
    assert lanes.slow_reasons(lanes.uses([plain], extra={"kernel_build"})) == ["kernel builds"]
    assert lanes.slow_reasons(lanes.uses([plain], extra={"hf_checkpoint"})) == [
        "transformers checkpoints"]
    assert lanes.slow_reasons(lanes.uses([plain], extra={"SMOLLM2"})) == ["real models"]
    assert lanes.slow_reasons(lanes.uses([plain])) == []
    assert lanes.slow_reasons(lanes.uses([lambda: lanes.TESTS.exists()])) == []


def test_kernel_builds_are_slow_but_the_lanes_own(request):  # noqa: ANN001
    """Of the collected tests, every one that requests kernel_build is marked slow, and the fast
    lane's own build (lane_build) is not."""
    for item in request.session.items:
        marked = item.get_closest_marker("slow") is not None
        if "kernel_build" in item.fixturenames:
            assert marked, item.nodeid
        if item.nodeid.startswith("tests/kernel/test_kernel_lane.py"):
            assert "lane_build" in item.fixturenames and not marked, item.nodeid


def test_every_package_has_a_fast_test(request, lane_info):  # noqa: ANN001
    """Each package under megakernel/ is imported by the module of at least one fast test."""
    root = request.config.rootpath
    args = {(root / a.split("::")[0]).resolve() for a in request.config.args} or {lanes.TESTS}
    if args != {lanes.TESTS}:
        pytest.skip("a partial collection: the coverage is checked when the whole suite is "
                    "collected (make test)")
    covered = set()
    for reasons, packages in lane_info.values():
        if not reasons:
            covered |= packages
    missing = lanes.all_packages() - covered
    assert not missing, f"packages without a fast test: {sorted(missing)}"
