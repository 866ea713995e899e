"""Device code: what `cute.compile` traces. The persistent loop (megakernel), its handler and
epilogue interfaces (handler, epilogue), one module per opcode family (attention, matvec, qkv,
gdn, kda, mamba2, mamba_replay, mla, moe, moe_router, commit, speculative, epilogues), and the
shared mechanisms (pipeline: the shared-memory ring; lookahead: L2 prefetch; sync: counters and
barriers; memory: pointers and vectors; timeline: the timeline build's stamps). stream is the HBM
read-stream kernel, a kernel of its own. Importing any of these imports the DSL.
"""
