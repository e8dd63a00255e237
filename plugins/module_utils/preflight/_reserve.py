# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The reserve: GPU memory vLLM keeps outside the weights and the KV cache, in the terms vLLM itself uses.

PRIVATE to the collection: this is not a public API; it may change without notice.

vLLM sizes the KV cache as requested − (weights + activation peak + non-torch increase [+ CUDA-graph
estimate]), where requested = CUDA's total × gpu_memory_utilization (v1/worker/gpu_worker.py
determine_available_memory; worker/worker.py in V0). The preflight computes ceil(nvidia-smi's total ×
utilization) − weights − reserve, so the reserve is the sum of

- the activation peak of the profile run at max_num_batched_tokens tokens, or of the sampler's dummy run
  over max_num_seqs × vocabulary logits, whichever is larger (they run one after the other), by the
  sampler each vLLM version runs (sort-based; from 0.26 the Triton top-k/top-p of the seeded second run, over the
  mixture of experts' workspace that stays allocated; FlashInfer's sort-free one from 0.33);
- from 0.33, the model runner's per-sequence token counts for the penalties (max_num_seqs × vocabulary);
- non-torch memory grown since the worker's first snapshot (cuBLAS workspaces; NCCL and custom
  all-reduce buffers when tensor parallel);
- the CUDA-graph memory estimate, subtracted since vLLM 0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS);
- utilization × the memory nvidia-smi counts but CUDA does not offer (its total is smaller).

Where a term is not known, the estimate leans to the larger side: a reserve too small lets a start fail
after the weights are loaded, one too large only hides context.
"""

from typing import Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import Config, text_config
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._mla_workspace import next_power_of_2, sm_count_of
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import GIB, MIB, ceil_div

# The constant the preflight used before this model, and still uses when config.json lacks the sizes.
FALLBACK_RESERVE_BYTES = 5 * GIB

# vLLM's defaults for `vllm serve` (engine/arg_utils.py, _set_default_args): GPUs of 70 GiB or more get
# max_num_seqs 1024 and max_num_batched_tokens 8192, smaller ones 256 and 2048. From 0.33
# (EngineArgs.get_batch_defaults, read in 0.33.0 and 0.34.0) GPUs of 160 GiB or more get 1024 and 16384, and the
# A100 and the GB10 (DGX Spark) stay on the small tier whatever their memory.
LARGE_GPU_BYTES = 70 * GIB
DEFAULT_BATCHING_LARGE = (1024, 8192)
DEFAULT_BATCHING_SMALL = (256, 2048)
HUGE_GPU_BYTES = 160 * GIB
DEFAULT_BATCHING_HUGE = (1024, 16384)
SMALL_TIER_GPU_NAMES = ('A100', 'GB10')
BATCH_TIERS_SINCE = (0, 33)

# Activations are bf16/fp16: 2 bytes an element.
ACTIVATION_BYTES = 2
# Per token of the profile run, elements alive at the MLP's peak: the gate/up output (2 × intermediate)
# and the activation's output (intermediate), from the source; and 3 × hidden (residual, norm output,
# attention output), fitted to the slope between the two RTX 3090 logs (20,000 and 29,000 tokens,
# 0.92 GiB apart: 109,760 B a token, against 110,592 here).
INTERMEDIATE_COPIES = 3
HIDDEN_COPIES = 3
# The sampler's dummy run over max_num_seqs rows of the vocabulary (vLLM's _dummy_sampler_run; rows are
# min(max_num_seqs, max_num_batched_tokens) in V1), bytes a logit at its peak, read from each version's sampler:
# - PyTorch's sort-based top-k/top-p (V0, and V1 up to the releases where FlashInfer is an optional extra that a
#   plain `pip install vllm` leaves out): the bf16 logits, their float32 copy, the sorted values and the sort's
#   int64 indices (2 + 4 + 4 + 8) and the sort's own workspace, 38 in all (36 above the bf16 input, measured on an
#   H200; two logs with the same 256 x 151,936 logits, Qwen2.5-Math-1.5B on 0.7.2 V0 and Qwen3-235B on 0.10.2 V1,
#   both print a 1.40 GiB activation peak: 38.6 bytes a logit);
# - FlashInfer's sort-free sampler, modelled from vLLM 0.33 (VLLM_USE_FLASHINFER_SAMPLER; 0.26.0 already has it as a
#   dependency and on by default, but its seeded second run takes the Triton path below, which is what 0.26 counts):
#   the bf16 logits, the float32 copy, the top-k-masked logits and the probabilities, 14; where FlashInfer cannot
#   run, the Triton top-k/top-p that replaces it works in place (6, with a buffer of one row per SM).
# From 0.33 the model runner (V2) also keeps an int32 count of every token of every sequence for the penalties
# (PenaltiesState.output_bin_counts, max_num_seqs x vocabulary), allocated before the profile and counted in it.
SAMPLER_BYTES_PER_LOGIT_SORT = 38
SAMPLER_BYTES_PER_LOGIT_FLASHINFER = 14
PENALTY_COUNT_BYTES_PER_LOGIT = 4
FLASHINFER_SAMPLER_SINCE = (0, 33)
# vLLM 0.26 (read in 0.26.0's wheel): v1/worker/gpu_model_runner.py _dummy_sampler_run runs the sampler twice, the
# second time with a seeded generator, which sends it down TopKTopPSampler.forward_native whatever
# VLLM_USE_FLASHINFER_SAMPLER says (v1/sample/ops/topk_topp_sampler.py). There apply_top_k_top_p takes the Triton
# kernel for 8 rows or more (apply_top_k_top_p_triton, in place), then softmax and random_sample: alive at once are
# the bf16 logits (compute_logits), their float32 copy (Sampler.forward), the float32 probabilities and the float32
# exponential noise (empty_exponential_noise_like), 14 bytes a logit; and the Triton kernel's cached float32 buffer
# of min(next_power_of_2(min(SMs, rows)), SMs) rows of the vocabulary (_TRITON_BUFFER_CACHE), which stays allocated.
# The rows are the hidden states of the last token of each dummy request (_dummy_run's hidden_states[logit_indices]),
# and _dummy_sampler_run replaces them with torch.rand_like: two bf16 rows x hidden more.
TRITON_SAMPLER_SINCE = (0, 26)
SAMPLER_BYTES_PER_LOGIT_TRITON = 14
TRITON_SAMPLER_BUFFER_BYTES_PER_LOGIT = 4
SAMPLER_HIDDEN_ROW_COPIES = 2
# vLLM 0.26 (read in 0.26.0's wheel, and the same code in 0.33.0's): the fused MoE's modular kernel
# (model_executor/layers/fused_moe/modular_kernel.py _allocate_buffers) takes its intermediate buffers from the
# worker's shared workspace (v1/worker/workspace.py WorkspaceManager.get_simultaneous), which keeps its largest
# allocation for good: it is still held while the sampler's dummy run reaches its peak. For the Triton experts of an
# unquantized MoE (fused_moe/experts/triton_moe.py TritonExperts.workspace_shapes): two bf16 tensors of
# max_num_batched_tokens x top-k x max(2 x moe_intermediate / TP, hidden) elements (the first holds
# max(moe_intermediate / TP, hidden), at most as large); the output reuses the first. Quantized experts (FP8,
# NVFP4, INT4) run other kernels with other shapes, not modelled here.
MOE_WORKSPACE_SINCE = (0, 26)
MOE_WORKSPACE_TENSORS = 2

# Non-torch memory grown during the profile (cuBLAS workspaces and the like). vLLM 0.6 printed 0.35 GiB at tensor
# parallel 1 (RTX 3090, Llama-3.1-8B, vllm-project/vllm#10517); 0.7 and later, whose baseline is taken after the
# CUDA context exists, 0.01 to 0.25 GiB, tensor parallel included where the communicators are not counted (0.21 GiB
# at TP 8 on L40S, 0.25 GiB at TP 2 on RTX 4090); each rounded up.
NON_TORCH_BYTES = 360 * MIB
NON_TORCH_BYTES_SINCE_07 = 256 * MIB
# V0 (worker/worker.py init_device) takes its baseline snapshot before init_worker_distributed_environment, so
# the NCCL communicators it then builds count as non-torch memory; V1 (v1/worker/gpu_worker.py) takes it after,
# and they come out of the (1 - utilization) headroom instead. Two communicators (vLLM's PyNccl one and
# torch.distributed's device group), measured on an H200 pair: 0.820 GiB for the first, 0.475 GiB for the second
# (tests/fixtures/h200/nontorch_memory.json, tp2). NCCL keeps those buffers in device memory where the GPUs reach
# each other peer to peer (NVLink boards); GeForce and L40-class boards without peer access go through host
# shared memory (0.25 GiB non-torch at TP 2 on two RTX 4090s), so the term applies to the data-centre boards.
NCCL_COMMUNICATORS_BYTES = 1326 * MIB
# NCCL's NVLink SHARP buffers on NVSwitch Hopper boards at more than two GPUs. Not measured: the one log with the
# figure (DeepSeek-R1, 8 x H200, vLLM 0.7.3 V0) prints 7.16 GiB of non-torch memory, 5.5 GiB more than the two
# terms above; that excess, rounded up, until a measurement replaces it.
NVLS_BYTES = 5632 * MIB
NVLS_GPU_NAMES = ('H100 80GB HBM3', 'H100 SXM', 'H200', 'H800', 'H20')
PEER_GPU_NAMES = ('A100', 'A800', 'H100', 'H200', 'H800', 'H20', 'B200', 'B300', 'GB200', 'GB300')
NVLS_MIN_TP = 4
# vLLM versions before this ran V0's accounting; 0.8 and 0.9 could fall back to V0 (pipeline parallel without
# Ray, some attention backends), so they get V0's larger reserve too.
V1_ACCOUNTING_SINCE = (0, 10)

# CUDA graphs, estimated by vLLM and subtracted since 0.21 ("CUDA graph memory profiling is enabled (default
# since v0.21.0)"): 16 MiB a layer, against the 0.52 GiB vLLM 0.21 estimated for Qwen3-8B's 36 layers
# (LMCache/LMCache#3430). Before 0.21 the graphs came out of the (1 − utilization) headroom.
CUDAGRAPH_BYTES_PER_LAYER = 16 * MIB
CUDAGRAPH_ESTIMATE_SINCE = (0, 21)

# nvidia-smi's total less CUDA's (cudaMemGetInfo), which is what vLLM multiplies by the utilization: the memory
# nvidia-smi reports as reserved (memory.reserved). The host's own reading is best (estimate's driver_reserved);
# without it, measured on an H200: 616 MiB (tests/fixtures/h200/nontorch_memory.json, smi_reserved_mib); elsewhere
# it depends on the board and the driver, 430 to 625 MiB in the collected logs (RTX 3090 24576 MiB against
# 23.58 GiB; A100-SXM4-40GB 40960 MiB against 39.39 GiB), so the larger, rounded up.
# On the H100 80GB HBM3 of tests/fixtures/gpu_run/device.txt (driver 580.159.04): nvidia-smi's 81,559 MiB against
# torch's total_memory of 85,017,493,504 bytes (81,078.5 MiB), 480.5 MiB; rounded up.
DRIVER_RESERVED_BYTES = {'H200': 616 * MIB, 'H100 80GB HBM3': 481 * MIB}
DRIVER_RESERVED_DEFAULT = 640 * MIB


# The encoder of a model that serves images (vLLM V1's profile_run and its encoder budget,
# v1/core/encoder_cache_manager.py compute_mm_encoder_budget; 0.32-0.33): the encoder cache holds
# max(max_num_batched_tokens, the tokens of the largest item) embeddings of the language model's hidden
# size, and the profile run keeps the dummy items' outputs (as many whole items as that budget takes) alive
# through the language model's dummy run, so they add to its peak. Kimi-K2.5's largest image is 4225
# tokens, within the default 8192; its encoder's own activations are transient and not modelled.


def default_batching(
    gpu_memory_bytes: int, gpu_name: str = '', version: Optional[tuple[int, int]] = None
) -> tuple[int, int]:
    """vLLM's (max_num_seqs, max_num_batched_tokens) for `vllm serve` on a GPU of this size and name, by release
    (None: a current one)."""
    if version is not None and version < BATCH_TIERS_SINCE:
        return DEFAULT_BATCHING_LARGE if gpu_memory_bytes >= LARGE_GPU_BYTES else DEFAULT_BATCHING_SMALL
    if gpu_memory_bytes >= HUGE_GPU_BYTES:
        return DEFAULT_BATCHING_HUGE
    small_tier = any(name.lower() in gpu_name.lower() for name in SMALL_TIER_GPU_NAMES)
    return DEFAULT_BATCHING_LARGE if gpu_memory_bytes >= LARGE_GPU_BYTES and not small_tier else DEFAULT_BATCHING_SMALL


def version_tuple(version: Optional[str]) -> Optional[tuple[int, int]]:
    """(major, minor) of a vLLM version such as 0.6.4 or 0.21.0rc1, None when not given or not a version."""
    parts = (version or '').split('.')
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _field(config: Config, key: str) -> Optional[int]:
    value = text_config(config).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def activation_elements_per_token(config: Config, tp: int) -> Optional[int]:
    """Elements a token of the profile run keeps alive at the MLP's peak, on one GPU; None without hidden_size.

    Dense: 3 × intermediate / TP + 3 × hidden. Mixture of experts (fused MoE): each of the top-k experts
    holds its gate/up and activation outputs and a hidden-sized output that tensor parallel does not split.
    """
    hidden = _field(config, 'hidden_size')
    if hidden is None:
        return None
    dense = INTERMEDIATE_COPIES * ceil_div(_field(config, 'intermediate_size') or 4 * hidden, tp)
    moe_intermediate = _field(config, 'moe_intermediate_size')
    top_k = _field(config, 'num_experts_per_tok')
    if moe_intermediate and top_k:
        per_expert = INTERMEDIATE_COPIES * ceil_div(moe_intermediate, tp) + hidden
        dense = max(dense, top_k * per_expert)
    return dense + HIDDEN_COPIES * hidden


def v0_accounting(version: Optional[tuple[int, int]]) -> bool:
    """Whether a vLLM of this (major, minor) counts the NCCL communicators in its non-torch memory (V0's
    accounting); None, a current vLLM, does not."""
    return version is not None and version < V1_ACCOUNTING_SINCE


def non_torch_bytes(tp: int, gpu_name: str, version: Optional[tuple[int, int]]) -> int:
    """Non-torch memory vLLM subtracts, per GPU: the profile's own growth, and under V0's accounting on
    peer-to-peer boards the NCCL communicators (and NVLink SHARP buffers on NVSwitch Hopper boards beyond two GPUs)."""
    total = NON_TORCH_BYTES if version is not None and version < (0, 7) else NON_TORCH_BYTES_SINCE_07
    if v0_accounting(version) and tp > 1 and any(name in gpu_name for name in PEER_GPU_NAMES):
        total += NCCL_COMMUNICATORS_BYTES
        if tp >= NVLS_MIN_TP and any(name in gpu_name for name in NVLS_GPU_NAMES):
            total += NVLS_BYTES
    return total


def sampler_run_bytes(
    rows: int, vocab: int, hidden: int, tokens: int, version: Optional[tuple[int, int]], gpu_name: str
) -> int:
    """The sampler's dummy run at its peak, with the batch's hidden states it keeps alive (bf16, tokens x hidden):
    rows x vocabulary logits at the bytes a logit of this release's sampler, and from 0.26 the Triton top-k/top-p's
    buffer (one row of the vocabulary a program, capped at the SM count: the uncapped rows for a GPU SM_COUNTS does
    not know) and the two copies of the rows' hidden states."""
    batch = tokens * hidden * ACTIVATION_BYTES
    if version is not None and TRITON_SAMPLER_SINCE <= version < FLASHINFER_SAMPLER_SINCE:
        sms = sm_count_of(gpu_name)
        buffer_rows = next_power_of_2(rows) if sms is None else min(next_power_of_2(min(sms, rows)), sms)
        return (
            rows * vocab * SAMPLER_BYTES_PER_LOGIT_TRITON
            + buffer_rows * vocab * TRITON_SAMPLER_BUFFER_BYTES_PER_LOGIT
            + SAMPLER_HIDDEN_ROW_COPIES * rows * hidden * ACTIVATION_BYTES
            + batch
        )
    flashinfer = version is None or version >= FLASHINFER_SAMPLER_SINCE
    per_logit = SAMPLER_BYTES_PER_LOGIT_FLASHINFER if flashinfer else SAMPLER_BYTES_PER_LOGIT_SORT
    return rows * vocab * per_logit + batch


def moe_workspace_bytes(
    config: Config, tp: int, tokens: int, version: Optional[tuple[int, int]], quantized: bool
) -> int:
    """The Triton experts' intermediate buffers that the shared workspace keeps through the sampler's run, on one GPU,
    from vLLM 0.26 for an unquantized mixture of experts; 0 elsewhere (older releases, dense models, quantized
    experts, whose kernels this does not model)."""
    hidden = _field(config, 'hidden_size')
    moe_intermediate = _field(config, 'moe_intermediate_size')
    top_k = _field(config, 'num_experts_per_tok')
    since = version is None or version >= MOE_WORKSPACE_SINCE
    if quantized or not since or not (hidden and moe_intermediate and top_k):
        return 0
    width = max(2 * ceil_div(moe_intermediate, tp), hidden)
    return MOE_WORKSPACE_TENSORS * tokens * top_k * width * ACTIVATION_BYTES


def driver_reserved_bytes(gpu_name: str) -> int:
    """nvidia-smi's total less the total CUDA reports, for this GPU: measured where known, else the larger figure."""
    for name, reserved in DRIVER_RESERVED_BYTES.items():
        if name in gpu_name:
            return reserved
    return DRIVER_RESERVED_DEFAULT


def estimate(
    config: Config,
    tp: int,
    utilization: float,
    gpu_memory_bytes: int,
    max_num_seqs: Optional[int] = None,
    max_num_batched_tokens: Optional[int] = None,
    vllm_version: Optional[str] = None,
    gpu_name: str = '',
    driver_reserved: Optional[int] = None,
    serves_images: bool = False,
    eager: bool = False,
    quantized: bool = False,
) -> dict[str, object]:
    """The reserve per GPU in bytes and its parts.

    max_num_seqs and max_num_batched_tokens default to vLLM's for `vllm serve` on this GPU; vllm_version
    (None: a current one) decides V0's or V1's accounting of the NCCL communicators and whether the CUDA-graph
    estimate is subtracted; gpu_name (nvidia-smi's) the peer-to-peer and NVLink SHARP terms and, unless
    driver_reserved (nvidia-smi's memory.reserved, bytes) is given, the driver's reserved memory.
    serves_images (a vision tower, not --language-model-only) adds the encoder's outputs that vLLM's profile run
    keeps alive through the language model's dummy run, which as many embeddings as its encoder cache holds can
    match at run time. eager (--enforce-eager) captures no CUDA graphs, so vLLM estimates none; quantized (the
    checkpoint's weights are) leaves the unquantized Triton experts' workspace out.
    Without hidden_size or vocab_size in config.json the reserve is FALLBACK_RESERVE_BYTES and 'estimated' is False.
    """
    version = version_tuple(vllm_version)
    seqs, tokens = default_batching(gpu_memory_bytes, gpu_name, version)
    seqs = max_num_seqs or seqs
    tokens = max_num_batched_tokens or tokens
    per_token = activation_elements_per_token(config, tp)
    vocab = _field(config, 'vocab_size')
    layers = _field(config, 'num_hidden_layers') or 0
    parts: dict[str, object] = {'max_num_seqs': seqs, 'max_num_batched_tokens': tokens}
    if per_token is None or vocab is None:
        parts.update(estimated=False, total=FALLBACK_RESERVE_BYTES)
        return parts
    hidden = _field(config, 'hidden_size') or 0
    forward = tokens * per_token * ACTIVATION_BYTES
    flashinfer = version is None or version >= FLASHINFER_SAMPLER_SINCE
    rows = seqs if v0_accounting(version) else min(seqs, tokens)
    sampler = sampler_run_bytes(rows, vocab, hidden, tokens, version, gpu_name)
    sampler += moe_workspace_bytes(config, tp, tokens, version, quantized)
    no_graphs = eager or (version is not None and version < CUDAGRAPH_ESTIMATE_SINCE)
    terms = {
        'activation': max(forward, sampler),
        'penalty_counts': seqs * vocab * PENALTY_COUNT_BYTES_PER_LOGIT if flashinfer else 0,
        'non_torch': non_torch_bytes(tp, gpu_name, version),
        'cuda_graphs': 0 if no_graphs else layers * CUDAGRAPH_BYTES_PER_LAYER,
        'driver': int(
            (driver_reserved if driver_reserved is not None else driver_reserved_bytes(gpu_name)) * utilization
        ),
        'encoder_outputs': tokens * hidden * ACTIVATION_BYTES if serves_images else 0,
    }
    parts.update(terms, estimated=True, total=sum(terms.values()))
    return parts
