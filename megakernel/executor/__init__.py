"""The CPU executor of megakernel programs: core.py runs a program's SM queues with their
dependency waits, one op function per opcode in ops/, on the GPU description of gpu.py (the
"cpu-executor" generation backend that drives it is megakernel.serve.executor_backend)."""

from megakernel.executor.core import (
    DeadlockError,
    Executor,
    ExecutorError,
    RaceError,
    WriteCountError,
)
from megakernel.executor.gpu import DEFAULT_SMS, executor_gpu

__all__ = ["DEFAULT_SMS", "DeadlockError", "Executor", "ExecutorError", "RaceError",
           "WriteCountError", "executor_gpu"]
