"""Launching a build: the CUDA driver runtime that loads a cubin and checks its manifest against the
device (runtime), the argument checks done before every launch (checks), a program's kernel
arguments on one device and the build that serves it (device_state), the torch op
`torch.ops.megakernel.decode_step` (torch_op) and its decode loop (torch_decode), and the
emulated driver that runs the same build's PTX on the CPU (emulated). No DSL: this layer runs on
the GPU machine as it is.
"""
