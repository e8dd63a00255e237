# Benchmarks that need more than the tool venv (the perf gate's needs the vLLM venv and the tiny model).
# The performance gate: load_probe's figures by concurrency, their spread, and the drop under a CPU quota.
.PHONY: bench-perf-gate
bench-perf-gate: tools models
	$(BIN)/python bench/perf_gate_figures.py
