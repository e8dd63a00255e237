# SPDX-License-Identifier: GPL-3.0-or-later
# The ecosystem's own checks, as Galaxy and the Ansible docs site run them on a release:
#   make ecosystem  - galaxy-importer on the built tarball, antsibull-docs' and antsibull-changelog's
#                     lint, and shellcheck on every shell script of the repository
# Each is also a target of its own (ecosystem-import, -docs, -changelog, -shellcheck).
# Included by the Makefile, which exports PATH (.venv/bin first) and ANSIBLE_COLLECTIONS_PATH.
ECOSYSTEM_DIR := .build/ecosystem
ECOSYSTEM_VENV := $(ECOSYSTEM_DIR)/venv
ECOSYSTEM_BIN := $(abspath $(ECOSYSTEM_VENV))/bin
ECOSYSTEM_PYTHON_VERSION := 3.13

.PHONY: ecosystem ecosystem-import ecosystem-docs ecosystem-changelog ecosystem-shellcheck

ecosystem: ecosystem-import ecosystem-docs ecosystem-changelog ecosystem-shellcheck docsite

# The checkers run ansible, ansible-doc and ansible-galaxy by name: those of their venv's pinned
# ansible-core, not the tool venv's. Each makes its own collection path around what it checks.
ecosystem-import ecosystem-docs ecosystem-changelog: export PATH := $(ECOSYSTEM_BIN):$(PATH)

$(ECOSYSTEM_VENV)/.installed: tests/ecosystem-requirements.txt
	$(call need_python,$(ECOSYSTEM_PYTHON_VERSION),of galaxy-importer and antsibull)
	tools/cached-venv $(ECOSYSTEM_VENV) ecosystem $(call pyenv_python,$(ECOSYSTEM_PYTHON_VERSION)) \
	  -r tests/ecosystem-requirements.txt

# galaxy-importer exits 1 only when the import is refused; what it finds on the way (an
# ansible-doc failure, a bad doc string) it logs as ERROR or WARNING lines and still exits 0.
# Any such line fails here, so the import is as clean as Galaxy's log would be.
ecosystem-import: $(ECOSYSTEM_VENV)/.installed
	rm -rf $(ECOSYSTEM_DIR)/dist $(ECOSYSTEM_DIR)/tmp
	mkdir -p $(ECOSYSTEM_DIR)/dist $(ECOSYSTEM_DIR)/tmp
	$(ECOSYSTEM_BIN)/ansible-galaxy collection build --output-path $(ECOSYSTEM_DIR)/dist .
	cd $(ECOSYSTEM_DIR) && rc=0 && GALAXY_IMPORTER_CONFIG=$(abspath tests/galaxy-importer.cfg) \
	  GALAXY_IMPORTER_TMP_ROOT_DIR=$(abspath $(ECOSYSTEM_DIR)/tmp) GALAXY_IMPORTER_ANSIBLE_LOCAL_TMP=$(abspath $(ECOSYSTEM_DIR)/tmp) \
	  $(ECOSYSTEM_BIN)/python -m galaxy_importer.main dist/*.tar.gz >galaxy-importer.log 2>&1 || rc=$$?; \
	grep -v '^Loading ' galaxy-importer.log; \
	if [ $$rc -ne 0 ] || grep -qE '^(WARNING|ERROR|CRITICAL):' galaxy-importer.log \
	   || ! grep -qx 'Importer processing completed successfully' galaxy-importer.log; then \
	  echo "galaxy-importer: the import is not clean (exit status $$rc); whole log: $(ECOSYSTEM_DIR)/galaxy-importer.log" >&2; \
	  exit 1; \
	fi

# Prints nothing and exits 0 when clean; the tarball holds the same docs, so the checkout is linted.
ecosystem-docs: $(ECOSYSTEM_VENV)/.installed
	$(ECOSYSTEM_BIN)/antsibull-docs lint-collection-docs --plugin-docs .

ecosystem-changelog: $(ECOSYSTEM_VENV)/.installed
	$(ECOSYSTEM_BIN)/antsibull-changelog lint

# Every tracked or new file that is a shell script by its name (*.sh) or its first line (a sh, bash,
# dash or ksh shebang), so that a script added anywhere is checked without being listed here.
# No rule is excluded, unlike ansible-test's shellcheck test, which sees only *.sh files.
ecosystem-shellcheck: host-packages
	scripts=$$(git ls-files -co --exclude-standard | while IFS= read -r f; do \
	  [ -f "$$f" ] || continue; \
	  case "$$f" in *.sh) echo "$$f"; continue;; esac; \
	  head -n 1 "$$f" | grep -qE '^#! *(/usr/bin/env +|/usr/bin/|/bin/)(ba|da|k)?sh( |$$)' && echo "$$f" || true; \
	done); \
	[ -n "$$scripts" ] || { echo "shellcheck: no shell script found: the search above is broken" >&2; exit 1; }; \
	echo "shellcheck:" $$scripts; \
	printf '%s\n' "$$scripts" | xargs -d '\n' shellcheck

# The docsite as the Ansible docs site builds a collection's (antsibull-docs' collection command, then Sphinx with
# warnings as errors), with the project's pages (docs/*.md) beside the reference; docs/docsite/conf.py is Sphinx's
# configuration. Open $(DOCSITE_DIR)/build/html/index.html.
DOCSITE_DIR := .build/docsite
DOCSITE_TITLE := llmserve.vllm: production vLLM endpoints for very large models

.PHONY: docsite screenshots
docsite: export PATH := $(ECOSYSTEM_BIN):$(PATH)
docsite: $(ECOSYSTEM_VENV)/.installed
	rm -rf $(DOCSITE_DIR)
	mkdir -p -m 0755 $(DOCSITE_DIR)/rst/docs
	antsibull-docs collection --use-current --dest-dir $(DOCSITE_DIR)/rst llmserve.vllm
	cp docs/*.md $(DOCSITE_DIR)/rst/docs/
	{ printf '%s\n%s\n\n' '$(DOCSITE_TITLE)' "$$(echo '$(DOCSITE_TITLE)' | tr -c '\n' '=')"; \
	  for caption in 'Collection:collections/index' 'Plugins and roles:collections/index_*' 'Guides:docs/*'; do \
	    printf '.. toctree::\n   :maxdepth: 1\n   :caption: %s\n   :glob:\n\n   %s\n\n' "$${caption%%:*}" "$${caption#*:}"; \
	  done; } > $(DOCSITE_DIR)/rst/index.rst
	sphinx-build -M html $(DOCSITE_DIR)/rst $(DOCSITE_DIR)/build -c docs/docsite -W --keep-going -q

# Headless Chromium's screenshots of the docsite's front page and, with PROMETHEUS set (the molecule sandbox's is
# http://127.0.0.1:9391 while it runs), of that Prometheus's graphs of the dashboard's queries: each must show content.
# Needs Debian's chromium.
screenshots: docsite
	$(PYTHON) tools/screenshots.py --out .build/screenshots --page $(DOCSITE_DIR)/build/html/index.html \
	  $(if $(PROMETHEUS),--prometheus $(PROMETHEUS) --service $(or $(SERVICE),vllm-kimi))
