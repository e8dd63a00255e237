# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""vLLM's own figures of its memory, read from the log of one start (chat_check returns them; the role records them
beside the preflight's prediction, and the next preflight of the same memory key plans from them).

PRIVATE to the collection: this is not a public API; it may change without notice.

Each tensor-parallel rank logs its own weights and KV memory; the figure that bounds the plan is the largest
weights and the smallest KV memory. The lines, as vLLM 0.6 to 0.33 print them:

- "Model loading took 27.7183 GiB and 287.25 seconds" (V1; V0: "Loading model weights took 14.99 GB")
- "Available KV cache memory: 10.64 GiB" (V1); "the rest of the memory reserved for KV Cache is 21.43GiB" (V0)
- "GPU KV cache size: 237,344 tokens" (V1; the CPU build: "CPU KV cache size: 4,096 tokens, ...")
- "Maximum concurrency for 32,768 tokens per request: 7.24x"
- "Graph capturing finished in 39 secs, took 3.45 GiB"
- "# GPU blocks: 18418, # CPU blocks: 4681" (V0; "# cuda blocks" in 0.7), "num_gpu_blocks is: 14834" (V1)
- V0's profiling table ("model weights take 14.96GiB", "available_kv_cache_memory 53.29GiB") and summary
  ("kv_cache_size=3.81GiB"), V1's summary ("3.45 GiB for CUDAGraph memory", "Current kv cache memory in use is
  27.85 GiB")
"""

import re
from typing import Any, Callable, Optional

_NUMBER = r'([\d,]+(?:\.\d+)?)'


def _value(text: str) -> float:
    return float(text.replace(',', ''))


# (figure, pattern, how the figures of several ranks combine), each figure's patterns from its most precise line.
_FIGURES: list[tuple[str, Any, Callable[[list[float]], float]]] = [
    ('weights_gib', re.compile(r'Model loading took %s GiB' % _NUMBER), max),
    ('weights_gib', re.compile(r'Loading model weights took %s GB' % _NUMBER), max),
    ('weights_gib', re.compile(r'model weights take\s+%s ?GiB' % _NUMBER), max),
    ('available_kv_gib', re.compile(r'Available KV cache memory: %s GiB' % _NUMBER), min),
    ('available_kv_gib', re.compile(r'the rest of the memory reserved for KV Cache is %s ?GiB' % _NUMBER), min),
    ('available_kv_gib', re.compile(r'available_kv_cache_memory\s+%s ?GiB' % _NUMBER), min),
    ('available_kv_gib', re.compile(r'\bkv_cache_size=%s ?GiB' % _NUMBER), min),
    ('available_kv_gib', re.compile(r'Current kv cache memory in use is %s GiB' % _NUMBER), min),
    ('kv_tokens', re.compile(r'\b(?:GPU|CPU) KV cache size: %s tokens' % _NUMBER), min),
    ('max_concurrency', re.compile(r'Maximum concurrency for [\d,]+ tokens per request: %sx' % _NUMBER), min),
    ('cudagraph_gib', re.compile(r'Graph capturing finished in \d+ secs?, took %s GiB' % _NUMBER), max),
    ('cudagraph_gib', re.compile(r'\b%s GiB for CUDAGraph memory' % _NUMBER), max),
    ('gpu_blocks', re.compile(r'# (?:GPU|cuda) blocks: (\d+)'), min),
    ('gpu_blocks', re.compile(r'\bnum_gpu_blocks is: (\d+)'), min),
]
_DEVICE = re.compile(r'\b(GPU|CPU) KV cache size:')
_INTEGERS = ('kv_tokens', 'gpu_blocks')
# Lines that carry a figure, for a reader that keeps only some lines (_journal's progress_lines).
LINE_PATTERNS = [pattern for _figure, pattern, _combine in _FIGURES]


def startup_figures(lines: list[str]) -> dict[str, Any]:
    """The figures found in the lines of one start, each only where a line gives it; {} for none.

    A start that logs the same figure once per rank (tensor parallelism) or once per KV-cache group gets the
    bounding one: the largest weights and graph memory, the smallest KV memory, tokens and concurrency.
    """
    # Per figure, the values of its first pattern that matched: the patterns go from the most precise line down.
    found: dict[tuple[str, int], list[float]] = {}
    device: Optional[str] = None
    for line in lines:
        for rank, (figure, pattern, _combine) in enumerate(_FIGURES):
            match = pattern.search(line)
            if match:
                found.setdefault((figure, rank), []).append(_value(match.group(1)))
        kind = _DEVICE.search(line)
        if kind:
            device = kind.group(1)
    figures: dict[str, Any] = {}
    for (figure, rank), values in sorted(found.items(), key=lambda item: item[0][1]):
        if figure not in figures:
            value = _FIGURES[rank][2](values)
            figures[figure] = int(value) if figure in _INTEGERS else value
    if device:
        figures['kv_cache_device'] = device
    return figures
