# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Properties of progress's pure functions over any input Hypothesis makes up.

Whatever a results file, a journal or a loop's `previous` holds, the functions raise nothing, read a line of any
length in linear time, and return a report that goes back to the controller as strict JSON (no NaN, no infinity):
a file longer than any running job's record has ended, the latest progress line names the phase whatever junk
surrounds it, a rate and an estimate are finite or absent, and a unit name is one that systemd allows or refused.
"""

import json
import math
import re
from datetime import timedelta

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._progress import (
    MAX_LINE_CHARS,
    MAX_RESULTS_BYTES,
    download_report,
    finite_number,
    job_finished,
    start_phase,
    start_report,
    unit_name,
)

# Each example must end within this: a report reads up to 2,000 lines of 1024 characters, in milliseconds when
# linear; a backtracking pattern spends minutes on lines like these.
QUICK = settings(max_examples=60, deadline=timedelta(seconds=2), derandomize=True, database=None)
RUNNING = b'{"started": true, "finished": false, "ansible_job_id": "j7.1"}'
# vLLM's progress lines (tests/fixtures/startup_logs) and the phase each names.
PROGRESS_LINES = [
    (
        '(Worker_TP2 pid=2080) INFO 09-24 20:46:12 [gpu_model_runner.py:2338] Starting to load model Qwen/Q3',
        'loading the model',
    ),
    (
        'Loading safetensors checkpoint shards:  42% Completed | 10/24 [02:10<03:02, 13.0s/it]',
        'loading weights: shard 10 of 24',
    ),
    (
        '(Worker pid=7) INFO 09-24 20:50:59 [gpu_model_runner.py:2392] Model loading took 27.7183 GiB and 287.2 seconds',
        'weights loaded (27.7183 GiB); profiling the memory',
    ),
    (
        '(EngineCore_DP0 pid=1944) INFO 09-24 20:53:41 [kv_cache_utils.py:864] GPU KV cache size: 237,344 tokens',
        'KV cache of 237,344 tokens allocated',
    ),
    (
        'Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  45%|####5     | 30/67 [00:05<00:06,  5.89it/s]',
        'capturing CUDA graphs: 30 of 67',
    ),
    (
        '(APIServer pid=1624) INFO 09-24 20:54:38 [api_server.py:1692] Starting vLLM API server 0 on http://127.0.0.1:8000',
        'API server starting',
    ),
    ('(APIServer pid=1624) INFO:     Application startup complete.', 'serving: the gate asks its questions'),
]
PROGRESS_WORDS = [
    'Starting to load model',
    'Loading safetensors checkpoint shards:',
    'Loading weights took ',
    'Model loading took ',
    'GPU KV cache size: ',
    'Maximum concurrency for ',
    'Capturing CUDA graphs',
    'Graph capturing finished in ',
    ' GiB for CUDAGraph memory',
    'Starting vLLM server',
    'Application startup complete',
]
# Pieces of hostile lines: what backtracking patterns choke on, bytes decoded with replacement, a NUL, a surrogate.
JUNK = ['1', '7', ',', '.', '/', ' ', '%', '|', 'x', ' seconds', ' GiB', ' tokens', '\0', '\ufffd', '\udcff', '\t']


def repeated(pieces):
    """A line of a few to some 100,000 characters: a few pieces, each repeated up to 4,000 times."""
    return st.lists(st.tuples(st.sampled_from(pieces), st.integers(1, 4000)), min_size=1, max_size=3).map(
        lambda runs: ''.join(piece * times for piece, times in runs)
    )


# A line that may begin with progress words, as vLLM's lines do, and goes on with anything.
HOSTILE_LINES = st.builds(str.__add__, st.sampled_from(PROGRESS_WORDS + ['']), repeated(PROGRESS_WORDS + JUNK))
QUIET_LINES = repeated(JUNK)
JSON_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 10**400),
    st.floats(),
    st.sampled_from([float('inf'), -float('inf'), float('nan'), 1e308, -1.7e308, 5e-324]),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)


def strict_json(report):
    return json.loads(json.dumps(report, allow_nan=False))


@QUICK
@given(st.one_of(st.binary(max_size=256), st.text(max_size=256)))
def test_any_results_file_is_finished_or_not(head):
    assert job_finished(head) in (True, False)


@QUICK
@given(st.integers(-64, 64))
def test_a_file_longer_than_any_running_record_has_ended(beyond_the_limit):
    head = RUNNING.ljust(MAX_RESULTS_BYTES + beyond_the_limit)
    assert job_finished(head) is (beyond_the_limit > 0)


@QUICK
@given(st.lists(HOSTILE_LINES, max_size=50))
# What backtracking patterns read in quadratic time: a progress bar's words, then digits without a "/"; digits and
# commas before no " GiB for CUDAGraph memory" (the figure's pattern of _startup_log that progress no longer reads).
@example(['Loading safetensors checkpoint shards: ' + '1' * 10000] * 10)
@example(['1,' * 5000] * 10)
def test_any_journal_is_read_in_linear_time_and_its_quote_is_bounded(lines):
    phase, line = start_phase(lines)
    assert isinstance(phase, str) and len(phase) <= 2 * MAX_LINE_CHARS
    assert line is None or len(line) <= MAX_LINE_CHARS + len('... (9999999 more characters)')
    strict_json(start_report(lines, 1.0, 2.0))


@QUICK
@given(st.lists(HOSTILE_LINES, max_size=10), st.sampled_from(PROGRESS_LINES), st.lists(QUIET_LINES, max_size=10))
def test_the_latest_progress_line_names_the_phase_whatever_surrounds_it(before, progress, after):
    line, expected = progress
    assert start_phase(before + [line] + after)[0] == expected


@QUICK
@given(
    st.integers(0, 2**64),
    st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    st.integers(0, 2**64),
    st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    st.floats(0, 1e10),
    st.dictionaries(st.sampled_from(['time', 'bytes', 'started']), JSON_JUNK),
)
# One byte since a report at the dawn of floats: a rate too small for the estimate to be a float.
@example(1, 2**62, 1, None, 1e9, {'time': -1.7e308, 'bytes': 0})
def test_a_download_report_is_strict_json_and_never_claims_more_than_the_totals(
    done_bytes, total_bytes, done_files, total_files, now, previous
):
    report = strict_json(download_report(done_bytes, total_bytes, done_files, total_files, now, previous))
    figures = report['download']
    assert not total_bytes or figures['bytes'] <= total_bytes
    assert not total_files or figures['files'] <= total_files
    for rate_or_estimate in (figures['bytes_per_second'], figures['seconds_left']):
        assert rate_or_estimate is None or 0 <= rate_or_estimate < math.inf


@QUICK
@given(
    st.sampled_from(PROGRESS_LINES), st.floats(0, 1e10), st.dictionaries(st.sampled_from(['phase_since']), JSON_JUNK)
)
def test_a_phase_is_never_timed_from_a_junk_sample(progress, now, previous):
    line, phase = progress
    report = strict_json(start_report([line], 0.0, now, dict(previous, phase=phase)))
    assert 0 <= report['start']['phase_seconds'] < math.inf


@QUICK
@given(JSON_JUNK)
def test_a_sample_is_a_finite_number_or_none(value):
    number = finite_number(value)
    assert number is None or math.isfinite(number)


@QUICK
@given(st.one_of(st.text(alphabet='abc.@\\:-_0\0\n*/ \u00e9\udcff', max_size=300), st.integers()))
def test_a_unit_name_is_one_systemd_allows_or_refused_in_a_short_message(value):
    try:
        name = unit_name(value)
    except ValueError as exc:
        assert not re.fullmatch(r'[A-Za-z0-9:_.@\\-]{1,255}', str(value))
        assert len(str(exc)) < 300
    else:
        assert name == str(value) and re.fullmatch(r'[A-Za-z0-9:_.@\\-]{1,255}', name)
