# Benchmarks that need more than the tool venv (the perf gate's needs the vLLM venv and the tiny model).
# The performance gate: load_probe's figures by concurrency, their spread, and the drop under a CPU quota.
.PHONY: bench-perf-gate
bench-perf-gate: tools models
	$(BIN)/python bench/perf_gate_figures.py
# load_probe against vLLM's own `vllm bench serve`, alternately on the same endpoint: both figures and their ratio.
.PHONY: bench-load-probe
bench-load-probe: tools models
	$(BIN)/python bench/load_probe_vs_vllm_bench.py
# The weights phase beside the disk's read rate, on tiny-kimi padded to gigabytes: bench/weights_rate.py.
.PHONY: bench-weights-rate
bench-weights-rate: tools models
	$(BIN)/python bench/weights_rate.py
