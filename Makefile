# Set-up is part of every target: the first run creates .venv and installs everything,
# later runs reuse it (re-installing only when requirements or setup change).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
BUILT := $(VENV)/.built
TORCH_VERSION ?= 2.13.0
MCORE_VERSION ?= 0.19.2
export OMP_NUM_THREADS ?= 1
export TORCHDYNAMO_DISABLE ?= 1

.PHONY: all venv build test test-fast demo lint bench clean

all: build

$(INSTALLED): requirements.txt constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	# constraints.txt pins torch: no requirement (peft, Energon) may replace the CPU build.
	grep -qx "torch==$(TORCH_VERSION)" constraints.txt || { echo "constraints.txt must pin torch==$(TORCH_VERSION)"; exit 1; }
	$(PY) -m pip install -q -c constraints.txt -r requirements.txt
	# megatron-core >0.16.1 declares Python >=3.12 but runs on 3.11; the whole test suite runs on it.
	$(PY) -m pip install -q --no-deps --ignore-requires-python megatron-core==$(MCORE_VERSION)
	# `import megatron.core` imports triton (moe/ops/paged_stash.py); it imports fine on CPU.
	$(PY) -m pip install -q triton
	touch $@

$(BUILT): $(INSTALLED) setup.py $(wildcard csrc/*.cpp csrc/*.h)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) setup.py -q build_ext --inplace
	touch $@

venv: $(INSTALLED)

build: $(BUILT)

test: $(BUILT)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30 tests

test-fast: $(BUILT)
	$(PY) -m pytest -q tests -m "not megatron and not slow"

demo: $(BUILT)
	PYTHON=$(PY) bash scripts/demo.sh

lint: $(INSTALLED)
	$(PY) -m ruff check .

bench: $(BUILT)
	$(PY) bench/run_all.py

clean:
	rm -rf build *.egg-info megatron_omnibal/*.so $(BUILT)
