"""megakernel: one persistent fused GPU kernel per LLM decode step, its program, a CPU executor
of that program and a torch reference. The Python API (megakernel.serve.api):

    import megakernel as mk
    llm = mk.load("llama-tiny", backend="auto", max_batch=8, max_seq_len=256)
    out = llm.generate([[5, 17, 3], [7, 1]], max_new_tokens=16)

Importing the package registers torch.ops.megakernel.decode_step (megakernel.launch.torch_op); it
never imports the DSL compiler.
"""

from __future__ import annotations


def _version() -> str:
    """The installed distribution's version, else the source tree's pyproject.toml."""
    import importlib.metadata
    import re
    from pathlib import Path

    try:
        return importlib.metadata.version("megakernel")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        m = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) \
            if pyproject.is_file() else None
        return m.group(1) if m else "0+unknown"


__version__ = _version()

from megakernel.launch import torch_op  # noqa: E402  (registers torch.ops.megakernel.decode_step)
from megakernel.serve.api import (  # noqa: E402
    BACKENDS,
    LLM,
    GenerationError,
    GenerationOutput,
    load,
)
from megakernel.serve.engine import program_generate  # noqa: E402

__all__ = ["BACKENDS", "GenerationError", "GenerationOutput", "LLM", "__version__", "load",
           "program_generate", "torch_op"]
