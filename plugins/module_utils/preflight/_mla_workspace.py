# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""TRITON_MLA's decode workspace: memory vLLM reserves during its profile run, out of the KV-cache budget.

PRIVATE to the collection: this is not a public API; it may change without notice.

Read in vLLM 0.33.0's and 0.34.0's wheels (vllm#46819):

- vllm/v1/attention/backends/mla/triton_mla.py, TritonMLAImpl.reserve_workspace: called by MLAAttention's forward
  when attn_metadata is None, that is inside the profile run (vllm/model_executor/layers/attention/mla_attention.py),
  it asks the shared workspace (vllm/v1/worker/workspace.py, WorkspaceManager.get_simultaneous) for one float32
  tensor of (max_num_seqs x max_decode_query_len, num_heads x dcp_world_size, splits, kv_lora_rank + 1), where
  num_heads is the attention heads on one tensor-parallel rank and max_decode_query_len is 1 without speculative
  decoding (vllm/v1/attention/backend.py). The workspace stays allocated, so gpu_worker.determine_available_memory
  counts it in the profile's non-KV memory.
- _compute_num_kv_splits: splits = min(triton.next_power_of_2(max(1, max_model_len // 512)), 2 x SM count), the SM
  count being current_platform.num_compute_units() (CUDA's multi_processor_count); _reserve_attn_logits_workspace
  passes model_config.max_model_len (0.34 clamps it to a sliding window, which an MLA checkpoint has none of).
- vLLM 0.32 reserved the same tensor in TritonMLAMetadataBuilder.__init__ only, after the profile run, so it came
  out of the (1 - gpu_memory_utilization) headroom instead of the KV cache: the term starts with 0.33.
- Which GPUs run TRITON_MLA (vllm/platforms/cuda.py, _get_backend_priorities, dense MLA): it is the first choice on
  compute capability 12.x and the only one below 9.x (FLASH_ATTN_MLA needs 9.x, FLASHMLA 9.x or 10.x, FLASHINFER_MLA
  and CUTLASS_MLA 10.x); Hopper and datacenter Blackwell pick those and reserve no such workspace. A sparse MLA
  checkpoint (DeepSeek-V3.2's index_topk, which the sparse backends require) runs a sparse backend instead.
"""

from typing import Any, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import Config, is_mla, text_config
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._model_config import config_int
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import ceil_div

WORKSPACE_IN_PROFILE_SINCE = (0, 33)
MIN_WORK_PER_SPLIT = 512  # triton_mla.py _MIN_WORK_PER_SPLIT
SPLIT_OCCUPANCY_MULTIPLIER = 2  # triton_mla.py _SPLIT_OCCUPANCY_MULTIPLIER
LOGIT_BYTES = 4  # torch.float32
VIEW_ALIGNMENT = 256  # workspace.py _VIEW_ALIGNMENT: each view is rounded up to it

# Streaming multiprocessors of the GPUs that run TRITON_MLA, by a part of the name nvidia-smi prints (first match
# wins, so a longer name goes first). Each is NVIDIA's CUDA-core count divided by the 128 FP32 cores an SM has on
# Ampere GA10x, Ada and Blackwell GB20x; the A100's 108 is what deviceQuery prints ("(108) Multiprocessors").
# Hopper and B200/GB200 do not run TRITON_MLA (vLLM picks FLASH_ATTN_MLA and FLASHINFER_MLA there); the H100 80GB
# HBM3 is here for the Triton top-k/top-p's buffer (_reserve.sampler_run_bytes), from torch's multi_processor_count
# on the device (tests/fixtures/gpu_run/device.txt).
SM_COUNTS = (
    ('H100 80GB HBM3', 132),
    ('RTX PRO 6000 Blackwell', 188),  # Server, Workstation and Max-Q Workstation Editions: 24,064 CUDA cores
    ('RTX 5090', 170),  # 21,760
    ('RTX 6000 Ada', 142),  # 18,176
    ('L40S', 142),  # 18,176
    ('L40', 142),  # 18,176
    ('RTX 4090', 128),  # 16,384
    ('A100', 108),  # 6,912 CUDA cores at 64 an SM (GA100)
)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for n >= 1: the smallest power of two not below n."""
    return 1 << (n - 1).bit_length()


def runs_triton_mla(compute_capability: str) -> bool:
    """Whether vLLM 0.33/0.34 picks TRITON_MLA for dense MLA on a GPU of this compute capability ('12.0')."""
    try:
        major = int(str(compute_capability).split('.', 1)[0])
    except ValueError:
        return False
    return major == 12 or major < 9


def sm_count_of(gpu_name: str) -> Optional[int]:
    """The GPU's streaming multiprocessors from SM_COUNTS, None for a model the table does not know."""
    for name, count in SM_COUNTS:
        if name in gpu_name:
            return count
    return None


def num_kv_splits(max_model_len: int, sm_count: Optional[int]) -> int:
    """triton_mla.py _compute_num_kv_splits; without an SM count, the uncapped count (never fewer than vLLM's)."""
    ideal = next_power_of_2(max(1, max_model_len // MIN_WORK_PER_SPLIT))
    return ideal if sm_count is None else min(ideal, sm_count * SPLIT_OCCUPANCY_MULTIPLIER)


def workspace_bytes(max_num_seqs: int, heads_per_rank: int, splits: int, kv_lora_rank: int) -> int:
    """The float32 (max_num_seqs, heads_per_rank, splits, kv_lora_rank + 1) tensor, as the workspace aligns it."""
    size = max_num_seqs * heads_per_rank * splits * (kv_lora_rank + 1) * LOGIT_BYTES
    return ceil_div(size, VIEW_ALIGNMENT) * VIEW_ALIGNMENT


def applies(config: Config, compute_capability: str, version: Optional[tuple[int, int]]) -> bool:
    """Whether the profile run of this vLLM (None: a current one) reserves the workspace for this model and GPU."""
    in_profile = version is None or version >= WORKSPACE_IN_PROFILE_SINCE
    dense = 'index_topk' not in text_config(config)
    return in_profile and is_mla(config) and dense and runs_triton_mla(compute_capability)


def decode_workspace(
    config: Config,
    tp: int,
    max_num_seqs: int,
    max_model_len: int,
    gpu_name: str,
    sm_count: Optional[int] = None,
    dcp: int = 1,
) -> dict[str, Any]:
    """The workspace on one GPU and its factors: bytes, splits, heads_per_rank, sm_count and where that came from.

    sm_count as given, else SM_COUNTS by gpu_name; where neither knows it, the splits are not capped (the larger
    workspace) and sm_count_source is 'unknown'. Heads per rank are num_attention_heads / TP (vLLM splits the query
    heads evenly) times dcp: under decode context parallelism the ranks all-gather the query heads before the decode
    kernel (triton_mla.py, reserve_workspace: self.num_heads * self.dcp_world_size). The split count follows the
    whole max_model_len, not a rank's share of it (_reserve_attn_logits_workspace).
    """
    known = sm_count if sm_count is not None else sm_count_of(gpu_name)
    source = 'given' if sm_count is not None else 'table' if known is not None else 'unknown'
    heads = ceil_div(config_int(config, 'num_attention_heads', missing=0), tp) * dcp
    rank = config_int(config, 'kv_lora_rank', missing=0)
    splits = num_kv_splits(max_model_len, known)
    return {
        'bytes': workspace_bytes(max_num_seqs, heads, splits, rank),
        'splits': splits,
        'heads_per_rank': heads,
        'sm_count': known,
        'sm_count_source': source,
    }
