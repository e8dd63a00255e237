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
  over max_num_seqs × vocabulary float32 logits, whichever is larger (they run one after the other);
- non-torch memory grown since the worker's first snapshot (cuBLAS workspaces; NCCL and custom
  all-reduce buffers when tensor parallel);
- the CUDA-graph memory estimate, subtracted since vLLM 0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS);
- utilization × the memory nvidia-smi counts but CUDA does not offer (its total is smaller).

Where a term is not known, the estimate leans to the larger side: a reserve too small lets a start fail
after the weights are loaded, one too large only hides context.
"""

from typing import Optional

from ansible_collections.llmserve.vllm.plugins.module_utils._checkpoint import Config, text_config
from ansible_collections.llmserve.vllm.plugins.module_utils._preflight_common import GIB, MIB, ceil_div

# The constant the preflight used before this model, and still uses when config.json lacks the sizes.
FALLBACK_RESERVE_BYTES = 5 * GIB

# vLLM's defaults for `vllm serve` (engine/arg_utils.py, _set_default_args): GPUs of 70 GiB or more get
# max_num_seqs 1024 and max_num_batched_tokens 8192, smaller ones 256 and 2048.
LARGE_GPU_BYTES = 70 * GIB
DEFAULT_BATCHING_LARGE = (1024, 8192)
DEFAULT_BATCHING_SMALL = (256, 2048)

# Activations are bf16/fp16: 2 bytes an element.
ACTIVATION_BYTES = 2
# Per token of the profile run, elements alive at the MLP's peak: the gate/up output (2 × intermediate)
# and the activation's output (intermediate), from the source; and 3 × hidden (residual, norm output,
# attention output), fitted to the slope between the two RTX 3090 logs (20,000 and 29,000 tokens,
# 0.92 GiB apart: 109,760 B a token, against 110,592 here).
INTERMEDIATE_COPIES = 3
HIDDEN_COPIES = 3
# The sampler's dummy run holds float32 logits, probabilities and log-probabilities over the vocabulary.
SAMPLER_COPIES = 3
SAMPLER_BYTES = 4

# Non-torch memory grown during the profile: 0.35 GiB logged at tensor parallel 1 (RTX 3090, Llama-3.1-8B,
# vllm-project/vllm#10517). Tensor parallel adds NCCL's and the custom all-reduce's buffers: 256 MiB is a
# figure from vLLM's source (8 MiB IPC buffers per peer, NCCL's 4 MiB per channel), not a measurement; no
# measurement on an H200 was available when this was written.
NON_TORCH_BYTES = 360 * MIB
NON_TORCH_TP_BYTES = 256 * MIB

# CUDA graphs, estimated by vLLM and subtracted since 0.21 ("CUDA graph memory profiling is enabled (default
# since v0.21.0)"): 16 MiB a layer, against the 0.52 GiB vLLM 0.21 estimated for Qwen3-8B's 36 layers
# (LMCache/LMCache#3430). Before 0.21 the graphs came out of the (1 − utilization) headroom.
CUDAGRAPH_BYTES_PER_LAYER = 16 * MIB
CUDAGRAPH_ESTIMATE_SINCE = (0, 21)

# nvidia-smi's total less CUDA's (cudaMemGetInfo): 24576 MiB against 23.58 GiB logged on an RTX 3090
# (430 ± 5 MiB), rounded up.
DRIVER_RESERVED_BYTES = 448 * MIB


def default_batching(gpu_memory_bytes: int) -> tuple[int, int]:
    """vLLM's (max_num_seqs, max_num_batched_tokens) for `vllm serve` on a GPU of this size."""
    return DEFAULT_BATCHING_LARGE if gpu_memory_bytes >= LARGE_GPU_BYTES else DEFAULT_BATCHING_SMALL


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


def estimate(
    config: Config,
    tp: int,
    utilization: float,
    gpu_memory_bytes: int,
    max_num_seqs: Optional[int] = None,
    max_num_batched_tokens: Optional[int] = None,
    vllm_version: Optional[str] = None,
) -> dict[str, object]:
    """The reserve per GPU in bytes and its parts.

    max_num_seqs and max_num_batched_tokens default to vLLM's for `vllm serve` on this GPU; vllm_version
    (None: a current one) decides whether the CUDA-graph estimate is subtracted. Without hidden_size or
    vocab_size in config.json the reserve is FALLBACK_RESERVE_BYTES and 'estimated' is False.
    """
    seqs, tokens = default_batching(gpu_memory_bytes)
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
    sampler = seqs * vocab * SAMPLER_BYTES * SAMPLER_COPIES + tokens * hidden * ACTIVATION_BYTES
    version = version_tuple(vllm_version)
    terms = {
        'activation': max(forward, sampler),
        'non_torch': NON_TORCH_BYTES + (NON_TORCH_TP_BYTES if tp > 1 else 0),
        'cuda_graphs': 0
        if version is not None and version < CUDAGRAPH_ESTIMATE_SINCE
        else layers * CUDAGRAPH_BYTES_PER_LAYER,
        'driver': int(DRIVER_RESERVED_BYTES * utilization),
    }
    parts.update(terms, estimated=True, total=sum(terms.values()))
    return parts
