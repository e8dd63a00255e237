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
- where the start's time went (its ledger): "Model loading took 71.16 GiB memory and 48.817523 seconds", "Loading
  weights took 46.02 seconds" (the checkpoint's read alone), "init engine (profile, create kv cache, warmup model) took
  97.94 s (compilation: 43.51 s)" (V1; "... took 15.79 seconds" in V0 and without compilation), "torch.compile took
  43.51 s in total", "Graph capturing finished in 39 secs", "Memory profiling takes 7.63 seconds" (V0)
- the backends it chose: "Using FLASH_ATTN attention backend out of potential backends: [...]", "Using CPU_MLA
  backend.", "Using 'FLASHINFER_CUTLASS' NvFp4 MoE backend out of potential backends: [...]"
- V0's profiling table ("model weights take 14.96GiB", "available_kv_cache_memory 53.29GiB") and summary
  ("kv_cache_size=3.81GiB"), V1's summary ("3.45 GiB for CUDAGraph memory", "Current kv cache memory in use is
  27.85 GiB")
"""

import math
import re
from typing import Any, Callable, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._vllm_log import is_api_ready, start_messages

# A figure as vLLM prints it: "27.7183", "237,344".
_NUMBER = r'([\d,]+(?:\.\d+)?)'
# _NUMBER spelled backwards, for the figure that comes before its words: matched on the reversed line from where the
# words start, its first match (the longest, as the pattern is greedy) is the figure that a search for a word
# boundary, _NUMBER and the words finds, and the run of digits and commas before the words is read once.
_NUMBER_BACKWARDS = re.compile(r'((?:\d+\.)?[\d,]+)\b')


class _Figure:
    """A line of vLLM's that gives a figure: the words the line holds, found with str.find, and its pattern, matched
    only where the words are, never searched for through the line. A line is so read in time linear in its length,
    where a search for a pattern that opens with a run of digits and commas (the CUDAGraph line's) starts again at
    each digit of such a run: minutes for one journal line of 40,000 characters "1,1,1,...".

    pattern: compiled, it opens with the words (it may look behind them); None for the figure right before them.
    lead: how vLLM's message that gives the figure begins (the line's shape): a figure is read from a message only
    where it begins so, never from words that stand anywhere in it (a prompt, a path, another figure's line).
    """

    def __init__(
        self,
        name: str,
        words: str,
        pattern: Optional[re.Pattern[str]],
        combine: Callable[[list[float]], float],
        lead: Optional[str] = None,
    ):
        self.name = name
        self.words = words
        self.pattern = pattern
        self.combine = combine
        self.lead = re.compile(re.escape(words) if lead is None else lead)

    def read(self, message: str) -> Optional[str]:
        """The figure's text in a message of vLLM's own (_vllm_log.vllm_message) that begins as its line does."""
        return self.search(message) if self.lead.match(message) else None

    def search(self, line: str) -> Optional[str]:
        """The figure's text where the line first gives it, else None: named, and true or not, as a compiled
        pattern's search is, for the readers of LINE_PATTERNS."""
        at = line.find(self.words)
        backwards = line[::-1] if self.pattern is None and at >= 0 else ''
        while at >= 0:
            if self.pattern is None:
                found = _NUMBER_BACKWARDS.match(backwards, len(line) - at)
                if found:
                    return found.group(1)[::-1]
            else:
                found = self.pattern.match(line, at)
                if found:
                    return found.group(1)
            at = line.find(self.words, at + 1)
        return None


# The largest figure of each kind a start can log (above it, the line is no measurement): memory of a GPU or a host
# in GiB, a count of tokens or blocks, a concurrency, the seconds of a phase, a load's rate in GiB a second.
MAX_GIB = 1024.0**2
MAX_COUNT = 10.0**15
MAX_SECONDS = 10.0**7
MAX_GIB_PER_SECOND = 10.0**4
_LIMITS = {'_gib': MAX_GIB, '_seconds': MAX_SECONDS}


def _limit(name: str) -> float:
    """The largest value the figure called name may have."""
    for suffix, limit in _LIMITS.items():
        if name.endswith(suffix):
            return limit
    return MAX_COUNT


def _value(text: str, name: str) -> Optional[float]:
    """The figure's value; None where the text is no figure (commas alone, more digits than a float holds) or the
    value is beyond what a start logs."""
    digits = text.replace(',', '')
    if not digits:
        return None
    value = float(digits)
    return value if math.isfinite(value) and 0 <= value <= _limit(name) else None


# How vLLM's messages begin that give several figures: V1's account of its memory after start-up, the KV cache's size.
_FREE_MEMORY_LINE = r'Free memory on device '
_KV_CACHE_SIZE_LINE = r'(?:GPU|CPU) KV cache size: '

# Each figure's lines, from its most precise line down, and how the figures of several ranks combine.
_FIGURES = [
    _Figure('weights_gib', 'Model loading took ', re.compile(r'Model loading took %s GiB' % _NUMBER), max),
    _Figure(
        'weights_gib', 'Loading model weights took ', re.compile(r'Loading model weights took %s GB' % _NUMBER), max
    ),
    _Figure('weights_gib', 'model weights take', re.compile(r'model weights take\s+%s ?GiB' % _NUMBER), max),
    _Figure(
        'available_kv_gib',
        'Available KV cache memory: ',
        re.compile(r'Available KV cache memory: %s GiB' % _NUMBER),
        min,
    ),
    _Figure(
        'available_kv_gib',
        'the rest of the memory reserved for KV Cache is ',
        re.compile(r'the rest of the memory reserved for KV Cache is %s ?GiB' % _NUMBER),
        min,
        lead=r'model weights take|the rest of the memory reserved',
    ),
    _Figure(
        'available_kv_gib',
        'available_kv_cache_memory',
        re.compile(r'available_kv_cache_memory\s+%s ?GiB' % _NUMBER),
        min,
    ),
    _Figure(
        'available_kv_gib',
        'kv_cache_size=',
        re.compile(r'\bkv_cache_size=%s ?GiB' % _NUMBER),
        min,
        lead=r'Memory profiling results:',
    ),
    _Figure(
        'available_kv_gib',
        'Current kv cache memory in use is ',
        re.compile(r'Current kv cache memory in use is %s GiB' % _NUMBER),
        min,
        lead=_FREE_MEMORY_LINE,
    ),
    _Figure(
        'kv_tokens',
        ' KV cache size: ',
        re.compile(r'(?<=\bGPU|\bCPU) KV cache size: %s tokens' % _NUMBER),
        min,
        lead=_KV_CACHE_SIZE_LINE,
    ),
    _Figure(
        'max_concurrency',
        'Maximum concurrency for ',
        re.compile(r'Maximum concurrency for [\d,]+ tokens per request: %sx' % _NUMBER),
        min,
        # The CPU build gives it on the KV cache's line.
        lead=r'Maximum concurrency for |' + _KV_CACHE_SIZE_LINE,
    ),
    _Figure(
        'cudagraph_gib',
        'Graph capturing finished in ',
        re.compile(r'Graph capturing finished in \d+ secs?, took %s GiB' % _NUMBER),
        max,
    ),
    _Figure('cudagraph_gib', ' GiB for CUDAGraph memory', None, max, lead=_FREE_MEMORY_LINE),
    _Figure(
        'gpu_blocks',
        ' blocks: ',
        re.compile(r'(?:(?<=# GPU)|(?<=# cuda)) blocks: (\d+)'),
        min,
        lead=r'# (?:GPU|cuda) blocks: ',
    ),
    _Figure(
        'gpu_blocks',
        'num_gpu_blocks is: ',
        re.compile(r'\bnum_gpu_blocks is: (\d+)'),
        min,
        lead=r'(?:Engine \d+: )?vllm cache_config_info ',
    ),
    # The ledger's phases, each the slowest rank's: the start waits for it.
    _Figure(
        'weights_seconds',
        'Model loading took ',
        re.compile(r'Model loading took [\d,.]+ GiB (?:memory )?and %s seconds' % _NUMBER),
        max,
        lead=r'Model loading took ',
    ),
    _Figure(
        'weights_read_seconds', 'Loading weights took ', re.compile(r'Loading weights took %s seconds' % _NUMBER), max
    ),
    _Figure(
        'compile_seconds',
        ' (compilation: ',
        re.compile(r' \(compilation: %s s' % _NUMBER),
        max,
        lead=r'init engine \(profile, create kv cache, warmup model\) took ',
    ),
    _Figure('compile_seconds', 'torch.compile took ', re.compile(r'torch\.compile took %s s in total' % _NUMBER), max),
    _Figure(
        'graph_capture_seconds',
        'Graph capturing finished in ',
        re.compile(r'Graph capturing finished in %s secs?' % _NUMBER),
        max,
        lead=r'Graph capturing finished in ',
    ),
    _Figure(
        'engine_init_seconds',
        'init engine (profile, create kv cache, warmup model) took ',
        re.compile(r'init engine \(profile, create kv cache, warmup model\) took %s s' % _NUMBER),
        max,
    ),
    _Figure(
        'memory_profiling_seconds',
        'Memory profiling takes ',
        re.compile(r'Memory profiling takes %s seconds' % _NUMBER),
        max,
    ),
]
_DEVICE = re.compile(r'(GPU|CPU) KV cache size: ')
_INTEGERS = ('kv_tokens', 'gpu_blocks')
# Lines that carry a figure, for a reader that keeps only some lines (_journal's progress_lines): each has the
# search(line) of a compiled pattern, true where the line gives its figure, and reads a line in linear time.
LINE_PATTERNS = _FIGURES


# The backends a start chose, as vLLM names them: "Using CPU_MLA backend.", "Using FLASH_ATTN attention backend out of
# potential backends: [...]", "Using 'FLASHINFER_CUTLASS' NvFp4 MoE backend out of ...", "Using TRITON_MLA MLA prefill
# backend." The name is what lies between the words, at most MAX_BACKEND_CHARS; a start names a handful.
_BACKEND_START = 'Using '
_BACKEND_END = ' backend'
MAX_BACKEND_CHARS = 80
MAX_BACKENDS = 16


def _backend_named(line: str) -> Optional[str]:
    """The backend the line says vLLM uses, else None; found with str.find, in time linear in the line."""
    at = line.find(_BACKEND_START)
    while at >= 0:
        begin = at + len(_BACKEND_START)
        end = line.find(_BACKEND_END, begin, begin + MAX_BACKEND_CHARS + len(_BACKEND_END))
        name = line[begin:end].replace("'", '').strip() if end > begin else ''
        # vLLM names a backend by its enum or class (CPU_MLA, FlashInfer): "Using default backend X for vit attention"
        # names none.
        if name.isprintable() and any(char.isupper() for char in name):
            return name
        at = line.find(_BACKEND_START, begin)
    return None


def startup_backends(lines: list[str]) -> list[str]:
    """The backends the lines (vLLM's messages of one start) name, in the order they first do, each once (every rank
    names its own)."""
    named: list[str] = []
    for line in lines:
        name = _backend_named(line)
        if name and name not in named and len(named) < MAX_BACKENDS:
            named.append(name)
    return named


# What journalctl's short-monotonic output puts before a line after its time: "host ident[pid]: ".
_JOURNAL_SOURCE = re.compile(r'\S+ [^\s\[:]+(?:\[\d+\])?: ')


def api_ready_seconds(timed: list[tuple[float, str]], started_at: Optional[float]) -> Optional[float]:
    """Seconds from the run's start to uvicorn's first line that says its API is up (_vllm_log.is_api_ready: its
    lifespan started, the socket is bound right after), from the journal of one run
    (_journal.timed_lines); the run starts at started_at (systemd's ExecMainStartTimestampMonotonic, in seconds),
    else at the run's first line. None where no line says it."""
    if not timed:
        return None
    start = timed[0][0] if started_at is None else started_at
    for at, line in timed:
        source = _JOURNAL_SOURCE.match(line)
        if is_api_ready(line[source.end() :] if source else line):
            return round(max(0.0, at - start), 3)
    return None


def _figures_read(messages: list[str]) -> dict[str, Any]:
    """The figures the messages give, each of its most precise line that gave one, its values combined."""
    # Per figure, the values of its first pattern that matched: the patterns go from the most precise line down.
    found: dict[tuple[str, int], list[float]] = {}
    for message in messages:
        for rank, figure in enumerate(_FIGURES):
            text = figure.read(message)
            value = _value(text, figure.name) if text else None
            if value is not None:
                found.setdefault((figure.name, rank), []).append(value)
    figures: dict[str, Any] = {}
    for (name, rank), values in sorted(found.items(), key=lambda item: item[0][1]):
        if name not in figures:
            value = _FIGURES[rank].combine(values)
            figures[name] = int(value) if name in _INTEGERS else value
    return figures


def startup_figures(lines: list[str]) -> dict[str, Any]:
    """The figures found in the lines of one start, each only where a line gives it; {} for none.

    Only vLLM's own lines of its last run's start count (_vllm_log.start_messages): not a client's words in the
    lines after its API came up, which could lower a figure the next preflight plans from, nor an earlier run's.
    A figure is read where vLLM's message of it begins as vLLM writes it, and only within what a start can log.
    A start that logs the same figure once per rank (tensor parallelism) or once per KV-cache group gets the
    bounding one: the largest weights and graph memory, the smallest KV memory, tokens and concurrency, the slowest
    rank's seconds of each phase.
    """
    messages = start_messages(lines)
    figures = _figures_read(messages)
    # The weights' rate: their memory over the checkpoint's read where vLLM timed it apart, else over the whole load;
    # none where the seconds are too few for a rate a disk gives (0.00 s, as the CPU build logs a tiny model's).
    weights_seconds = figures.get('weights_read_seconds') or figures.get('weights_seconds')
    if figures.get('weights_gib') and weights_seconds:
        rate = figures['weights_gib'] / weights_seconds
        if rate <= MAX_GIB_PER_SECOND:
            figures['weights_gib_per_second'] = round(rate, 3)
    device = None
    for message in messages:
        kind = _DEVICE.match(message)
        if kind:
            device = kind.group(1)
    if device:
        figures['kv_cache_device'] = device
    backends = startup_backends(messages)
    if backends:
        figures['backends'] = backends
    return figures
