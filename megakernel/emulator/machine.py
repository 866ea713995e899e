"""The emulated GPU: global memory over the launch's tensors, CTAs with poisoned shared memory,
barriers and mbarriers, warps with per-lane program counters, and a seeded scheduler.

Warps. A warp runs groups of lanes that share a program counter: the current group (`pc`, `m`)
and the others (`groups`). A divergent branch splits the group; the group with the lowest program
counter runs first and groups that reach the same instruction merge, so structured code
reconverges where the compiler's code joins. Warp collectives (shfl.sync, vote.sync,
bar.warp.sync, mma.sync, bar.sync) wait until every live lane of their member mask is in the
group that executes them, as independent thread scheduling allows.

Scheduling. Every CTA of the cooperative launch and each of its warps is one schedulable unit; a
seeded generator picks the next warp and the length of its quantum. A failed mbarrier wait or a
nanosleep (the kernel's spin loops) ends the quantum. Bulk copies complete at randomly chosen
later points. Warps stall: now and then one is descheduled for a while, and after a warp
publishes to other CTAs (a release wider than the CTA) its siblings often are, so a consumer
elsewhere runs while they lag (`stall`): a signal that does not wait for every thread's stores
shows as the poison its consumer reads. A state in which no warp can make progress (all blocked
or spinning without any store, arrival or copy landing) is a deadlock, reported with every warp's
line and wait.

Memory is sequentially consistent: acquire/release and fences order nothing further here, so
weak-memory bugs are out of reach (docs/TESTING.md).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from megakernel.emulator import decode as dc
from megakernel.emulator.errors import EmulatorError
from megakernel.emulator.memops import OPS
from megakernel.emulator.ptx import Kernel, parse

SHARED_BASE = 0x400  # the dynamic shared window starts here: lower addresses are unmapped
POISON = 0xFF  # shared memory and in-flight copy destinations: NaN as fp32 and as bf16
CLOCK_NS_PER_INSTR = 4  # %globaltimer advances with the instructions executed
# stalls: after a quantum, with probability STALL_P one warp is descheduled for a number of quanta
# in STALL_QUANTA (as a warp on a GPU sits behind a long memory access while the others go on)
STALL_P = 0.02
RELEASE_STALL_P = 0.5
STALL_QUANTA = (50, 1500)


@dataclass
class LaunchStats:
    """What one launch did: warp-instructions executed, wall time, lines reached."""

    warp_instructions: int = 0
    seconds: float = 0.0
    hits: dict[int, int] = field(default_factory=dict)  # PTX line -> warp-instructions
    quanta: int = 0
    copies: int = 0

    @property
    def executed(self) -> set[int]:
        """The PTX lines reached."""
        return set(self.hits)

    @property
    def rate(self) -> float:
        return self.warp_instructions / self.seconds if self.seconds else 0.0


@dataclass
class Alloc:
    name: str
    base: int
    size: int
    data: np.ndarray  # uint8 view of the tensor's bytes
    readonly: bool

    def __post_init__(self) -> None:
        self.views = {1: self.data}

    @property
    def end(self) -> int:
        return self.base + self.size

    def view(self, esize: int) -> np.ndarray:
        v = self.views.get(esize)
        if v is None:
            n = self.size // esize * esize
            v = self.views[esize] = self.data[:n].view(dc.UINT[esize])
        return v


class MBarrier:
    __slots__ = ("count", "pending", "phase", "tx")

    def __init__(self, count: int):
        self.count, self.pending, self.phase, self.tx = count, count, 0, 0


class CTA:
    """One CTA: its shared memory, named barriers, mbarriers and in-flight bulk copies."""

    def __init__(self, emu: Emulator, cid: int, smem_bytes: int, nwarps: int):
        self.emu, self.id = emu, cid
        self.smem = Alloc(f"shared memory of CTA {cid}", 0, SHARED_BASE + smem_bytes,
                          np.full(SHARED_BASE + smem_bytes, POISON, np.uint8), False)
        self.bars: dict[int, list] = {}  # id -> [arrived, count, waiting warps, all threads]
        self.mbars: dict[int, MBarrier] = {}
        self.pending: list[tuple] = []
        self.warps: list[Warp] = []

    # named barriers (bar.sync id, count): counted per warp, 32 threads each
    def barrier(self, w: Warp, ins, bid: int, count: int | None):  # noqa: ANN001, ANN201
        if w.released:
            w.released = False
            return None
        if not w.collective(w.live, ins):
            return dc.BLOCK
        if bid > 15:
            raise EmulatorError(f"PTX line {ins.line} ({w.where()}): barrier id {bid} > 15")
        live_threads = sum(32 for x in self.warps if not x.done)
        expected = count if count is not None else live_threads
        if count is not None and count % 32:
            raise EmulatorError(f"PTX line {ins.line} ({w.where()}): bar.sync {bid} with "
                                f"{count} threads, not a multiple of the warp size")
        st = self.bars.setdefault(bid, [0, expected, [], count is None])
        if st[0] and st[1] != expected:
            raise EmulatorError(
                f"PTX line {ins.line} ({w.where()}): bar.sync {bid} with {expected} threads "
                f"while {st[0]} threads wait on it expecting {st[1]} (barrier count mismatch)")
        st[0] += 32
        st[1] = expected
        if st[0] > expected:
            raise EmulatorError(
                f"PTX line {ins.line} ({w.where()}): more than {expected} threads reached "
                f"bar.sync {bid} (its thread count is too small for the warps that use it)")
        if st[0] == expected:
            for x in st[2]:
                x.blocked = None
                x.released = True
            self.bars.pop(bid)
            self.emu.progress += 1
            return None
        st[2].append(w)
        w.blocked = f"bar.sync {bid} ({st[0]}/{expected} threads arrived)"
        return dc.BLOCK

    def warp_exited(self, w: Warp) -> None:
        """A warp that exits must not strand waiters: a barrier over all threads, or one whose
        count the remaining warps can no longer reach, is an error now rather than a hang."""
        live = sum(32 for x in self.warps if not x.done)
        for bid, st in self.bars.items():
            if st[0] and (st[3] or live < st[1]):
                raise EmulatorError(
                    f"{w.where()} exited while {st[0]} threads wait at bar.sync {bid} "
                    f"(expecting {st[1]}; {live} threads remain): they can never be released")

    # mbarriers, in the PTX ISA's terms: pending arrivals, transaction count, phase
    def _mbar(self, w: Warp, ins, addr: int) -> MBarrier:  # noqa: ANN001
        mb = self.mbars.get(addr)
        if mb is None:
            raise EmulatorError(f"PTX line {ins.line} ({w.where()}): mbarrier at shared "
                                f"0x{addr:x} used before mbarrier.init")
        return mb

    def mbar_init(self, w: Warp, ins, addr: int, count: int) -> None:  # noqa: ANN001
        self._check_shared(w, ins, addr, 8)
        if count < 1:
            raise EmulatorError(f"PTX line {ins.line} ({w.where()}): mbarrier.init with count "
                                f"{count}")
        self.mbars[addr] = MBarrier(count)
        self.emu.progress += 1

    def _complete(self, mb: MBarrier) -> None:
        if mb.pending == 0 and mb.tx == 0:
            mb.phase += 1
            mb.pending = mb.count
        self.emu.progress += 1

    def mbar_arrive(self, w: Warp, ins, addr: int, n: int) -> None:  # noqa: ANN001
        mb = self._mbar(w, ins, addr)
        mb.pending -= n
        if mb.pending < 0:
            raise EmulatorError(f"PTX line {ins.line} ({w.where()}): {n} arrival(s) on the "
                                f"mbarrier at shared 0x{addr:x} beyond its count {mb.count} "
                                f"in phase {mb.phase}")
        self._complete(mb)

    def mbar_tx(self, w: Warp, ins, addr: int, nbytes: int) -> None:  # noqa: ANN001
        self._mbar(w, ins, addr).tx += nbytes

    def mbar_done(self, w: Warp, ins, addr: int, parity: int) -> bool:  # noqa: ANN001
        return (self._mbar(w, ins, addr).phase & 1) != parity

    def _check_shared(self, w: Warp, ins, addr: int, size: int) -> None:  # noqa: ANN001
        if addr < SHARED_BASE or addr + size > self.smem.size or addr % min(size, 16):
            raise EmulatorError(
                f"PTX line {ins.line} ({w.where()}): shared access of {size} B at 0x{addr:x} "
                f"outside [0x{SHARED_BASE:x}, 0x{self.smem.size:x}) or misaligned")

    def land(self, k: int) -> None:
        """Complete in-flight bulk copy `k`: bytes from global memory now, then complete_tx."""
        dst, alloc, off, size, mbar, ins, who = self.pending.pop(k)
        self.smem.data[dst:dst + size] = alloc.data[off:off + size]
        mb = self.mbars.get(mbar)
        if mb is None:
            raise EmulatorError(f"bulk copy of PTX line {ins.line} ({who}) completed on the "
                                f"mbarrier at 0x{mbar:x}, which is not initialised")
        mb.tx -= size
        self._complete(mb)
        self.emu.stats.copies += 1


class Warp:
    """32 lanes: register banks, the current lane group and the others, and its wait state."""

    def __init__(self, emu: Emulator, cta: CTA, wid: int, banks: list[tuple[int, np.dtype]]):
        self.emu, self.cta, self.id = emu, cta, wid
        self.b = [np.zeros((n, dc.LANES), dt) for n, dt in banks]
        # every bank as each register type of its width (dc.typed_views): reads and writes of
        # another type of the same width index these instead of viewing a row each time
        self.tv = dc.typed_views(self.b)
        self.pc = 0
        self.m: np.ndarray | None = None
        self.groups: list[list] = []  # [pc, mask, parked]
        self.live = np.ones(dc.LANES, bool)
        self.done = False
        self.blocked: str | None = None
        self.released = False
        self.parked = False
        self.waiting_on = ""
        self.polled = False
        lane = np.arange(dc.LANES, dtype=np.uint32)
        self._sregs = {"%laneid": lane, "%tid.x": lane + np.uint32(32 * wid),
                       "%tid.y": np.zeros(32, np.uint32), "%tid.z": np.zeros(32, np.uint32),
                       "%ctaid.x": np.full(32, cta.id, np.uint32),
                       "%ctaid.y": np.zeros(32, np.uint32), "%ctaid.z": np.zeros(32, np.uint32),
                       "%nctaid.x": np.full(32, emu.num_ctas, np.uint32),
                       "%nctaid.y": np.ones(32, np.uint32), "%nctaid.z": np.ones(32, np.uint32),
                       "%ntid.x": np.full(32, emu.threads, np.uint32),
                       "%warpid": np.full(32, wid, np.uint32),
                       "%smid": np.full(32, cta.id, np.uint32),
                       "%lanemask_lt": ((np.uint64(1) << lane.astype(np.uint64)) - np.uint64(1)
                                        ).astype(np.uint32)}

    def sreg(self, name: str) -> np.ndarray:
        if name in ("%globaltimer", "%clock64", "%clock"):
            return np.full(dc.LANES, self.emu.clock_ns(), np.uint64)
        return self._sregs[name]

    def active(self) -> np.ndarray:
        return dc.ALL if self.m is None else self.m

    def where(self) -> str:
        lanes = np.nonzero(self.active())[0]
        ln = "all lanes" if len(lanes) == 32 else f"lanes {list(map(int, lanes))}"
        return f"CTA {self.cta.id}, warp {self.id}, {ln}"

    # ---- lane groups ---------------------------------------------------------------------------
    def split(self, pc: int, mask: np.ndarray) -> None:
        self.groups.append([pc, mask.copy(), False])

    def _set_current(self, pc: int, mask: np.ndarray) -> None:
        self.pc = pc
        self.m = None if mask.all() else mask

    def reconcile(self) -> None:
        """Merge groups at the current pc; switch to the lowest-pc group that can run."""
        if not self.parked:
            pc = self.pc
            for g in self.groups:
                if g[0] <= pc:
                    break
            else:  # every other group is ahead: nothing merges, the current group runs on
                return
        act = self.active()
        keep = []
        merged = False
        for g in self.groups:
            if g[0] == self.pc:
                act = act | g[1]
                merged = True
            else:
                keep.append(g)
        self.groups = keep
        if merged:
            self.parked = False
            self._set_current(self.pc, act)
        if not self.groups:
            return
        best = min((g for g in self.groups if not g[2]), key=lambda g: g[0], default=None)
        if best is not None and (self.parked or best[0] < self.pc):
            self.groups.remove(best)
            self.groups.append([self.pc, act.copy(), self.parked])
            self.parked = False
            self._set_current(best[0], best[1])

    def park(self, ins) -> None:  # noqa: ANN001
        """The current group waits at a collective for lanes in other groups."""
        if all(g[2] for g in self.groups):
            lines = sorted({self.emu.kernel.code[g[0]].line for g in self.groups})
            raise EmulatorError(
                f"PTX line {ins.line} ({self.where()}): a warp collective waits for lanes "
                f"that wait at other collectives (lines {lines}): the warp cannot converge")
        self.parked = True
        self.reconcile()

    def collective(self, members: np.ndarray, ins) -> bool:  # noqa: ANN001
        """May the current group execute a collective over `members` now? Parks it if not."""
        act = self.active()
        if (act & ~members).any():
            raise EmulatorError(
                f"PTX line {ins.line} ({self.where()}): lanes "
                f"{list(map(int, np.nonzero(act & ~members)[0]))} execute {ins.parts[0]} but "
                f"are not in its member mask")
        need = members & self.live
        if (need & ~act).any():
            if not self.groups:
                raise EmulatorError(
                    f"PTX line {ins.line} ({self.where()}): {ins.parts[0]} names lanes "
                    f"{list(map(int, np.nonzero(need & ~act)[0]))} that have exited")
            self.park(ins)
            return False
        return True

    def exit_lanes(self, lanes: np.ndarray) -> None:
        act = self.active()
        self.live = self.live & ~lanes
        rest = act & ~lanes
        if rest.any():
            self._set_current(self.pc + 1, rest)
            return
        if self.groups:
            g = min(self.groups, key=lambda g: g[0])
            self.groups.remove(g)
            self._set_current(g[0], g[1])
            self.parked = g[2]
            return
        self.done = True
        self.cta.warp_exited(self)


class Emulator:
    """A build's PTX, parsed and decoded once; `launch` runs one cooperative launch."""

    def __init__(self, ptx_text: str, smem_bytes: int, block: tuple[int, int, int]):
        if block[1] != 1 or block[2] != 1 or block[0] % 32:
            raise EmulatorError(f"block {block}: the emulator runs 1-D blocks of whole warps")
        self.kernel: Kernel = parse(ptx_text)
        self.smem_bytes = int(smem_bytes)
        self.threads = int(block[0])
        self.param_names = [n for n, _ in self.kernel.params]
        self.decoder = dc.Decoder(self.kernel, SHARED_BASE,
                                  {n: i for i, n in enumerate(self.param_names)}, OPS)
        self.fns = self.decoder.decode_all()
        self.num_ctas = 0
        self.count = 0
        self.progress = 0
        self.releaser: Warp | None = None  # the warp that published in this quantum (stall)
        self.stats = LaunchStats()

    def clock_ns(self) -> int:
        return self.count * CLOCK_NS_PER_INSTR

    # ---- global memory -------------------------------------------------------------------------
    def _map(self, params: list[tuple[str, object]], readonly: frozenset[str]) -> None:
        if len(params) != len(self.param_names):
            raise EmulatorError(f"the kernel takes {len(self.param_names)} parameters, the "
                                f"launch gave {len(params)}")
        self.allocs: list[Alloc] = []
        self.param_vals = []
        for name, v in params:
            if isinstance(v, torch.Tensor):
                if v.device.type != "cpu" or not v.is_contiguous():
                    raise EmulatorError(f"parameter {name}: the emulator needs a contiguous "
                                        f"CPU tensor, got {v.device} "
                                        f"{'contiguous' if v.is_contiguous() else 'strided'}")
                nbytes = v.numel() * v.element_size()
                if nbytes:
                    u8 = v.view(-1).view(torch.uint8).numpy()
                    self.allocs.append(Alloc(name, v.data_ptr(), nbytes, u8, name in readonly))
                self.param_vals.append(np.full(dc.LANES, v.data_ptr(), np.uint64))
            else:
                self.param_vals.append(np.full(dc.LANES, int(v) & 0xFFFFFFFF, np.uint64))
        self.allocs.sort(key=lambda a: a.base)
        for a, b in zip(self.allocs, self.allocs[1:], strict=False):
            if b.base < a.end:
                raise EmulatorError(f"parameters {a.name} and {b.name} overlap in memory")

    def _find(self, w: Warp, ins, addrs: np.ndarray, total: int) -> Alloc:  # noqa: ANN001
        lo, hi = int(addrs.min()), int(addrs.max()) + total
        for a in self.allocs:
            if a.base <= lo and hi <= a.end:
                return a
        for lane_i, ad in enumerate(addrs.tolist()):
            if not any(a.base <= ad and ad + total <= a.end for a in self.allocs):
                raise EmulatorError(self._oob(w, ins, lane_i, ad, total))
        raise EmulatorError(f"PTX line {ins.line} ({w.where()}): one access spans several "
                            f"allocations; the emulator keeps an access in one")

    def _oob(self, w: Warp, ins, lane_i: int, ad: int, total: int) -> str:  # noqa: ANN001
        lane = int(np.nonzero(w.active())[0][lane_i])
        near = min(self.allocs, key=lambda a: min(abs(ad - a.base), abs(ad - a.end)))
        rel = (f"{ad - near.base} B into {near.name} ({near.size} B)" if ad >= near.base
               else f"{near.base - ad} B before {near.name}")
        return (f"PTX line {ins.line}: out-of-bounds global access of {total} B at 0x{ad:x} by "
                f"CTA {w.cta.id}, warp {w.id}, lane {lane}: {rel}")

    def _resolve(self, w: Warp, ins, space: str, addrs: np.ndarray, total: int):  # noqa: ANN001, ANN202
        if space == "shared":
            a = w.cta.smem
            lo, hi = int(addrs.min()), int(addrs.max()) + total
            if lo < SHARED_BASE or hi > a.size:
                bad = addrs[(addrs < SHARED_BASE) | (addrs + total > a.size)][0]
                raise EmulatorError(
                    f"PTX line {ins.line} ({w.where()}): shared access of {total} B at "
                    f"0x{int(bad):x} outside the CTA's shared memory [0x{SHARED_BASE:x}, "
                    f"0x{a.size:x})")
        else:
            a = self._find(w, ins, addrs, total)
        if (addrs % np.uint64(total)).any():
            bad = int(addrs[(addrs % np.uint64(total)) != 0][0])
            raise EmulatorError(f"PTX line {ins.line} ({w.where()}): misaligned {total} B "
                                f"{space} access at 0x{bad:x}")
        return a

    def load(self, w: Warp, ins, space: str, addrs: np.ndarray, esize: int,  # noqa: ANN001
             n: int) -> np.ndarray:
        if addrs.size == 0:
            return np.zeros((0, n), dc.UINT[esize])
        a = self._resolve(w, ins, space, addrs, esize * n)
        idx = ((addrs - np.uint64(a.base)) // np.uint64(esize)).astype(np.int64)
        v = a.view(esize)
        if n == 1:
            return v[idx][:, None]
        return v[idx[:, None] + np.arange(n)]

    def store(self, w: Warp, ins, space: str, addrs: np.ndarray, esize: int,  # noqa: ANN001
              vals: np.ndarray) -> None:
        if addrs.size == 0:
            return
        n = vals.shape[1]
        a = self._resolve(w, ins, space, addrs, esize * n)
        if a.readonly:
            raise EmulatorError(f"PTX line {ins.line} ({w.where()}): store to read-only "
                                f"parameter {a.name} at offset {int(addrs[0]) - a.base}")
        idx = ((addrs - np.uint64(a.base)) // np.uint64(esize)).astype(np.int64)
        v = a.view(esize)
        if n == 1:
            v[idx] = vals[:, 0]
        else:
            v[idx[:, None] + np.arange(n)] = vals
        self.progress += 1

    def bulk_copy(self, w: Warp, ins, dst: int, src: int, size: int, mbar: int) -> None:  # noqa: ANN001
        if size <= 0 or size % 16 or dst % 16 or src % 16:
            raise EmulatorError(f"PTX line {ins.line} ({w.where()}): bulk copy of {size} B "
                                f"from 0x{src:x} to shared 0x{dst:x}: size and addresses must "
                                f"be multiples of 16")
        a = self._find(w, ins, np.array([src], np.uint64), size)
        w.cta._check_shared(w, ins, dst, size)
        w.cta._check_shared(w, ins, dst + size - 16, 16)
        w.cta._mbar(w, ins, mbar)
        w.cta.smem.data[dst:dst + size] = POISON  # in flight: undefined until it lands
        w.cta.pending.append((dst, a, src - a.base, size, mbar, ins, w.where()))
        self.progress += 1

    # ---- the launch ----------------------------------------------------------------------------
    def launch(self, num_ctas: int, params: list[tuple[str, object]], *, seed: int = 0,
               readonly: frozenset[str] = frozenset(), max_instructions: int = 2_000_000_000,
               ) -> LaunchStats:
        """Run one cooperative launch of `num_ctas` CTAs to completion (or raise)."""
        with np.errstate(all="ignore"):  # IEEE results (inf, NaN) are the kernel's to handle
            return self._launch(num_ctas, params, seed, frozenset(readonly), max_instructions)

    def _launch(self, num_ctas: int, params: list[tuple[str, object]], seed: int,
                readonly: frozenset[str], max_instructions: int) -> LaunchStats:
        t0 = time.perf_counter()
        self._map(params, readonly)
        self.num_ctas = num_ctas
        self.stats = stats = LaunchStats()
        rng = random.Random(seed)
        nw = self.threads // 32
        ctas = [CTA(self, c, self.smem_bytes, nw) for c in range(num_ctas)]
        warps = []
        for c in ctas:
            c.warps = [Warp(self, c, i, self.decoder.bank_shapes) for i in range(nw)]
            warps += c.warps
        hits = [0] * len(self.fns)
        idle = 0
        stalled: dict[Warp, int] = {}  # warp -> quanta it stays descheduled (`stall`)
        spinners: set[Warp] = set()  # warps that spun since the last progress
        calm = False  # no new stalls: every stall was lifted to tell a deadlock from a wait
        start = self.count
        while True:
            for c in ctas:
                k = len(c.pending)
                while k:
                    k -= 1
                    if rng.random() < 0.35:
                        c.land(k)
            runnable = [w for w in warps if not w.done and w.blocked is None]
            if not runnable:
                if all(w.done for w in warps):
                    break
                if not self._land_one(ctas, rng):
                    raise EmulatorError(self._deadlock(warps, "every live warp is blocked"))
                continue
            awake = [w for w in runnable if w not in stalled] or runnable
            w = rng.choice(awake)
            before = self.progress
            spun = self._run(w, rng.randint(8, 400), hits)
            stats.quanta += 1
            if not calm:
                stall(stalled, warps, rng, self.releaser)
            self.releaser = None
            # no progress (a store, an arrival, a copy landing) since every runnable warp last
            # spun: a deadlock. A quantum that ends inside a spin loop without reaching its wait
            # neither counts nor resets; a warp computing without storing is not a spinner.
            if self.progress != before:
                idle = 0
                spinners.clear()
                calm = False
            elif spun:
                idle += 1
                spinners.add(w)
            if idle > 24 * len(runnable) + 64:
                if stalled:  # the spinners may wait on a stalled warp: wake every warp, and
                    stalled.clear()  # stall none until something progresses
                    calm = True
                    idle = 0
                elif all(x in spinners for x in runnable):
                    if not self._land_one(ctas, rng):
                        raise EmulatorError(self._deadlock(
                            warps, "every running warp spins without progress"))
                    idle = 0
                    spinners.clear()
            if self.count - start > max_instructions:
                raise EmulatorError(self._deadlock(
                    warps, f"the launch ran past {max_instructions} warp-instructions (a "
                    f"livelock: warps make progress that never lets the launch finish)"))
        for c in ctas:
            for bid, st in c.bars.items():
                raise EmulatorError(f"CTA {c.id} finished with {st[0]} threads waiting at "
                                    f"bar.sync {bid}")
            if c.pending:
                raise EmulatorError(f"CTA {c.id} finished with {len(c.pending)} bulk copies "
                                    f"in flight (first from PTX line {c.pending[0][5].line})")
        code = self.kernel.code
        stats.hits = {code[i].line: h for i, h in enumerate(hits) if h}
        stats.warp_instructions = self.count - start
        stats.seconds = time.perf_counter() - t0
        return stats

    def _land_one(self, ctas: list[CTA], rng: random.Random) -> bool:
        busy = [c for c in ctas if c.pending]
        if not busy:
            return False
        c = rng.choice(busy)
        c.land(rng.randrange(len(c.pending)))
        return True

    def _deadlock(self, warps: list[Warp], why: str) -> str:
        code = self.kernel.code
        rows = []
        for w in warps:
            if w.done:
                continue
            what = w.blocked or w.waiting_on or "running"
            rows.append(f"  CTA {w.cta.id} warp {w.id}: PTX line {code[w.pc].line} "
                        f"({code[w.pc].text}): {what}")
        return f"deadlock: {why}:\n" + "\n".join(rows)

    def _run(self, w: Warp, budget: int, hits: list[int]) -> bool:
        """Run `w` for up to `budget` instructions; True when it stopped on a spin."""
        fns = self.fns
        pc = w.pc
        w.waiting_on = ""
        n = 0
        spun = False
        try:
            while n < budget:
                hits[pc] += 1
                r = fns[pc](w)
                n += 1
                if r is None:
                    pc += 1
                elif r >= 0:
                    pc = r
                elif r == dc.YIELD:
                    pc += 1
                    spun = True
                    if w.groups:
                        w.pc = pc
                        w.reconcile()
                        pc = w.pc
                    break
                elif r == dc.BLOCK:
                    n -= 1
                    hits[pc] -= 1
                    if w.blocked is not None:
                        break
                    pc = w.pc  # parked at a collective: another group runs
                    continue
                else:  # EXIT: exit_lanes has set the next group
                    if w.done:
                        break
                    pc = w.pc
                    continue
                if w.groups:
                    w.pc = pc
                    w.reconcile()
                    pc = w.pc
        except EmulatorError:
            raise
        except Exception as e:  # a numpy or decoder fault: name the instruction
            ins = self.kernel.code[pc]
            raise EmulatorError(f"PTX line {ins.line} ({w.where()}): {ins.text}: "
                                f"{type(e).__name__}: {e}") from e
        finally:
            self.count += n
        if not w.done:
            w.pc = pc
        return spun


def stall(stalled: dict[Warp, int], warps: list[Warp], rng: random.Random,
          releaser: Warp | None) -> None:
    """Age the stalls by one quantum; with probability STALL_P stall a random warp, and after a
    quantum in which a warp published (a GPU-scope release: `releaser`), with probability
    RELEASE_STALL_P stall every other warp of its CTA. A stalled warp runs only when no other
    can. So a signal that does not wait for every thread's stores is seen: the sibling warp
    that has not stored yet stays behind while the consumers read."""
    for w in list(stalled):
        stalled[w] -= 1
        if stalled[w] <= 0 or w.done:
            del stalled[w]
    if rng.random() < STALL_P:
        stalled[rng.choice(warps)] = rng.randint(*STALL_QUANTA)
    if releaser is not None and rng.random() < RELEASE_STALL_P:
        for w in releaser.cta.warps:
            if w is not releaser and not w.done:
                stalled[w] = rng.randint(*STALL_QUANTA)
