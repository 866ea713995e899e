"""Host-side arithmetic the kernel, the program and the layer kinds share, no DSL: budgets and
layouts (limits, plans, arena: the packed weight arena's spans), the build variants (variants),
and per opcode family the index arithmetic its handler uses (*_index), which the tests run as
numpy emulations of the handlers. Below the layer kinds, which declare their shapes with it.
"""
