# make demo: install into .venv, prepare the stdlib corpus, train a tiny model with each FFN, report, sample.
# make test: the test suite (what CI runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build on machines without CUDA; GPU users: make venv TORCH_SPEC="torch==2.11.0" (or any CUDA
# build >= 2.6 from your index), or install requirements.txt into an environment that has torch.
TORCH_SPEC ?= torch==2.13.0
DEMO_TIME := $(shell date +%Y-%m-%d_%H-%M-%S)
DEMO_DIR ?= runs/demo/$(DEMO_TIME)

.PHONY: venv demo test clean-venv kernels

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements.txt
	touch $@

demo: venv
	$(PY) scripts/prepare_data.py +experiment=demo
	$(PY) train.py -m ffn=swiglu,srelu,srelu24 +experiment=demo hydra.sweep.dir=$(DEMO_DIR)
	$(PY) scripts/compare.py $(DEMO_DIR)
	@for ckpts in $(DEMO_DIR)/*/checkpoints; do \
		echo; echo "== sample from $$(dirname $$ckpts)"; \
		$(PY) scripts/sample.py "$$(ls -d $$ckpts/step_* | tail -n 1)" "def main(" \
			--max-new-tokens 60 --temperature 0.8 --seed 0 || exit 1; \
	done

# With a CUDA GPU, two runs: the suite as CI runs it, the GPU hidden and Triton interpreted (the
# CPU-path tests hand Triton CPU tensors, which compiled Triton refuses, and Triton reads
# TRITON_INTERPRET once per process), then the GPU tests (-m gpu) on the GPU, compiled.
test: venv
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		echo "make test: the CPU suite (GPU hidden, Triton interpreted), then the GPU tests (-m gpu)"; \
		CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 $(PY) -m pytest -q && TRITON_INTERPRET=0 $(PY) -m pytest -q -m gpu; \
	else \
		$(PY) -m pytest -q; \
	fi

clean-venv:
	rm -rf $(VENV)

# make kernels: the CUDA C++ sparsify kernels of the srelu24 forward and backward
# (srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu) as build/srelu24_kernels.so, which srelu24_kernels/srelu24/sparsify.py and
# srelu24_kernels/srelu24/sparsify_backward.py prefer to their Triton kernels. Needs nvcc >= 12.0 (sm80 and sm90 code;
# a few seconds). Without it the Triton kernels run.
# KERNELS_LDFLAGS: extra link flags, e.g. -L<CUDA lib dir> where nvcc does not find cudart.
NVCC ?= nvcc
KERNELS_LDFLAGS ?=
KERNELS_FLAGS = -std=c++17 -O3 -Xcompiler -fPIC -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90

# KERNELS_LIB: where the library goes (tests/test_compile_sm90.py builds one in a temporary folder).
KERNELS_LIB ?= build/srelu24_kernels.so

kernels: $(KERNELS_LIB)

$(KERNELS_LIB): srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(KERNELS_FLAGS) -shared $(KERNELS_LDFLAGS) $< -o $@
