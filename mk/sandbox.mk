# The sandbox host (tools/sandbox), the tiny chat models, the demo, molecule and
# the deploy benchmark. Included by the Makefile, which exports PATH (.venv/bin
# first) and ANSIBLE_COLLECTIONS_PATH.
SANDBOX_TOOL := tools/sandbox
DEMO_SANDBOX := sandbox
# inventories/sandbox/hosts.yml reaches the demo sandbox on these ports.
DEMO_SSH_PORT := 2222
DEMO_VLLM_PORT := 8000

.PHONY: models sandbox-up sandbox-down demo molecule molecule-fleet bench-deploy

# Trained with the vLLM venv's torch/transformers; cached by the script's hash.
models: vllm-venv
	$(VLLM_VENV)/bin/python tools/make_tiny_models.py >/dev/null

# Builds the Debian tree once (.cache/sandbox/rootfs-*), then boots in seconds;
# a sandbox that is up is left as it is.
sandbox-up: models
	$(SANDBOX_TOOL) create $(DEMO_SANDBOX) --ssh-port $(DEMO_SSH_PORT) --port $(DEMO_VLLM_PORT) >/dev/null

# Powers it off and checks that no process, mount or listening port is left.
sandbox-down:
	$(SANDBOX_TOOL) destroy $(DEMO_SANDBOX) >/dev/null

# Deploys with the collection's playbook, then asks the gate's question again
# (playbooks/gate.yml) so that a rerun with nothing to change still shows the answer.
demo: tools sandbox-up
	$(BIN)/ansible-playbook -i inventories/sandbox playbooks/deploy.yml
	$(BIN)/ansible-playbook -i inventories/sandbox playbooks/gate.yml

# create -> converge -> idempotence -> verify (testinfra + the fault scenarios
# of tests/integration/sandbox) -> destroy, on a sandbox of its own.
molecule: tools models
	$(BIN)/molecule test

# Three replica sandboxes: rolling changes through playbooks/upgrade.yml, a
# capacity floor, a change bad for one host, drain and undrain.
molecule-fleet: tools models
	$(BIN)/molecule test -s fleet

# First deploy, no-op rerun, restart-to-coherent-answer: bench/deploy_figures.py.
bench-deploy: tools models
	$(BIN)/python bench/deploy_figures.py
