"""The CPU executor of megakernel programs (core.py; one op function per opcode in ops/) and the
"cpu-executor" generation backend (generate.py)."""

from megakernel.executor.core import (
    DeadlockError,
    Executor,
    ExecutorError,
    RaceError,
    WriteCountError,
)
from megakernel.executor.generate import DEFAULT_SMS, executor_gpu, generate

__all__ = ["DEFAULT_SMS", "DeadlockError", "Executor", "ExecutorError", "RaceError",
           "WriteCountError", "executor_gpu", "generate"]
