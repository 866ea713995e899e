"""Leaves every layer may import: the user-error classes (errors), the GPU archs the kernel
targets (arch), RoPE tables (rope), the logits finiteness check (finite), progress lines
(progress) and the name-registry helper (registry). Nothing here imports another megakernel
package.
"""
