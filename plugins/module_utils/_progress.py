# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""How far a long job has come: a checkpoint's download, or a vLLM start (llmserve.vllm.progress).

PRIVATE to the collection: this is not a public API; it may change without notice.

Pure: the module passes in what it read (the async job's results file, the sizes on disk, the unit's journal)
and the time; these functions turn it into figures and the one line a play shows. Each report carries a sample
(time, bytes, phase and since when) that the next report of the same loop gets back as `previous`, so that the
rate is the one over the last interval and a phase's duration is counted from when it was first seen.
"""

import json
import re
from typing import Any, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils._http import quote
from ansible_collections.llmserve.vllm.plugins.module_utils._journal import progress_lines, strip_log_prefix

# What a start shows before vLLM logs any progress line: the unit's last line, cut to this many characters.
MAX_LAST_LINE_CHARS = 100

# vLLM's progress lines, the latest of which names the phase (_journal's progress_lines picks them).
_START_PHASES = [
    (re.compile(r'Starting to load model'), 'loading the model'),
    (re.compile(r'Loading safetensors checkpoint shards:.*?(\d+)/(\d+)'), 'loading weights: shard {0} of {1}'),
    (re.compile(r'Loading weights took ([\d.]+) seconds'), 'weights read in {0} s'),
    (re.compile(r'Model loading took ([\d.]+) GiB'), 'weights loaded ({0} GiB); profiling the memory'),
    (re.compile(r'(?:GPU|CPU) KV cache size: ([\d,]+) tokens'), 'KV cache of {0} tokens allocated'),
    (re.compile(r'Maximum concurrency for ([\d,]+) tokens per request'), 'KV cache allocated'),
    (re.compile(r'Capturing CUDA graphs.*?(\d+)/(\d+)'), 'capturing CUDA graphs: {0} of {1}'),
    (re.compile(r'Graph capturing finished in (\d+) secs'), 'CUDA graphs captured in {0} s'),
    (re.compile(r'init engine \(profile, create kv cache, warmup model\) took ([\d.]+) seconds'), 'engine ready'),
    (re.compile(r'Starting vLLM (?:API )?server'), 'API server starting'),
    (re.compile(r'Application startup complete'), 'serving: the gate asks its questions'),
]


def job_finished(text: str) -> bool:
    """Whether an async job's results file says it ended.

    Ansible's async wrapper writes {"started": 1, "finished": 0, ...} when the job begins, and the job's own
    result (which has no "started") when it ends, or a failure of its own when it kills the job at its time
    limit. A file that is not JSON yet is being written: not finished.
    """
    try:
        data = json.loads(text)
    except ValueError:
        return False
    if not isinstance(data, dict):
        return False
    return 'started' not in data or bool(data.get('finished'))


def format_duration(seconds: float) -> str:
    """'45s', '6m05s', '2h03m'."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return '%ds' % seconds
    if seconds < 3600:
        return '%dm%02ds' % divmod(seconds, 60)
    return '%dh%02dm' % divmod(seconds // 60, 60)


def format_bytes(count: float) -> str:
    """Decimal units, as the Hub gives sizes: '812.0 kB', '3.2 GB'."""
    for unit, size in (('TB', 1e12), ('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
        if count >= size:
            return '%.1f %s' % (count / size, unit)
    return '%d B' % count


def _sample(previous: Optional[dict[str, Any]], key: str) -> Optional[float]:
    value = (previous or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def download_report(
    done_bytes: int,
    total_bytes: Optional[int],
    done_files: int,
    total_files: Optional[int],
    now: float,
    previous: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Figures and a line for a download: bytes and files on disk, the rate over the last interval, an estimate.

    The totals are the manifest's; what the disk holds is capped at them (a file fetched again is counted once
    it is in place).
    """
    if total_bytes:
        done_bytes = min(done_bytes, total_bytes)
    if total_files:
        done_files = min(done_files, total_files)
    before_bytes, before_time = _sample(previous, 'bytes'), _sample(previous, 'time')
    rate = None
    if before_bytes is not None and before_time is not None and now > before_time:
        rate = max(0.0, (done_bytes - before_bytes) / (now - before_time))
    remaining = None
    if rate and total_bytes:
        remaining = (total_bytes - done_bytes) / rate
    parts = [
        '%s of %s' % (format_bytes(done_bytes), format_bytes(total_bytes)) if total_bytes else format_bytes(done_bytes),
        '%d of %d files' % (done_files, total_files) if total_files else '%d files' % done_files,
    ]
    if rate is None:
        parts.append('the rate at the next report')
    else:
        parts.append('%s/s' % format_bytes(rate))
        if remaining is not None:
            parts.append('about %s left' % format_duration(remaining))
        elif total_bytes:
            parts.append('no bytes in the last %s' % format_duration(now - (before_time or now)))
    return {
        'msg': ', '.join(parts),
        'download': {
            'bytes': done_bytes,
            'total_bytes': total_bytes,
            'files': done_files,
            'total_files': total_files,
            'bytes_per_second': round(rate, 1) if rate is not None else None,
            'seconds_left': round(remaining, 1) if remaining is not None else None,
        },
        'sample': {'time': now, 'bytes': done_bytes},
    }


def start_phase(lines: list[str]) -> tuple[str, Optional[str]]:
    """(the phase of a vLLM start, the line that tells it) from the journal of its current run."""
    for line in reversed(progress_lines(lines)):
        for pattern, phase in _START_PHASES:
            found = pattern.search(line)
            if found:
                return phase.format(*found.groups()), line
    if lines:
        return 'starting, no progress line yet', quote(strip_log_prefix(lines[-1]), MAX_LAST_LINE_CHARS)
    return 'starting, nothing in the journal yet', None


def start_report(
    lines: list[str], waited: float, now: float, previous: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """Figures and a line for a start: its phase, for how long it has been in it, how long the wait has run."""
    phase, line = start_phase(lines)
    since = now
    if (previous or {}).get('phase') == phase:
        since = _sample(previous, 'phase_since') or now
    msg = '%s (%s in this phase, %s since the wait began)' % (
        phase,
        format_duration(now - since),
        format_duration(waited),
    )
    if line and phase.startswith('starting'):
        msg += ': %s' % line
    return {
        'msg': msg,
        'start': {'phase': phase, 'line': line, 'phase_seconds': round(now - since, 1)},
        'sample': {'time': now, 'phase': phase, 'phase_since': since},
    }
