"""The megakernel program: instruction set, weight packing, compiler, cost model and scheduler.

Pure host-side Python (torch, no CUDA, no DSL): the kernel interprets what this package builds.
"""

from megakernel.program.isa import FORMAT_VERSION, RECORD_WORDS, Op

__all__ = ["FORMAT_VERSION", "RECORD_WORDS", "Op"]
