"""The megakernel program: compiler, buffer plan, weight packing, cost model and scheduler,
verifier. Pure host-side Python (torch, no CUDA, no DSL): the kernel interprets what this package
builds; the instruction set is megakernel/isa, the layer kinds megakernel/layers.
"""
