
# checkpoint_verify: digest throughput per core against sha256sum, 2 threads, and a
# cached rerun over 119 sparse shards of a Kimi-sized checkpoint (target under 1 s).
.PHONY: bench-verify
bench-verify: tools
	$(BIN)/python bench/checkpoint_verify_speed.py
