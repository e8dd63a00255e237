# gpu_preflight: its benchmark and its comparison with a real vLLM (CPU build).
.PHONY: preflight-bench preflight-vllm

# 119 sparse shards of a Kimi-K2.5-sized checkpoint (~590 GB): the analysis must take under a second.
preflight-bench: tools
	$(BIN)/python bench/preflight_speed.py --runs 5

# The predicted KV-cache tokens against vLLM's logged "CPU KV cache size" (within 1%); needs `make vllm-venv`.
preflight-vllm: tools
	$(BIN)/pytest -s tests/integration/test_gpu_preflight_vllm.py
