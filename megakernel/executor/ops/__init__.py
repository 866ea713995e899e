"""The executor's op functions, one per opcode, grouped by layer kind (see executor/core.py)."""
