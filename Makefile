# `make test` and `make train` set themselves up: they create .venv and install on first use (`make train` only
# what training needs, `make test` the test extras too).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test test-slow test-gpu gpu-wheels notebooks train venv clean

venv: $(STAMP)

# On Linux x86_64 the aot extra (the CUDA plugin wheels, about 4.4 GB, no GPU needed) comes too: the GPU-compile
# tests (marked aot) compile the step and the kernels for H100s; elsewhere they are skipped.
comma := ,
EXTRAS := $(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),test$(comma)aot,test)

# Two stages: `make train` needs the package and its runtime dependencies only (TRAIN_STAMP); `make test` adds the
# test extras (pytest, torch, transformers, peft, the CUDA compile-only wheels) on top (STAMP).
TRAIN_STAMP := $(VENV)/.installed-train
$(TRAIN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(TRAIN_STAMP)

$(STAMP): $(TRAIN_STAMP)
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

# Default suite: CPU only, 8 fake devices, excludes tests marked slow or gpu.
test: $(STAMP)
	$(PY) -m pytest -n 2 -m "not slow and not gpu" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -n 2 -m "slow" $(PYTEST_ARGS)

# On a GPU machine (install with the gpu extra: pip install -e '.[test,gpu]'). Fails when JAX sees no GPU.
test-gpu: $(STAMP)
	$(PY) -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 'make test-gpu: JAX sees no GPU (backend ' + jax.default_backend() + '); install the gpu extra on a GPU machine')"
	$(PY) -m pytest -m "gpu" $(PYTEST_ARGS)

# For a lent GPU machine that reaches no registry: the wheels of the project's dependencies its image lacks (Python
# 3.12, manylinux x86-64) into .whl/, which experiments/gpu/first_contact.sh installs there.
gpu-wheels: $(STAMP)
	$(PY) experiments/gpu/wheels.py

# The notebooks (8 fake CPU devices, no GPU): installs JupyterLab into .venv once, then opens notebooks/.
notebooks: $(STAMP)
	$(PY) -c "import jupyterlab" 2>/dev/null || $(PY) -m pip install --quiet -e '.[$(EXTRAS),notebooks]'
	$(VENV)/bin/jupyter lab notebooks

clean:
	rm -rf $(VENV) .pytest_cache .jax_cache *.egg-info

# The main job: the tiny preset on the built-in corpus (the Python standard library's sources),
# fsdp=2 x sp=4 on 8 fake CPU devices when there is no GPU. A new run directory each time.
TRAIN_ARGS ?=
RUN_DIR ?= runs/tiny-$(shell date +%Y%m%d-%H%M%S)
train: $(TRAIN_STAMP)
	$(VENV)/bin/ulysses-jax train --preset tiny --mesh.fsdp 2 --mesh.sp 4 --seq-len 2048 --batch-size 2 \
		--steps 24 --checkpoint-every 8 --optim.lr 3e-3 --optim.warmup-steps 4 --run-dir $(RUN_DIR) $(TRAIN_ARGS)
