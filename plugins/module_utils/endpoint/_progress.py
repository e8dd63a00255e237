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
import math
import re
from typing import Any, Optional, Union

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import quote
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._journal import strip_log_prefix

# What a start shows before vLLM logs any progress line: the unit's last line, cut to this many characters.
MAX_LAST_LINE_CHARS = 100
# vLLM's progress lines are a few hundred characters; only this many of each journal line are read for the phase,
# and the line the report quotes is cut to as many, so a line of any length costs no more than this.
MAX_LINE_CHARS = 1024
# Ansible's async wrapper writes a running job's record ({"started": ..., "finished": ..., "ansible_job_id": ...})
# in a few dozen bytes; the job's result, which replaces it, can be far larger (a command's whole output). The
# module reads at most one byte more than this of the results file.
MAX_RESULTS_BYTES = 1024 * 1024

# What systemd allows in a unit's name (systemd.unit(5)): ASCII letters, digits and ":-_.\\", "@" before a
# template's instance, at most 255 characters.
_UNIT_NAME = re.compile(r'[A-Za-z0-9:_.@\\-]{1,255}')
# How much of a refused unit name its error quotes.
MAX_QUOTED_UNIT_CHARS = 100

# The figures after a progress bar's words: its first "done/total". A run of digits is tried from its first digit
# only, so the match takes time in proportion to the line, however many digits it holds.
_FRACTION = re.compile(r'.*?(?<!\d)(\d+)/(\d+)')
_KV_TOKENS = re.compile(r'([\d,]+) tokens')
# vLLM's progress lines, the latest of which names the phase: (the words that mark the line, the pattern of the
# figures right after the words' first occurrence or None, the phase). The words are found with str.find and each
# pattern is matched at that one place, never searched for: a line is read in time linear in its length.
_START_PHASES = [
    ('Starting to load model', None, 'loading the model'),
    ('Loading safetensors checkpoint shards:', _FRACTION, 'loading weights: shard {0} of {1}'),
    ('Loading weights took ', re.compile(r'([\d.]+) seconds'), 'weights read in {0} s'),
    ('Model loading took ', re.compile(r'([\d.]+) GiB'), 'weights loaded ({0} GiB); profiling the memory'),
    ('GPU KV cache size: ', _KV_TOKENS, 'KV cache of {0} tokens allocated'),
    ('CPU KV cache size: ', _KV_TOKENS, 'KV cache of {0} tokens allocated'),
    ('Maximum concurrency for ', re.compile(r'[\d,]+ tokens per request'), 'KV cache allocated'),
    ('Capturing CUDA graphs', _FRACTION, 'capturing CUDA graphs: {0} of {1}'),
    ('Graph capturing finished in ', re.compile(r'(\d+) secs'), 'CUDA graphs captured in {0} s'),
    ('init engine (profile, create kv cache, warmup model) took ', re.compile(r'[\d.]+ seconds'), 'engine ready'),
    ('Starting vLLM API server', None, 'API server starting'),
    ('Starting vLLM server', None, 'API server starting'),
    ('Application startup complete', None, 'serving: the gate asks its questions'),
]


def job_finished(head: Union[str, bytes]) -> bool:
    """Whether an async job's results file says it ended, from its first MAX_RESULTS_BYTES + 1 bytes at most.

    Ansible's async wrapper writes {"started": 1, "finished": 0, ...} when the job begins, and the job's own
    result (which has no "started") when it ends, or a failure of its own when it kills the job at its time
    limit. A file longer than MAX_RESULTS_BYTES is no running job's record: it has ended, whatever the cut part
    holds. A shorter file that is not JSON yet is being written: not finished.
    """
    if len(head) > MAX_RESULTS_BYTES:
        return True
    if isinstance(head, bytes):
        head = head.decode('utf-8', 'replace')  # the wrapper writes ASCII; a stray byte does not hide the rest
    try:
        data = json.loads(head)
    except ValueError:
        return False
    if not isinstance(data, dict):
        return False
    return 'started' not in data or bool(data.get('finished'))


def unit_name(value: Any) -> str:
    """An argument type: the name of one systemd unit. Anything else (a NUL, a newline, a glob, a name that is
    not ASCII) is refused with ValueError, so the option's error names it before journalctl or systemctl sees it."""
    name = str(value)
    if not _UNIT_NAME.fullmatch(name):
        raise ValueError(
            '%s is not the name of a systemd unit: at most 255 of the characters A-Z a-z 0-9 : _ . @ \\ -'
            % quote(ascii(name), MAX_QUOTED_UNIT_CHARS)
        )
    return name


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


def finite_number(value: Any) -> Optional[float]:
    """value as a float where it is a finite JSON number; None for anything else (a boolean, 1e400, NaN, text).

    The samples come back from the play as `previous`, where anything may have been put.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        return None
    return number if math.isfinite(number) else None


def _sample(previous: Optional[dict[str, Any]], key: str) -> Optional[float]:
    return finite_number((previous or {}).get(key))


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
        if not math.isfinite(remaining):  # a rate too small for a float's range: no estimate
            remaining = None
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
        elif total_bytes and not rate:
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


def _line_phase(line: str) -> Optional[str]:
    """The phase that a journal line tells, or None; reads its first MAX_LINE_CHARS characters."""
    line = line[:MAX_LINE_CHARS]
    for words, figures, phase in _START_PHASES:
        at = line.find(words)
        if at < 0:
            continue
        if figures is None:
            return phase
        found = figures.match(line, at + len(words))
        if found:
            return phase.format(*found.groups())
    return None


def start_phase(lines: list[str]) -> tuple[str, Optional[str]]:
    """(the phase of a vLLM start, the line that tells it, cut) from the journal of its current run."""
    for line in reversed(lines):
        phase = _line_phase(line)
        if phase is not None:
            return phase, quote(strip_log_prefix(line), MAX_LINE_CHARS)
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
        # A time after now is none that this loop's reports took: the phase is timed from now, then.
        since = min(_sample(previous, 'phase_since') or now, now)
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
