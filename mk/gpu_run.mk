# The recorded run on the lent GPU machine (docs/testing.md, "A recorded run on a real GPU"): vLLM's CUDA build
# serves the GPU miniature and a synthetic DeepSeek-V3-shaped checkpoint there with the role's own plan. Nothing here
# runs in CI: the tests read what the run recorded, under tests/fixtures/gpu_run.
.PHONY: gpu-run-payload gpu-run-plan gpu-run-stage gpu-run-fixtures

GPU_RUN_RELEASE ?= 0.26.0
GPU_RUN_BUILD := .build/gpu_run
# What a device call carries: a folder of the session's checkout that git ignores, named in the call's `carry`.
GPU_RUN_CARRY ?= $(CURDIR)/.gpu-run
# Where the checkpoints lie, here for the preflight (the miniature as the plan left it, which is what is staged) and
# there for vLLM: the argv is used there as rendered here.
GPU_RUN_ROOT := /tmp/gpu-run
# The device's files of the last call (the device tool's files_at).
GPU_RUN_FILES ?=
GPU_RUN_PLAYBOOK = $(BIN)/ansible-playbook -i tools/gpu_run/plan/hosts.yml tools/gpu_run/plan/plan.yml
# tiny-kimi with DeepSeek's head sizes (tools/gpu_run/miniature.py), cached on its own: CI's models stay as they are.
GPU_RUN_MINIATURE = $(shell $(VLLM_VENV)/bin/python tools/gpu_run/miniature.py | tail -n 1)

# vLLM and what it imports beyond the device's packages, for Python 3.12: three parts of about 40 MiB.
gpu-run-payload: tools
	$(BIN)/python tools/gpu_run/payload.py build --release $(GPU_RUN_RELEASE) --out $(GPU_RUN_BUILD)/$(GPU_RUN_RELEASE)

# The role's plans for each GPU a device call may get (an H100 or an H200): the GPU miniature eager and as the role
# serves it (CUDA graphs), the synthetic checkpoint (its header-only shards: what the preflight reads) eager and
# compiled.
gpu-run-plan: tools
	rm -rf $(GPU_RUN_ROOT)/model $(GPU_RUN_ROOT)/synthetic $(GPU_RUN_BUILD)/plan
	mkdir -p $(GPU_RUN_ROOT)/tls
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 7 -subj /CN=device \
	  -addext subjectAltName=DNS:device -keyout $(GPU_RUN_ROOT)/tls/device.key -out $(GPU_RUN_ROOT)/tls/device.pem 2>/dev/null
	chmod 600 $(GPU_RUN_ROOT)/tls/device.key
	cp -r $(GPU_RUN_MINIATURE) $(GPU_RUN_ROOT)/model
	$(BIN)/python tools/gpu_run/synthetic.py headers --out $(GPU_RUN_ROOT)/synthetic
	for gpu in h100 h200; do \
	  out=$(abspath $(GPU_RUN_BUILD))/plan/$$gpu; \
	  mkdir -p $$out/miniature-eager $$out/miniature $$out/synthetic-eager $$out/synthetic-compiled; \
	  $(GPU_RUN_PLAYBOOK) -e @tools/gpu_run/plan/$$gpu.yml -e gpu_run_out=$$out/miniature-eager \
	    -e '{"vllm_kimi_extra_args": ["--enforce-eager"]}'; \
	  $(GPU_RUN_PLAYBOOK) -e @tools/gpu_run/plan/$$gpu.yml -e gpu_run_out=$$out/miniature; \
	  $(GPU_RUN_PLAYBOOK) -e @tools/gpu_run/plan/$$gpu.yml -e gpu_run_out=$$out/synthetic-eager \
	    -e @tools/gpu_run/plan/synthetic.yml -e '{"vllm_kimi_extra_args": ["--enforce-eager"]}'; \
	  $(GPU_RUN_PLAYBOOK) -e @tools/gpu_run/plan/$$gpu.yml -e gpu_run_out=$$out/synthetic-compiled \
	    -e @tools/gpu_run/plan/synthetic.yml; \
	done

# The three folders the device calls carry (c1, c2, c3), laid out at once; the commands to run there, one a call, are
# tools/gpu_run/calls.txt. Issue them back to back: the device keeps ~/stage only 30 s after a reply.
gpu-run-stage: tools
	$(BIN)/python tools/gpu_run/payload.py stage --into $(GPU_RUN_CARRY) --model $(GPU_RUN_ROOT)/model \
	  --out $(GPU_RUN_BUILD)/$(GPU_RUN_RELEASE) --plans $(GPU_RUN_BUILD)/plan
	@grep -v '^#' tools/gpu_run/calls.txt

# What the last call brought back, kept as fixtures: make gpu-run-fixtures GPU_RUN_FILES=<files_at>
gpu-run-fixtures:
	test -d "$(GPU_RUN_FILES)" || { echo 'GPU_RUN_FILES must name the folder the device call'"'"'s files lie in'; exit 1; }
	cp $(GPU_RUN_FILES)/* tests/fixtures/gpu_run/
	# vLLM's progress bars redraw with carriage returns; ansible-test's line-endings check refuses them.
	sed -i 's/\r//g' tests/fixtures/gpu_run/*.log
