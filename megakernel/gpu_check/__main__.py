"""`python -m megakernel.gpu_check`: the CLI (and the driver's child processes)."""

import argparse
import sys

from megakernel.gpu_check import add_arguments, run

ap = argparse.ArgumentParser(prog="python -m megakernel.gpu_check")
add_arguments(ap)
sys.exit(run(ap.parse_args()))
