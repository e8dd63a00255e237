# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Whose words a journal line holds: vLLM's loggers' in the shapes its releases write (tests/fixtures' recorded
starts), uvicorn's, systemd's."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._vllm_log import (
    is_api_ready,
    quotable_lines,
    start_messages,
    starts_a_run,
    vllm_message,
)
from ansible_collections.llmserve.vllm.tests.support import recorded


@pytest.mark.parametrize(
    'line, message',
    [
        # V1 (0.10 to 0.33), with the process that wrote it and without.
        (
            '(EngineCore_DP0 pid=600) INFO 08-21 18:22:07 [kv_cache_utils.py:1087] GPU KV cache size: 1 tokens',
            'GPU KV cache size: 1 tokens',
        ),
        ('(VllmWorker-0 pid=8966) WARNING 11-30 03:51:21 [vllm.py:725] Model Runner V2', 'Model Runner V2'),
        (
            'INFO 06-05 09:07:48 [gpu_model_runner.py:1549] Model loading took 3.3466 GiB',
            'Model loading took 3.3466 GiB',
        ),
        ('INFO 06-05 09:07:48.123 [x.py:1] milliseconds', 'milliseconds'),
        # V0 (0.6, 0.7): no bracket before the file.
        (
            '(VllmWorkerProcess pid=240) INFO 02-14 08:23:15 worker.py:266] model weights take 3.97GiB',
            'model weights take 3.97GiB',
        ),
        ('(EngineCore pid=8402) ERROR 11-30 03:51:22 [core.py:1510] ', ''),
        # The file as a shortened path (vLLM's relpath logging).
        (
            'INFO 06-05 09:07:48 [model_executor/.../quantization/utils/fp8_utils.py:12] Using FP8',
            'Using FP8',
        ),
        # The request logger's prompt (0.32's and earlier releases' file), uvicorn's lines, systemd's, a
        # traceback's: none of vLLM's own.
        ("(APIServer pid=1) INFO 08-21 18:30:00 [logger.py:43] Received request x: prompt: 'y'", None),
        (
            '(APIServer pid=1) DEBUG 08-21 18:30:00 [entrypoints/.../utils/request_logger.py:56] Request x details: '
            "prompt: 'y'",
            None,
        ),
        ('(APIServer pid=1) INFO:     Application startup complete.', None),
        ('INFO:     127.0.0.1:5 - "GET /health HTTP/1.1" 200 OK', None),
        ("vllm.service: Failed with result 'exit-code'.", None),
        ('ValueError: To serve at least one request', None),
        ('Model loading took 9999 GiB', None),
    ],
)
def test_vllm_message(line, message):
    assert vllm_message(line) == message


@pytest.mark.parametrize(
    'line, ready',
    [
        ('INFO:     Application startup complete.', True),
        ('(APIServer pid=1624) INFO:     Application startup complete.', True),
        ('INFO:      - "GET /?Application startup complete. HTTP/1.1" 404 Not Found', False),
        ('Application startup complete.', False),
    ],
)
def test_is_api_ready(line, ready):
    assert is_api_ready(line) is ready


@pytest.mark.parametrize(
    'line, starts',
    [
        ("(APIServer pid=1) INFO 06-05 09:10:15 [utils.py:233] non-default args: {'model': 'm'}", True),
        ('INFO 06-05 09:09:15 [api_server.py:1289] vLLM API server version 0.9.0.1', True),
        ('Started vllm-kimi.service - vLLM Kimi-K2.5.', True),
        ('vllm.service: Scheduled restart job, restart counter is at 2.', True),
        ('INFO 06-05 09:09:15 [x.py:1] the non-default args: are', False),
        ('INFO:     Started server process [9820]', False),
    ],
)
def test_starts_a_run(line, starts):
    assert starts_a_run(line) is starts


def test_a_recorded_start_is_read_to_its_apis_line_and_its_requests_are_not():
    lines = recorded('chat_check', 'vllm-started.log').splitlines()
    messages = start_messages(lines)
    assert messages[0].startswith('non-default args: ')
    assert messages[-1] == 'Available routes are:'
    assert not any('HTTP/1.1' in line for line in quotable_lines(lines))


def test_a_recorded_failure_is_quoted_whole():
    """A start refused for lack of KV-cache memory never served: its tracebacks and vLLM's lines are all quotable,
    and its prefix-less noise (warnings, progress bars) as well."""
    lines = [line for line in recorded('chat_check', 'vllm-kv-cache-refused.log').splitlines() if line.strip()]
    assert quotable_lines(lines) == lines
