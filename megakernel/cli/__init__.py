"""The command line: `python -m megakernel COMMAND` (main.py dispatches; one module per command:
info, generate, plan, build, demo; gpu-check lives in megakernel.gpu_check). A command's module
is imported only when it runs, so a missing or heavy dependency (the DSL, a GPU) breaks nothing
else. Commands parse and report; the work is done by the layers below (serve, measure, kernel).
"""
