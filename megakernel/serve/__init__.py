"""Generation as a user asks for it: the Python API (`mk.load`, api), the engine that runs prefill
and decode as program steps (engine), the backends it can drive (backends: the kernel through
kernel_backend, the CPU executor through executor_backend, the emulator, the torch reference),
speculative methods and drafters (speculative, drafters), chat templates and tokenizers (chat)
and the real checkpoints the demo fetches (real_models).
"""
