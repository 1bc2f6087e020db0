"""Benchmarks: each `meshserve bench ...` command; only the entry points import them."""

# the engine settings the benchmarks take as flags (declared with their types and help in meshserve.config);
# only flags given on the command line reach the engine. The HF baseline runs in the engine's dtype.
BENCH_ENGINE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_gb", "dtype",
                         "device", "num_threads", "parallel", "moe_comm")
