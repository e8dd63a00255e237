# The sandbox host (tools/sandbox), the tiny chat models, the demo, molecule and
# the deploy benchmark. Included by the Makefile, which exports PATH (.venv/bin
# first) and ANSIBLE_COLLECTIONS_PATH.
SANDBOX_TOOL := tools/sandbox
DEMO_SANDBOX := sandbox
# inventories/sandbox/hosts.yml reaches the demo sandbox on these ports.
DEMO_SSH_PORT := 2222
DEMO_VLLM_PORT := 8000
DEMO_FRONT_PORT := 8443

.PHONY: cache-report models models-core fakehub-early fakehub-up fakehub-down sandbox-up sandbox-down demo molecule molecule-create molecule-test molecule-fleet molecule-fleet-create molecule-fleet-test bench-deploy bench-warm-start bench-streaming-restart

# The sandbox inventory stages the miniature of Kimi-K2.5 (llmserve/tiny-kimi) from the project's
# own Hub (tools/fake_hub.py) on this port, under the commits it pins: the right model and, as other
# revisions, each of those that must fail a gate and one that must pass (the inventory's "#   <name>: <commit>"
# lines).
FAKEHUB_PORT := 8090
FAKEHUB_DIR := .cache/fakehub
SANDBOX_VARS := inventories/sandbox/group_vars/vllm.yml
FAKEHUB_REVISION := $(shell sed -n 's/^vllm_kimi_model_revision: *//p' $(SANDBOX_VARS))
sandbox_revision = $(shell sed -n 's/^\#   $(1): \([0-9a-f]\{40\}\) .*/\1/p' $(SANDBOX_VARS))
# Published as tiny-kimi-<name>, from the models of the same name.
FAKEHUB_OTHER_REVISIONS := wrong heavy thinks-forever ignores-tools forgets-long paris-france
# The wrong revision comes at 200 kB/s, so that its fetch (2.5 MB) lasts about 12 s: the sandbox test of the
# fetch's progress lines (tests/integration/sandbox/test_changes.py) sees it come in.
FAKEHUB_SLOW := --slow $(call sandbox_revision,wrong)=200000

# Trained with the vLLM venv's torch/transformers; cached in $(LLMSERVE_CACHE)/models, keyed by the script and
# the versions of those libraries.
MAKE_MODELS := $(VLLM_VENV)/bin/python tools/make_tiny_models.py
models: vllm-venv
	$(MAKE_MODELS) >/dev/null

# Which of make test's caches (LLMSERVE_CACHE, the Makefile) this run finds, before any stage builds one. The tiny
# models' key holds the vLLM venv's torch and transformers: read from the cached venv before the checkout links it;
# without either, the models stage says (hit or miss).
cache-report:
	@echo "caches under $(LLMSERVE_CACHE) (a miss is built by the stage that needs it):"
	@echo "  vLLM venv: $$(if [ -f $(VLLM_VENV_CACHE)/.installed ]; then echo hit, $(VLLM_VENV_CACHE); else echo miss; fi)"
	@echo "  sandbox base tree: $$($(SANDBOX_TOOL) rootfs --cached)"
	@python=$(VLLM_VENV)/bin/python; [ -x $$python ] || python=$(VLLM_VENV_CACHE)/bin/python; \
	  echo "  tiny models: $$(if [ -x $$python ]; then $$python tools/make_tiny_models.py --cached; \
	  else echo 'told by the models stage, once the vLLM venv is built'; fi)"
	@echo "  pip downloads for the sandboxes' releases: $$(du -sh $(LLMSERVE_CACHE)/pip 2>/dev/null | cut -f1 || echo none)"
	@echo "  checked releases kept (molecule/default/vars/release_cache.yml; molecule's create says hit or miss):" \
	  "$$(cd $(LLMSERVE_CACHE)/releases 2>/dev/null && ls -d */* 2>/dev/null | tr '\n' ' ' || true)"

# What the sandbox inventory deploys, tiny-chat and tiny-kimi: minutes before the failing revisions are trained.
models-core: vllm-venv
	$(MAKE_MODELS) --core >/dev/null

# Stops the fake Hub this checkout started, where one runs.
FAKEHUB_STOP = if [ -f $(FAKEHUB_DIR)/pid ]; then kill $$(cat $(FAKEHUB_DIR)/pid) 2>/dev/null || true; rm -f $(FAKEHUB_DIR)/pid; fi

# The fake Hub, (re)started each time on a fresh root, so that it serves the models as they are now:
# tiny-kimi from the shell variable core's directory, each failing revision from the variable models' directory
# with the option $(1) (--publish: at once; --publish-when-ready: once that directory exists).
define fakehub_start
	mkdir -p $(FAKEHUB_DIR)
	$(FAKEHUB_STOP)
	rm -rf $(FAKEHUB_DIR)/root
	core=$$($(MAKE_MODELS) --core | tail -1); models=$${core%-core}; \
	  $(2) \
	  setsid $(PYTHON) tools/fake_hub.py --root $(FAKEHUB_DIR)/root --port $(FAKEHUB_PORT) --quiet $(FAKEHUB_SLOW) \
	    $(foreach name,$(FAKEHUB_OTHER_REVISIONS),$(1) llmserve/tiny-kimi=$$models/tiny-kimi-$(name)@$(call sandbox_revision,$(name))) \
	    --publish llmserve/tiny-kimi=$$core/tiny-kimi@$(FAKEHUB_REVISION) \
	    > $(FAKEHUB_DIR)/log 2>&1 < /dev/null & echo $$! > $(FAKEHUB_DIR)/pid
	for i in $$(seq 50); do grep -q '^fake hub serving' $(FAKEHUB_DIR)/log && exit 0; sleep 0.2; done; \
	  cat $(FAKEHUB_DIR)/log; exit 1
endef

fakehub-up: models
	$(call fakehub_start,--publish,)

# make test's default scenario converges with tiny-kimi while the models lane still trains the failing revisions
# (where no lane trains them, a training started here does: it waits on the lane's lock where one does); they
# are served once made, and the scenario's verify waits for them (tests/integration/sandbox/conftest.py).
fakehub-early: models-core
	$(call fakehub_start,--publish-when-ready,[ -f $$models/DONE ] || { setsid $(MAKE_MODELS) > $(FAKEHUB_DIR)/models.log 2>&1 < /dev/null & };)

# Stops the fake Hub a molecule target started: once its scenario is done, nothing of make test is left running.
fakehub-down:
	$(FAKEHUB_STOP)

# Builds the Debian tree once ($(LLMSERVE_CACHE)/sandbox/rootfs-*), then boots in seconds;
# a sandbox that is up is left as it is.
sandbox-up: models fakehub-up
	$(SANDBOX_TOOL) create $(DEMO_SANDBOX) --ssh-port $(DEMO_SSH_PORT) --port $(DEMO_VLLM_PORT) --port $(DEMO_FRONT_PORT) >/dev/null

# Powers it off and checks that no process, mount or listening port is left.
sandbox-down:
	$(SANDBOX_TOOL) destroy $(DEMO_SANDBOX) >/dev/null

# Deploys with the collection's playbook, then asks the gate's question again
# (playbooks/gate.yml) so that a rerun with nothing to change still shows the answer.
demo: tools sandbox-up
	$(BIN)/ansible-playbook -i inventories/sandbox playbooks/deploy.yml
	$(BIN)/ansible-playbook -i inventories/sandbox playbooks/gate.yml

# The default scenario in two parts: create -> prepare (a fresh sandbox and its Prometheus, no model
# needed, so make test runs it beside the models' training), then check -> converge -> idempotence ->
# verify (testinfra + the fault scenarios of tests/integration/sandbox) -> destroy on that sandbox
# (molecule skips the create and prepare it already did).
molecule: molecule-create
	$(MAKE) --no-print-directory molecule-test

# molecule's create runs prepare too.
molecule-create: tools
	$(BIN)/molecule destroy
	$(BIN)/molecule create

# The recipes run under `set -e` (.SHELLFLAGS): `|| status=$$?` keeps a failed scenario from skipping the fake Hub's stop.
molecule-test: tools models-core fakehub-early
	status=0; $(BIN)/molecule test || status=$$?; $(MAKE) --no-print-directory fakehub-down; exit $$status

# Three replica sandboxes: rolling changes through playbooks/upgrade.yml, a
# capacity floor, a change bad for one host, drain and undrain. In two parts, as the default scenario: the
# sandboxes are destroyed, booted and seeded with the kept releases (no model, no vLLM start: make test runs
# this beside the default scenario), then syntax -> converge -> verify -> destroy (molecule skips the create
# it already did).
molecule-fleet: molecule-fleet-create
	$(MAKE) --no-print-directory molecule-fleet-test

molecule-fleet-create: tools
	$(BIN)/molecule destroy -s fleet
	$(BIN)/molecule create -s fleet

molecule-fleet-test: tools models fakehub-up
	status=0; $(BIN)/molecule test -s fleet || status=$$?; $(MAKE) --no-print-directory fakehub-down; exit $$status

# First deploy, no-op rerun, restart-to-coherent-answer: bench/deploy_figures.py.
bench-deploy: tools models fakehub-up
	$(BIN)/python bench/deploy_figures.py

# A start's ledger cold and warm, with torch.compile on, on the demo sandbox: bench/warm_start.py.
bench-warm-start: demo
	$(BIN)/python bench/warm_start.py

# What clients streaming through the front door see during a restart, on the demo sandbox: bench/streaming_restart.py.
bench-streaming-restart: demo
	$(BIN)/python bench/streaming_restart.py
	$(BIN)/python bench/streaming_restart.py --change
