# SPDX-License-Identifier: GPL-3.0-or-later
# make check: the inner loop, to run before each commit (at most 5 minutes on a 2-core machine; CONTRIBUTING.md):
#   - lint of what changed since HEAD (committed or not, untracked included): yamllint, ruff (lint and format);
#   - the unit tests (tests/unit), on every core;
#   - the unit tests that need no vLLM, and the integration tests that need neither vLLM nor a sandbox host nor a
#     minute or more (tests/integration, marked neither vllm nor sandbox nor slow: the modules and the role through
#     ansible-playbook on this machine), on every core.
# make test runs all of it and the rest (mypy, ansible-lint, sanity, the matrix, vLLM, the sandboxes).
# Included by the Makefile, which exports PATH (.venv/bin first) and ANSIBLE_COLLECTIONS_PATH.
.PHONY: check

# What changed: the work tree against HEAD, plus files git does not know yet; deleted files are gone, not linted.
CHANGED_FILES = { git diff --name-only --diff-filter=d HEAD; git ls-files --others --exclude-standard; } | sort -u
CHECK_WORKERS := $(shell nproc)

check: tools promtool
	@changed=$$($(CHANGED_FILES)); \
	yaml=$$(printf '%s\n' $$changed | grep -E '\.ya?ml$$' || true); \
	python=$$(printf '%s\n' $$changed | grep -xE '$(subst $(eval) ,|,$(ROLE_PROGRAMS))|(plugins|tests|tools|bench|molecule)/.*\.py' || true); \
	echo "make check: $$(printf '%s\n' $$yaml | grep -c . || true) YAML and $$(printf '%s\n' $$python | grep -c . || true) Python files changed since HEAD"; \
	if [ -n "$$yaml" ]; then $(BIN)/yamllint -s $$yaml; fi; \
	if [ -n "$$python" ]; then $(BIN)/ruff check $$python && $(BIN)/ruff format --check $$python; fi
	$(BIN)/pytest -q -n $(CHECK_WORKERS) -p no:cacheprovider -m 'unit and not vllm' tests/unit
	$(BIN)/pytest -q -n $(CHECK_WORKERS) -p no:cacheprovider -m 'controller and not vllm and not sandbox and not slow' \
	  tests/integration
