# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

import json

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._progress import (
    download_report,
    format_bytes,
    format_duration,
    job_finished,
    start_phase,
    start_report,
)

# Lines of a vLLM 0.10 start of an MoE at TP 8 (tests/fixtures/startup_logs), with the progress bars vLLM prints.
START = [
    '(APIServer pid=1624) INFO 09-24 20:45:41 [api_server.py:1896] vLLM API server version 0.10.2',
    '(Worker_TP2_EP2 pid=2080) INFO 09-24 20:46:12 [gpu_model_runner.py:2338] Starting to load model Qwen/Qwen3-235B',
    'Loading safetensors checkpoint shards:   0% Completed | 0/24 [00:00<?, ?it/s]',
    'Loading safetensors checkpoint shards:  42% Completed | 10/24 [02:10<03:02, 13.0s/it]',
    '(Worker_TP2_EP2 pid=2080) INFO 09-24 20:50:59 [gpu_model_runner.py:2392] Model loading took 27.7183 GiB and '
    '287.251049 seconds',
    '(Worker_TP2_EP2 pid=2080) INFO 09-24 20:53:40 [gpu_worker.py:298] Available KV cache memory: 10.64 GiB',
    '(EngineCore_DP0 pid=1944) INFO 09-24 20:53:41 [kv_cache_utils.py:864] GPU KV cache size: 237,344 tokens',
    'Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  45%|####5     | 30/67 [00:05<00:06,  5.89it/s]',
    '(Worker_TP0 pid=2078) INFO 09-24 20:54:20 [gpu_model_runner.py:3118] Graph capturing finished in 39 secs, took '
    '3.45 GiB',
    '(APIServer pid=1624) INFO 09-24 20:54:38 [api_server.py:1692] Starting vLLM API server 0 on http://127.0.0.1:8000',
    '(APIServer pid=1624) INFO:     Application startup complete.',
]


@pytest.mark.parametrize(
    'text, finished',
    [
        (json.dumps({'started': 1, 'finished': 0, 'ansible_job_id': 'j1.2'}), False),
        (json.dumps({'changed': True, 'rc': 0, 'stdout': '{}'}), True),
        (json.dumps({'failed': True, 'msg': 'the checkpoint does not match'}), True),
        # The wrapper's own end of a job it killed at its time limit.
        (json.dumps({'started': 1, 'finished': 1, 'failed': True, 'msg': 'Timeout exceeded'}), True),
        ('{"started": 1, "fin', False),
        ('', False),
        ('[1]', False),
    ],
)
def test_a_job_has_finished_when_its_results_file_holds_its_result(text, finished):
    assert job_finished(text) is finished


@pytest.mark.parametrize(
    'seconds, text', [(0, '0s'), (44.6, '45s'), (365, '6m05s'), (3599, '59m59s'), (7380, '2h03m'), (-3, '0s')]
)
def test_durations(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize('count, text', [(0, '0 B'), (999, '999 B'), (812000, '812.0 kB'), (540e9, '540.0 GB')])
def test_sizes_in_the_hubs_units(count, text):
    assert format_bytes(count) == text


def test_the_first_download_report_has_no_rate_yet():
    report = download_report(3_100_000_000, 540_000_000_000, 2, 119, now=100.0)
    assert report['msg'] == '3.1 GB of 540.0 GB, 2 of 119 files, the rate at the next report'
    assert report['download']['bytes_per_second'] is None and report['download']['seconds_left'] is None
    assert report['sample'] == {'time': 100.0, 'bytes': 3_100_000_000}


def test_the_rate_is_the_last_intervals_and_the_estimate_follows_it():
    first = download_report(100_000_000_000, 540_000_000_000, 20, 119, now=1000.0)
    second = download_report(160_000_000_000, 540_000_000_000, 31, 119, now=1060.0, previous=first['sample'])
    assert second['download']['bytes_per_second'] == 1e9
    assert second['download']['seconds_left'] == 380.0
    assert second['msg'] == '160.0 GB of 540.0 GB, 31 of 119 files, 1.0 GB/s, about 6m20s left'


def test_a_download_that_stands_still_says_so():
    first = download_report(5_000, 10_000, 1, 2, now=10.0)
    second = download_report(5_000, 10_000, 1, 2, now=70.0, previous=first['sample'])
    assert second['download']['bytes_per_second'] == 0.0
    assert second['msg'] == '5.0 kB of 10.0 kB, 1 of 2 files, 0 B/s, no bytes in the last 1m00s'


def test_what_the_disk_holds_beyond_the_manifest_is_capped():
    report = download_report(12_000, 10_000, 5, 2, now=1.0)
    assert report['download']['bytes'] == 10_000 and report['download']['files'] == 2


def test_without_totals_the_report_says_what_it_has():
    report = download_report(2_500_000, None, 4, None, now=1.0)
    assert report['msg'] == '2.5 MB, 4 files, the rate at the next report'


@pytest.mark.parametrize(
    'upto, phase',
    [
        (0, 'starting, nothing in the journal yet'),
        (1, 'starting, no progress line yet'),
        (2, 'loading the model'),
        (3, 'loading weights: shard 0 of 24'),
        (4, 'loading weights: shard 10 of 24'),
        (5, 'weights loaded (27.7183 GiB); profiling the memory'),
        (6, 'weights loaded (27.7183 GiB); profiling the memory'),
        (7, 'KV cache of 237,344 tokens allocated'),
        (8, 'capturing CUDA graphs: 30 of 67'),
        (9, 'CUDA graphs captured in 39 s'),
        (10, 'API server starting'),
        (11, 'serving: the gate asks its questions'),
    ],
)
def test_the_phase_is_the_latest_progress_line_of_the_start(upto, phase):
    assert start_phase(START[:upto])[0] == phase


def test_before_any_progress_line_the_last_line_is_quoted_without_its_prefix():
    phase, line = start_phase(START[:1])
    assert line == 'vLLM API server version 0.10.2'


@pytest.mark.parametrize(
    'line, phase',
    [
        (
            '(EngineCore pid=583) INFO 12-01 16:25:22 [kv_cache_utils.py:2327] CPU KV cache size: 4,096 tokens, '
            'Maximum concurrency for 1,024 tokens per request: 4.00x',
            'KV cache of 4,096 tokens allocated',
        ),
        (
            '(APIServer pid=529) INFO 12-01 16:25:23 [entry.py:140] Starting vLLM server on http://127.0.0.1:8000',
            'API server starting',
        ),
    ],
)
def test_the_lines_of_vllm_0_32_s_cpu_build_name_their_phases(line, phase):
    # As the sandbox's journal has them.
    assert start_phase([line])[0] == phase


def test_a_phase_is_timed_from_the_report_that_first_saw_it():
    first = start_report(START[:3], waited=30.0, now=1030.0)
    assert first['msg'] == 'loading weights: shard 0 of 24 (0s in this phase, 30s since the wait began)'
    same = start_report(START[:3], waited=90.0, now=1090.0, previous=first['sample'])
    assert same['start']['phase_seconds'] == 60.0
    moved = start_report(START[:5], waited=150.0, now=1150.0, previous=same['sample'])
    assert moved['start']['phase_seconds'] == 0.0
    assert moved['msg'].startswith('weights loaded (27.7183 GiB); profiling the memory (0s in this phase, 2m30s')


def test_a_start_without_progress_lines_quotes_its_last_line():
    report = start_report(['Waiting for /dev/nvidia-uvm'], waited=5.0, now=5.0)
    assert report['msg'] == (
        'starting, no progress line yet (0s in this phase, 5s since the wait began): Waiting for /dev/nvidia-uvm'
    )
