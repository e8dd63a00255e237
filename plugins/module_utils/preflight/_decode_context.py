# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Decode context parallelism: which sizes vLLM takes, and which the preflight tries where a context needs one.

PRIVATE to the collection: this is not a public API; it may change without notice.

Read in vLLM 0.33.0's and 0.34.0's wheels:

- vllm/config/parallel.py, ParallelConfig: decode_context_parallel_size (`-dcp`), at least 1; without prefill context
  parallelism it reuses the tensor-parallel ranks and must divide tensor_parallel_size ("tp_size=... must be
  divisible by dcp_size=...").
- vllm/v1/kv_cache_interface.py, FullAttentionSpec.max_memory_usage_bytes: a request of max_model_len tokens takes
  cdiv(max_model_len, dcp) tokens' blocks on each rank of an MLA model (the latent cache is dcp_sharded); the check
  that one request of max_model_len fits (kv_cache_utils) uses that share.
- vllm/v1/core/kv_cache_utils.py, get_kv_cache_capacity: the "KV cache size: N tokens" vLLM logs is its maximum
  concurrency times max_model_len, so the tokens of all dcp ranks together.
- Every CUDA MLA backend sets supports_dcp (triton_mla.py and the others under v1/attention/backends/mla); TRITON_MLA,
  SM120's dense MLA backend, reserves its decode workspace with the query heads of dcp ranks (_mla_workspace).
- triton_mla.py: with dcp > 1 the builder does not update draft decode metadata in place
  (supports_draft_decode_metadata_update = dcp_world_size == 1): speculative decoding takes the slower path.
"""

from collections.abc import Iterator
from typing import Any, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import Config, is_mla
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError

AUTO = 'auto'
# What a planned --max-num-seqs comes down through, where the user set none: each halves TRITON_MLA's decode
# workspace, which grows with dcp (at DCP 8, 1,024 sequences take 47 GiB of an RTX PRO 6000, 64 take 2.9).
PLANNED_MAX_NUM_SEQS = (256, 128, 64, 32, 16, 8)
SPECULATIVE_FLAG = '--speculative-config'
DECODE_SPEED_NOTE = (
    'decode context parallelism trades decode speed at short contexts (about 14 % slower on 8 RTX PRO 6000s in '
    'community runs) for capacity and speed at long ones; vllm#41623 (open) reports drifting answers with Kimi at '
    'TP 8 / DCP 8'
)


def decode_context_parallel_size(params: dict[str, Any]) -> int:
    """The size a plan is sized with: the option when it is a number, 1 for auto until the search picks one."""
    value = params.get('decode_context_parallel_size', AUTO)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def parse_option(value: Any) -> Any:
    """The module option as the plan takes it: 'auto', or an int of at least 1 ('4' from a template included)."""
    if value is None or value == AUTO:
        return AUTO
    if isinstance(value, bool):
        raise PreflightError(
            'decode_context_parallel_size must be auto or a whole number of at least 1, got %r' % value
        )
    try:
        number = int(str(value).strip())
    except ValueError:
        raise PreflightError(
            'decode_context_parallel_size must be auto or a whole number of at least 1, got %r' % value
        ) from None
    if number < 1:
        raise PreflightError('decode_context_parallel_size must be at least 1, got %d' % number)
    return number


def check_size(dcp: int, tp: int, config: Config, cpu: bool) -> None:
    """Refuse a decode_context_parallel_size vLLM would refuse, or one the preflight cannot size."""
    if dcp == 1:
        return
    if cpu:
        raise PreflightError(
            'decode_context_parallel_size %d: the CPU build has no decode context parallelism (its attention '
            'backends do not support it); set it to 1 or auto' % dcp
        )
    if tp % dcp:
        raise PreflightError(
            'decode_context_parallel_size %d must divide tensor_parallel_size %d (vLLM reuses the tensor-parallel '
            'ranks for it)' % (dcp, tp)
        )
    if not is_mla(config):
        raise PreflightError(
            'decode_context_parallel_size %d: the preflight sizes decode context parallelism for MLA checkpoints '
            '(DeepSeek-V3, Kimi-K2) only; set it to 1 or auto' % dcp
        )


def candidates(tp: int, max_num_seqs: Any, default_max_num_seqs: Optional[int]) -> Iterator[tuple[int, Any]]:
    """(dcp, max_num_seqs) in the order the search tries them: the smallest dcp first, and for each the user's
    max_num_seqs, or vLLM's default and then PLANNED_MAX_NUM_SEQS below it, the largest first. Without a default
    (a reserve given, which no sequence count changes) only the user's, None included."""
    seqs = (
        [max_num_seqs]
        if max_num_seqs or not default_max_num_seqs
        else [default_max_num_seqs] + [n for n in PLANNED_MAX_NUM_SEQS if n < default_max_num_seqs]
    )
    for dcp in range(2, tp + 1):
        if tp % dcp == 0:
            for n in seqs:
                yield dcp, n


def speculative(serve_flags: list[Any]) -> bool:
    """Whether the serving flags turn speculative decoding on."""
    return any(str(flag).split('=', 1)[0] == SPECULATIVE_FLAG for flag in serve_flags or [])
