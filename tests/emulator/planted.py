"""Planted bugs: single-line mutations of the device code that the emulator must catch.

Each `Mutant` changes one line of one device-code module (kernel/device/*.py; none in the
host/*_index helpers, which the index emulations already execute). `run_mutant` copies the package
and the tests into a scratch tree, applies the mutation there (never to the checkout), and runs one
emulated case in a subprocess whose imports resolve to the copy, with its own JIT cache (the build
fingerprint covers the device sources, so the mutant is compiled afresh). The verdict:

- "fault": the emulator stopped the launch (deadlock, barrier misuse, a trap of the kernel's
  own checks, a bad access), naming the PTX line;
- "wrong": the launch finished, and tokens, logits, KV cache or state differ from the executor's;
- "ok": nothing noticed (for a mutant: not caught);
- "broken": the mutant did not build or the case raised something else (not a valid mutant);
- "hang": no verdict within the time limit (the deadlock detector missed it: not caught).

`python -m tests.emulator.planted [--prior] [names...]` prints the table docs/TESTING.md keeps;
`--prior` also runs, on each mutant, every test that existed before the emulator (the fast lane
less the emulator's own tests) and reports whether any of them failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megakernel.gpu_check.emulated import Case

ROOT = Path(__file__).resolve().parents[2]
# not copied into the scratch tree: what git ignores there (environments, build outputs, caches)
SKIPPED = (".git", ".venv*", "out", "__pycache__", "*.egg-info", ".ruff_cache", ".pytest_cache")
RESULT = "PLANTED-RESULT "
# tests that run the emulator (added with it): excluded from the "tests that existed before"
EMULATOR_TESTS = ("tests/emulator", "tests/kernel/test_kernel_emulated.py")
# tests that cannot pass on a scratch copy for reasons of the copy: with the emulator's tests left
# out the lane check misses the emulator package's fast test, and `megakernel.reference` resolves
# through the checkout's editable install, not the copy
LEFT_OUT = ("tests/test_lanes.py::test_every_package_has_a_fast_test",
            "tests/reference/test_reference_packaging.py::"
            "test_code_imports_the_reference_by_its_package_name")


@dataclass(frozen=True)
class Mutant:
    """One planted bug: in `file` (under megakernel/kernel/device/) the text `old` (unique in the
    file, context lines included) becomes `new`, which differs from it in exactly one line."""

    name: str
    what: str
    file: str
    old: str
    new: str
    case: Case

    def apply(self, text: str) -> str:
        if text.count(self.old) != 1:
            raise ValueError(f"mutant {self.name}: the text to replace occurs "
                             f"{text.count(self.old)} times in {self.file}, not once")
        changed = [(a, b) for a, b in zip(self.old.splitlines(), self.new.splitlines(),
                                          strict=True) if a != b]
        if len(changed) != 1:
            raise ValueError(f"mutant {self.name}: changes {len(changed)} lines, not one")
        return text.replace(self.old, self.new)


LLAMA = Case("llama-tiny", steps=2, seed=0)
# mutants the emulator no longer catches, and why (their test is an expected failure, strict: it
# says so when one is caught again). signal-before-stores was caught on the FMA loop's partial
# stores; on the tensor-core partial (attention_mma.py) the race is another split's merge reading
# this split's partials before its warps store them, and no emulated schedule tried (llama-tiny
# B = 1 seeds 0-5, 8 splits with 300 cached keys; qwen3.5-tiny and qwen3-tiny T = 4 and llama-tiny
# T = 16 on the FMA loop) has shown it
MISSED = {"signal-before-stores": "the emulator's schedules do not expose this race (planted.py)"}
MUTANTS: tuple[Mutant, ...] = (
    Mutant("mma-fragment-swap", "mma.sync A fragment registers a1/a2 swapped (rows g+8 and "
           "k 8..15 exchanged)", "matvec.py",
           "d = mma_bf16_16816(lo[2 * h], hi[2 * h], lo[2 * h + 1], hi[2 * h + 1],",
           "d = mma_bf16_16816(lo[2 * h], lo[2 * h + 1], hi[2 * h], hi[2 * h + 1],",
           Case("llama-tiny", batch=16, steps=1, seed=7)),
    Mutant("missing-full-wait", "consumers read a ring stage without waiting on its full "
           "mbarrier", "pipeline.py",
           "        s, full_parity, _ = ring_slot(j, self.S)\n"
           "        mbar_wait(mbar + s, full_parity)\n",
           "        s, full_parity, _ = ring_slot(j, self.S)\n"
           "        pass\n", LLAMA),
    Mutant("empty-parity-flipped", "the loader waits on the wrong phase parity of a stage's "
           "empty mbarrier", "pipeline.py",
           "mbar_wait(mbar + self.S + s, empty_parity)",
           "mbar_wait(mbar + self.S + s, 1 - empty_parity)", LLAMA),
    Mutant("barrier-count", "the consumers' named barrier counts one warp fewer than arrive",
           "sync.py",
           "cute.arch.barrier(barrier_id=CONSUMER_BARRIER_ID, number_of_threads=named_threads)",
           "cute.arch.barrier(barrier_id=CONSUMER_BARRIER_ID, "
           "number_of_threads=named_threads - 32)", LLAMA),
    Mutant("signal-before-stores", "a split of attention takes its merge ticket (the counter "
           "that lets the last split read every split's partials) before the CTA barrier that "
           "orders its threads' partial stores", "attention.py",
           "        cta_sync(self.named)  # every thread's partial stores happen-before the "
           "ticket\n",
           "        pass  # every thread's partial stores happen-before the ticket\n",
           Case("llama-tiny", steps=2, seed=0, max_seq_len=1024)),  # 4 splits per kv head
    Mutant("wait-not-published", "a consumer's counter wait: thread 0 spins but the CTA barrier "
           "after it is gone, so the other threads read before the acquire", "sync.py",
           "        spin_counter(counters, cid, target)\n    cta_sync(named)\n",
           "        spin_counter(counters, cid, target)\n    pass\n", LLAMA),
    Mutant("attention-last-key", "attention: each 32-key chunk sums one value row fewer "
           "(off-by-one bound)", "attention.py",
           "        o.fill(0.0)\n        vb = cute.make_rmem_tensor((E, VB), BFloat16)  # a batch "
           "of value rows, this lane's dims\n        for k0 in cutlass.range(kb, ke, LANES):\n"
           "            key = k0 + lane\n"
           "            nvalid = cutlass.min(ke - k0, Int32(LANES))\n",
           "        o.fill(0.0)\n        vb = cute.make_rmem_tensor((E, VB), BFloat16)  # a batch "
           "of value rows, this lane's dims\n        for k0 in cutlass.range(kb, ke, LANES):\n"
           "            key = k0 + lane\n"
           "            nvalid = cutlass.min(ke - k0 - 1, Int32(LANES))\n",
           Case("qwen3.5-tiny", steps=2, seed=0)),  # the FMA loop (a model with recurrent layers)
    Mutant("attention-mma-value-keys", "the tensor-core partial's value words: keys 2t + 8, 2t + 9 "
           "of a 16-key step read as 2t + 4, 2t + 5", "attention_mma.py",
           "key = cutlass.min(k0 + 16 * kk + 2 * tq + e % 2 + 8 * (e // 2), kw - 1)",
           "key = cutlass.min(k0 + 16 * kk + 2 * tq + e % 2 + 4 * (e // 2), kw - 1)",
           Case("llama-tiny", steps=2, seed=0, context=100, max_seq_len=128, n_splits=1)),
    Mutant("smem-overlap", "the RMSNorm statistics' shared-memory region placed on the matvec "
           "accumulators", "megakernel.py",
           'sRstd = self.region(raw, "rstd", Float32)',
           'sRstd = self.region(raw, "acc", Float32)', LLAMA),
    Mutant("residual-dropped", "the output projections' epilogue stores the matvec result "
           "without the residual", "epilogues.py",
           "st(c.f32, a, ld(c.f32, a) + self.mv.acc_value(c.sAcc, nn, r, c.ksplit, c.nrp))",
           "st(c.f32, a, self.mv.acc_value(c.sAcc, nn, r, c.ksplit, c.nrp))", LLAMA),
    Mutant("gdn-decay-dropped", "gated delta rule: the state update loses its decay e^g",
           "gdn.py",
           "s_reg[rr] = a * s_reg[rr] + sS[xt + g.dk + warp * RPW + rr] * u",
           "s_reg[rr] = s_reg[rr] + sS[xt + g.dk + warp * RPW + rr] * u",
           Case("qwen3.5-tiny", steps=2, seed=0)),
)
BY_NAME = {m.name: m for m in MUTANTS}

_CHILD = f"""
import json, sys
import megakernel
from megakernel.gpu_check.emulated import Case, run_case
from megakernel.emulator.errors import EmulatorError
root = sys.argv[2]
if not megakernel.__file__.startswith(root):
    raise SystemExit(f"imported {{megakernel.__file__}}, not the copy under {{root}}")
case = Case(**json.loads(sys.argv[1]))
try:
    r = run_case(case)
    out = dict(verdict="ok" if r.ok else "wrong", detail=r.summary())
except EmulatorError as e:
    out = dict(verdict="fault", detail=str(e))
print({RESULT!r} + json.dumps(out))
"""


@dataclass
class Outcome:
    mutant: str
    verdict: str  # fault | wrong | ok | broken | hang
    detail: str
    prior_failed: bool | None = None  # --prior: did any pre-emulator test fail on the mutant?

    @property
    def caught(self) -> bool:
        return self.verdict in ("fault", "wrong")


def scratch_tree(work: Path, mutant: Mutant | None) -> Path:
    """A copy of the checkout (sources, tests, docs) under `work`, with `mutant` applied."""
    tree = work / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*SKIPPED))
    if mutant is not None:
        path = tree / "megakernel" / "kernel" / "device" / mutant.file
        path.write_text(mutant.apply(path.read_text()))
    return tree


def child_env(tree: Path, work: Path) -> dict[str, str]:
    from megakernel.kernel.toolchain.jit import ENV_CACHE

    env = dict(os.environ, PYTHONPATH=str(tree))
    env[ENV_CACHE] = str(work / "cache")
    env.pop("MEGAKERNEL_BUILD_DIR", None)
    return env


def run_mutant(mutant: Mutant | None, case: Case | None = None, prior: bool = False,
               timeout: float = 900) -> Outcome:
    """Emulate `case` (default: the mutant's) on a copy of the code with `mutant` planted
    (None: the unchanged code, the harness's control)."""
    case = case or mutant.case
    name = mutant.name if mutant else "control"
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        work = Path(tmp)
        tree = scratch_tree(work, mutant)
        env = child_env(tree, work)
        try:
            p = subprocess.run([sys.executable, "-c", _CHILD,
                                json.dumps(dataclasses.asdict(case)), str(tree)],
                               capture_output=True, text=True, timeout=timeout, cwd=tree,
                               env=env)
        except subprocess.TimeoutExpired:  # the emulator should have named a deadlock
            return Outcome(name, "hang", f"no verdict within {timeout} s")
        lines = [s for s in p.stdout.splitlines() if s.startswith(RESULT)]
        if p.returncode != 0 or not lines:
            out = Outcome(name, "broken", (p.stdout + p.stderr)[-3000:])
        else:
            d = json.loads(lines[-1][len(RESULT):])
            out = Outcome(name, d["verdict"], d["detail"])
        if prior:
            ignore = [f"--ignore={t}" for t in EMULATOR_TESTS]
            ignore += [f"--deselect={t}" for t in LEFT_OUT]
            q = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "auto", "-m",
                                "not slow", "-p", "no:cacheprovider", *ignore, "tests"],
                               capture_output=True, text=True, timeout=timeout, cwd=tree,
                               env=env)
            out.prior_failed = q.returncode != 0
            if out.prior_failed:
                out.detail += "\nprior tests:\n" + "\n".join(
                    s for s in q.stdout.splitlines() if s.startswith(("FAILED", "ERROR")))
    return out


def first_line(detail: str) -> str:
    return detail.strip().splitlines()[0][:140] if detail.strip() else ""


def main(argv: list[str]) -> int:
    prior = "--prior" in argv
    names = [a for a in argv if not a.startswith("--")] or list(BY_NAME)
    if "control" in names:  # the unchanged code through the same harness
        o = run_mutant(None, case=BY_NAME["signal-before-stores"].case, prior=prior)
        print(f"| control | | | {o.verdict} | prior tests "
              f"{'FAILED' if o.prior_failed else 'pass'} |", flush=True)
        if o.prior_failed:
            print(o.detail, flush=True)
        names.remove("control")
    rows = []
    for n in names:
        m = BY_NAME[n]
        o = run_mutant(m, prior=prior)
        rows.append(o)
        seen = ""
        if o.prior_failed is not None:
            seen = " | prior tests " + ("FAILED" if o.prior_failed else "pass")
        print(f"| {m.name} | {m.file} | {m.case.label} | {o.verdict} | "
              f"{first_line(o.detail)}{seen} |", flush=True)
        if o.prior_failed:
            print(o.detail.split("\nprior tests:\n", 1)[1], flush=True)
    return 0 if all(o.caught and not o.prior_failed for o in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
