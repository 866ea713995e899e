"""A PTX emulator: the kernel's own compiled PTX run on the CPU, checked (the ladder's fifth rung).

`Emulator(ptx_text, smem_bytes=..., block=...)` parses and pre-decodes the PTX once;
`Emulator.launch(num_ctas, params, seed=..., readonly=...)` runs one cooperative launch: every
CTA's warps interleaved by a seeded scheduler, on 32-lane numpy vectors, over the launch's own CPU
tensors (global memory is their bytes, checked against each allocation), with poisoned shared
memory, mbarriers, bulk copies that land at a random later point, named barriers, and deadlock and
trap reports that name the PTX line. docs/TESTING.md places the rung and says what it cannot show.
"""

from megakernel.emulator.errors import EmulatorError
from megakernel.emulator.machine import Emulator, LaunchStats

__all__ = ["Emulator", "EmulatorError", "LaunchStats"]
