"""Shared by the kernel tests of the hybrid slices: one preset built on both weight paths for both
archs, and the resource rules every build must meet."""

from __future__ import annotations

from collections.abc import Callable

from megakernel.kernel import spec as spec_mod
from megakernel.models import preset

# B = 1 on the default pipeline, B = 4 on the global-memory path
VARIANT_BUILDS = [(1, None), (4, 0)]


def variant_builds(kernel_build: Callable, name: str, **variant) -> dict:  # noqa: ANN003
    """(arch, batch, smem_stages) -> (arch dir, manifest) of preset `name` (session cache;
    `variant`: other make_spec switches, e.g. replay_window)."""
    return {(arch, b, st): kernel_build(preset(name), arch, b, 1, smem_stages=st, **variant)
            for arch in spec_mod.ARCHS for b, st in VARIANT_BUILDS}


def specs_within_budgets(builds: dict) -> dict:
    """Assert every build has no spills, no local memory, registers within the budget and a real
    cubin; return each build's KernelSpec (from its manifest) for the caller's own checks."""
    out = {}
    for key, (d, m) in builds.items():
        r = m["resources"]
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (key, r)
        assert r["local_bytes"] == 0 and r["local_stores"] == 0 and r["local_loads"] == 0, r
        assert 0 < r["registers"] <= spec_mod.REGISTER_BUDGET, (key, r["registers"])
        assert (d / "megakernel.cubin").stat().st_size > 10_000
        out[key] = spec_mod.KernelSpec.from_dict(m["spec"])
    return out
