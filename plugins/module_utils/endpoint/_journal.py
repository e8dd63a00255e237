# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""vLLM's lines in a unit's journal: split into lines, stripped of vLLM's log prefix, and picked: those that
explain why a start failed, those that tell how far it has come (chat_check, progress).

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.

Pure: the journal's text comes in, lines come out; _systemd reads the journal. A line picked to be quoted is cut
to MAX_QUOTED_LINE_CHARS, marked with how many characters it had beyond them.
"""

import re
from typing import Any

from ansible.module_utils.common.text.converters import to_text

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import quote
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._startup_log import (
    LINE_PATTERNS as FIGURE_PATTERNS,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._vllm_log import quotable_lines

# How many explaining lines a failure quotes (chat_check's journal_lines).
DEFAULT_JOURNAL_LINES = 20
# How far back the journal is read to explain a failure.
JOURNAL_SCAN_LINES = 2000
# Progress lists are capped so a long load cannot flood the result.
MAX_PROGRESS_LINES = 50
# vLLM's lines are a few hundred characters, a journal line can be 40,000 or more: each line quoted is cut to this
# many, as the progress module cuts the line it quotes.
MAX_QUOTED_LINE_CHARS = 1024

# Lines of a unit's journal that explain why vLLM did not come up.
_EXPLAIN_PATTERNS = [
    re.compile(p)
    for p in (
        r'estimated maximum model length',
        r'(?i)out of memory',
        r'(?i)\boom[- ]kill',
        # The last line of a Python traceback: "ValueError: ...", "torch.OutOfMemoryError: ...".
        r'(?:^|[\s\]:)])(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?::|$)',
        # argparse refusing the command line: "api_server.py: error: unrecognized arguments: --x".
        r'^[\w.\- ]+: error: ',
        # systemd's own account of the unit.
        r'Main process exited',
        r'Failed with result',
        r'Start request repeated too quickly',
        r'restart counter is at',
    )
]

# Lines that tell how far loading has come.
_PROGRESS_PATTERNS = [
    re.compile(p)
    for p in (
        r'Starting to load model',
        r'Loading safetensors checkpoint shards',
        r'Loading weights took',
        r'Model loading took',
        r'KV cache size:',
        r'Maximum concurrency for',
        r'Capturing CUDA graphs',
        r'Graph capturing finished',
        r'init engine \(profile, create kv cache, warmup model\) took',
        r'Starting vLLM (?:API )?server',
        r'Application startup complete',
    )
] + FIGURE_PATTERNS
# Progress bars: each update is a line of its own; consecutive updates of one bar keep only the latest.
_PROGRESS_BARS = [re.compile(r'Loading safetensors checkpoint shards'), re.compile(r'Capturing CUDA graphs')]
_LOG_PREFIX = re.compile(
    r'^\s*(?:\([^)]*\)\s+)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+'
    r'\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?)?'
)


def journal_lines(text: Any) -> list[str]:
    """Split journal text into lines; a carriage return (progress bars) also ends a line."""
    lines = []
    for line in to_text(text).splitlines():
        for part in line.split('\r'):
            part = part.rstrip()
            if part.strip():
                lines.append(part)
    return lines


# journalctl --output short-monotonic: "[ 1234.567890] host ident[pid]: message", the time on CLOCK_MONOTONIC.
_MONOTONIC_PREFIX = re.compile(r'^\[\s*(\d+\.\d+)\] ')


def timed_lines(text: Any) -> list[tuple[float, str]]:
    """Split journalctl's short-monotonic text into (seconds on CLOCK_MONOTONIC, the rest of the line); a line without
    the time (a message's own line break, or journalctl's notes) is left out."""
    timed = []
    for line in to_text(text).splitlines():
        found = _MONOTONIC_PREFIX.match(line)
        if found:
            timed.append((float(found.group(1)), line[found.end() :]))
    return timed


def strip_log_prefix(line: str) -> str:
    """Drop vLLM's log prefix: '(EngineCore pid=7) ERROR 11-30 03:50:07 [core.py:1510] '."""
    return _LOG_PREFIX.sub('', line, count=1).strip()


def explaining_lines(lines: list[str], limit: int = DEFAULT_JOURNAL_LINES) -> list[str]:
    """Pick the journal lines that explain a failure: the last `limit`, each once, each cut to MAX_QUOTED_LINE_CHARS.

    Only lines a result may quote are picked (_vllm_log.quotable_lines: vLLM's own, systemd's, and others before the
    API was up), never a client's words that look like an error (a forged query in uvicorn's access line).
    vLLM logs a failure twice (the engine process, then the API server), with
    and without its log prefix; lines are compared and quoted without it.
    """
    picked: list[str] = []
    for line in quotable_lines(lines):
        if any(p.search(line) for p in _EXPLAIN_PATTERNS):
            line = strip_log_prefix(line)
            if line in picked:
                picked.remove(line)
            picked.append(line)
    if limit <= 0:
        return []
    return [quote(line, MAX_QUOTED_LINE_CHARS) for line in picked[-limit:]]


def progress_lines(lines: list[str], limit: int = MAX_PROGRESS_LINES) -> list[str]:
    """Pick the loading-progress lines among those a result may quote (_vllm_log.quotable_lines, uvicorn's line that
    the API is up included), each cut to MAX_QUOTED_LINE_CHARS; consecutive updates of one progress bar keep only the
    latest."""
    picked: list[str] = []
    for line in quotable_lines(lines, api_ready=True):
        if not any(p.search(line) for p in _PROGRESS_PATTERNS):
            continue
        line = strip_log_prefix(line)
        if picked and any(shown.search(line) and shown.search(picked[-1]) for shown in _PROGRESS_BARS):
            picked[-1] = line
        else:
            picked.append(line)
    return [quote(line, MAX_QUOTED_LINE_CHARS) for line in picked[-limit:]]
