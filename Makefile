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

.PHONY: venv demo test clean-venv cutlass kernels

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

test: venv
	$(PY) -m pytest -q

clean-venv:
	rm -rf $(VENV)

# make kernels: the CUDA C++ sparsify kernels of the srelu24 forward and backward
# (kernels/csrc/sp24_sparsify.cu) as build/sp24_kernels.so, which kernels/sparsify24.py and
# kernels/sparsify24_backward.py prefer to their Triton kernels. Needs nvcc >= 12.0 (sm80 and sm90 code;
# a few seconds). Without it the Triton kernels run.
NVCC ?= nvcc
KERNELS_FLAGS = -std=c++17 -O3 -Xcompiler -fPIC -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90

kernels: build/sp24_kernels.so

build/sp24_kernels.so: kernels/csrc/sp24_sparsify.cu
	@mkdir -p build
	$(NVCC) $(KERNELS_FLAGS) -shared $(SP24_LDFLAGS) $< -o $@

# make cutlass: the CUTLASS 2:4 GEMMs for Hopper (kernels/csrc/sp24_gemm_sm90.cu) as one shared library
# that kernels/cutlass_sp24.py loads. Needs nvcc >= 12.3 and the CUTLASS headers of the nvidia-cutlass
# wheel (pip install nvidia-cutlass==4.2.0.0; no network needed once it is installed), found through the
# .venv's python if there is one. Build in parallel: make -j7 cutlass (one job per configuration, about
# a minute each). SP24_LDFLAGS: extra link flags, e.g. -L<CUDA lib dir> where nvcc does not find cudart.
SP24_CFGS := 0 1 2 3 4 5 6
SP24_LDFLAGS ?=
CUTLASS_DIR ?= $(shell $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); \
	print(os.path.join(os.path.dirname(s.origin), 'source') if s else '')")
SP24_FLAGS = -std=c++17 -O3 -DNDEBUG -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
	-Xcompiler -fPIC -I$(CUTLASS_DIR)/include -I$(CUTLASS_DIR)/tools/util/include
SP24_OBJS = $(foreach c,$(SP24_CFGS),build/sp24_c$(c).o)

cutlass: build/sp24_cutlass.so

build/sp24_c%.o: kernels/csrc/sp24_gemm_sm90.cu
	@test -n "$(CUTLASS_DIR)" || { echo "CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0, or make cutlass CUTLASS_DIR=<a CUTLASS checkout>"; exit 1; }
	@mkdir -p build
	$(NVCC) $(SP24_FLAGS) -DSP24_CFG=$* -c $< -o $@

build/sp24_cutlass.so: $(SP24_OBJS)
	$(NVCC) -shared -gencode arch=compute_90a,code=sm_90a $(SP24_LDFLAGS) $^ -o $@
