# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.chat_check against hostile lines in the journal it reads vLLM's start-up figures from.

A unit that fails makes the check read its journal for the figures (startup) and the progress lines. A journal line
can be 40,000 characters of anything: each case runs the module as Ansible does (tests/adversarial/harness.py) and
must end, by its deadline, in the clean failure the unit's state deserves, with the figures of vLLM's real lines
beside the hostile ones and nothing taken from text that is no figure. The deadline is far above what reading the
lines in linear time takes (a second or two) and far below what a quadratic read takes (minutes for one line).
Every journal line the result or the message quotes is cut to MAX_QUOTED_LINE_CHARS, marked with what was cut.
"""

import json
import re

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tests.fake_openai import reply
from ansible_collections.llmserve.vllm.tests.support import chat_completion, fixture_path

MODULE = 'chat_check'
FAILED_UNIT = (
    'LoadState=loaded\nActiveState=failed\nSubState=failed\nResult=exit-code\nNRestarts=0\n'
    'ExecMainStatus=1\nExecMainStartTimestampMonotonic=0\n'
)
FAILED_MSG = re.compile(
    r'The unit vllm\.service failed \(ActiveState=failed, SubState=failed, Result=exit-code, '
    r'ExecMainStatus=1, NRestarts=0\) while waiting [0-9.]+ s for http://127\.0\.0\.1:9 to answer\Z'
)
RUNNING_UNIT = 'LoadState=loaded\nActiveState=active\nSubState=running\nResult=success\nNRestarts=0\nExecMainStatus=0\n'
# vLLM V1's lines of a start (tests/fixtures/startup_logs), and the figures they give.
VLLM_LINES = [
    '(Worker_TP0 pid=770) INFO 08-21 18:18:05 [gpu_model_runner.py:5405] Model loading took 55.19 GiB memory and '
    '48.502592 seconds',
    '(Worker_TP0 pid=770) INFO 08-21 18:22:06 [gpu_worker.py:789] Free memory on device (94.05/95.01 GiB) on startup. '
    'Desired GPU memory utilization is (0.9, 85.51 GiB). Actual usage is 56.89 GiB for consumed memory (weights + '
    'non-torch), 0.76 GiB for peak activation, and 0.32 GiB for CUDAGraph memory. Current kv cache memory in use is '
    '27.85 GiB.',
    '(EngineCore_DP0 pid=600) INFO 08-21 18:22:07 [kv_cache_utils.py:1087] GPU KV cache size: 237,344 tokens',
    '(EngineCore_DP0 pid=600) INFO 08-21 18:22:07 [kv_cache_utils.py:1091] Maximum concurrency for 32,768 tokens per '
    'request: 7.24x',
]
VLLM_FIGURES = {
    'weights_gib': 55.19,
    'available_kv_gib': 27.85,
    'kv_tokens': 237344,
    'max_concurrency': 7.24,
    'cudagraph_gib': 0.32,
    'weights_seconds': 48.502592,
    'weights_gib_per_second': 1.138,
    'kv_cache_device': 'GPU',
}
LONG = 40000
# Words of the figures' lines, over and over, each followed by digits and commas that end in a letter: no figure.
WORDS = (
    ' GiB for CUDAGraph memory',
    'GPU KV cache size: ',
    '# GPU blocks: ',
    'Model loading took ',
    'model weights take  ',
    'kv_cache_size=',
    'Maximum concurrency for 1,',
)

# (the hostile lines that come before vLLM's own)
JOURNALS = {
    # Read from each digit on, a line of digits and commas took minutes, 50 of them hours.
    '50 lines of 40,000 digits and commas': ['1,' * (LONG // 2)] * 50,
    'the words of each figure over and over': [(words + ',1,1,1,1x') * (LONG // (len(words) + 10)) for words in WORDS],
    # float('') raised: the module ended in a traceback.
    'figures of commas alone': ['Model loading took , GiB and 1 seconds', 'x,,, GiB for CUDAGraph memory'],
    # int(inf) raised; a figure of infinity replaced the bounding one.
    'figures no float holds': [
        'GPU KV cache size: %s tokens' % ('9' * 400),
        '1,' * (LONG // 2) + '1 GiB for CUDAGraph memory',
    ],
}


def fake_systemd(tmp_path, journal_lines, unit=FAILED_UNIT):
    """A bin folder whose systemctl shows the unit (failed by default) and whose journalctl prints journal_lines."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'journal.txt').write_text('\n'.join(journal_lines) + '\n')
    for name, body in (
        ('systemctl', "printf '%s'" % unit.replace('\n', '\\n')),
        ('journalctl', 'cat "$(dirname "$0")/journal.txt"'),
    ):
        (bin_dir / name).write_text('#!/bin/sh\n%s\n' % body)
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize('hostile', list(JOURNALS.values()), ids=list(JOURNALS))
def test_hostile_journal_lines_give_no_figure_and_cost_linear_time(tmp_path, verdict, hostile):
    run_ = harness.run_module(
        MODULE,
        tmp_path,
        {'url': 'http://127.0.0.1:9', 'unit': 'vllm.service', 'timeout': 6, 'interval': 0.2},
        path_prefix=fake_systemd(tmp_path, hostile + VLLM_LINES),
    )

    def check(result):
        return FAILED_MSG.match(result['msg']) is not None and result['startup'] == VLLM_FIGURES

    verdict(MODULE, harness.judge(run_, expect_success=False, check=check), str(run_.result)[:2000])


# --- a journal line quoted: cut, however long ----------------------------------------------------

# The most of one journal line that the result or the message quotes (_journal's MAX_QUOTED_LINE_CHARS).
MAX_QUOTED_LINE_CHARS = 1024
# Words of a progress line and of a line that explains a failure, then 40,000 characters: each was quoted whole.
LONG_PROGRESS = 'Loading safetensors checkpoint shards: ' + 'x' * LONG
LONG_EXPLAINING = 'ValueError: ' + 'y' * LONG
# vLLM's lines as progress quotes them: whole, without their log prefix.
VLLM_PROGRESS = [line.split('] ', 1)[1] for line in VLLM_LINES]


def cut(line):
    """line as a result quotes it: its first MAX_QUOTED_LINE_CHARS characters and how many more it had."""
    return line[:MAX_QUOTED_LINE_CHARS] + '... (%d more characters)' % (len(line) - MAX_QUOTED_LINE_CHARS)


def test_a_long_progress_line_is_cut_in_a_success(tmp_path, verdict, fake_openai):
    with open(fixture_path('chat_check', 'vllm-models.json'), 'rb') as models:
        routes = {
            '/health': reply(200),
            '/v1/models': reply(200, models.read()),
            '/v1/chat/completions': reply(200, json.dumps(chat_completion('The capital of France is Paris.'))),
        }
    server = fake_openai(routes)
    run_ = harness.run_module(
        MODULE,
        tmp_path,
        {'url': server.url, 'unit': 'vllm.service', 'timeout': 10, 'interval': 0.2},
        path_prefix=fake_systemd(tmp_path, [LONG_PROGRESS] + VLLM_LINES, unit=RUNNING_UNIT),
    )

    def check(result):
        return result['progress'] == [cut(LONG_PROGRESS)] + VLLM_PROGRESS and result['startup'] == VLLM_FIGURES

    verdict(MODULE, harness.judge(run_, expect_success=True, check=check), str(run_.result)[:2000])


def test_long_journal_lines_are_cut_in_a_failure(tmp_path, verdict):
    run_ = harness.run_module(
        MODULE,
        tmp_path,
        {'url': 'http://127.0.0.1:9', 'unit': 'vllm.service', 'timeout': 6, 'interval': 0.2},
        path_prefix=fake_systemd(tmp_path, [LONG_EXPLAINING, LONG_PROGRESS] + VLLM_LINES),
    )
    quoted = cut(LONG_EXPLAINING)

    def check(result):
        msg, separator, journal = result['msg'].partition('. From its journal:\n  ')
        return (
            separator
            and FAILED_MSG.match(msg) is not None
            and journal == quoted
            and result['journal'] == [quoted]
            and result['progress'] == [cut(LONG_PROGRESS)] + VLLM_PROGRESS
        )

    verdict(MODULE, harness.judge(run_, expect_success=False, check=check), str(run_.result)[:2000])
