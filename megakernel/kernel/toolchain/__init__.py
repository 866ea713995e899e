"""Building the kernel on any machine: the AOT build and its resource checks (build), the JIT cache
keyed by the build's fingerprint (jit, fingerprint), PTX entry signatures and cubin resource
reports (tools) and the HBM read-stream kernel's build (stream_build). Imports the DSL only to
compile.
"""
