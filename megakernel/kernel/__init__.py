"""The CuTe DSL megakernel, split by where the code runs: device/ (what the DSL traces into the
cubin), host/ (the spec, limits, plans and index arithmetic the host and the tests share) and
toolchain/ (AOT build, JIT cache, binary tools).

Importing this package does not import the DSL; `megakernel.kernel.device.megakernel` and
`megakernel.kernel.toolchain.build.compile_to` do.
"""
