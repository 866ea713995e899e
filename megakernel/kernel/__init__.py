"""The CuTe DSL megakernel: static spec, device code, AOT build and the JIT cache.

Importing this package does not import the DSL; `megakernel.kernel.megakernel` and
`megakernel.kernel.build.compile_to` do.
"""
