# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The pre-load smoke's report as the play shows it: figures, and the message a failure stops the play with."""

import json

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preload_smoke import (
    SmokeReportError,
    report_from_journal,
    summarize,
)

PASSED_ON_CPU = {
    'passed': True,
    'backend': 'gloo',
    'ranks': 2,
    'devices': [{'index': 0, 'cpus': '0'}, {'index': 1, 'cpus': '1'}],
    'versions': {'torch': '2.13.0+cpu', 'vllm': '0.32.0+cpu', 'cuda': None},
    'checks': [
        {'name': 'parser', 'status': 'passed', 'seconds': 3.25, 'detail': 'vLLM 0.32.0 parsed 24 arguments'},
        {'name': 'allreduce', 'status': 'passed', 'seconds': 1.0, 'detail': 'sum 3 of 2 ranks'},
        {'name': 'triton', 'status': 'skipped', 'seconds': 0.0, 'detail': 'no GPU'},
    ],
}


def test_a_passing_report_gives_its_figures_and_no_failure():
    assert summarize(PASSED_ON_CPU) == {
        'passed': True,
        'figures': [
            'backend gloo, 2 rank(s); torch 2.13.0+cpu, vllm 0.32.0+cpu',
            'devices: 0 cpus 0; 1 cpus 1',
            'parser: passed in 3.2 s (vLLM 0.32.0 parsed 24 arguments)',
            'allreduce: passed in 1.0 s (sum 3 of 2 ranks)',
            'triton: skipped in 0.0 s (no GPU)',
        ],
        'failure': '',
    }


def test_each_failed_check_is_named_with_its_cause_and_remedy():
    report = dict(
        PASSED_ON_CPU,
        passed=False,
        checks=[
            {
                'name': 'parser',
                'status': 'failed',
                'seconds': 2.0,
                'detail': 'rejected',
                'cause': "vLLM's parser rejected the command line: unrecognized arguments: --no-such-flag.",
                'remedy': 'remove --no-such-flag from vllm_kimi_extra_args',
            },
            {'name': 'compiler', 'status': 'failed', 'seconds': 0.1, 'detail': 'no compiler found'},
            {'name': 'writable', 'status': 'passed', 'seconds': 0.0},
        ],
    )
    result = summarize(report)
    assert result['passed'] is False
    assert result['failure'] == (
        "parser failed: vLLM's parser rejected the command line: unrecognized arguments: --no-such-flag. "
        'Remedy: remove --no-such-flag from vllm_kimi_extra_args. '
        'compiler failed: no compiler found.'
    )
    assert result['figures'][-1] == 'writable: passed in 0.0 s'


def test_a_report_that_says_failed_without_a_failed_check_still_fails():
    result = summarize(dict(PASSED_ON_CPU, passed=False))
    assert result == dict(
        result, passed=False, failure='the smoke reported a failure without naming the check that failed.'
    )


def test_gpu_devices_are_named_with_their_capability():
    report = dict(PASSED_ON_CPU, devices=[{'index': 0, 'name': 'NVIDIA RTX PRO 6000', 'capability': '12.0'}])
    assert summarize(report)['figures'][1] == 'devices: 0 NVIDIA RTX PRO 6000 (sm 12.0)'


def test_the_report_is_the_last_json_line_of_the_journal():
    journal = '\n'.join(
        [
            'Starting smoke...',
            '{"not": "a report"}',
            json.dumps(dict(PASSED_ON_CPU, backend='old')),
            'W1202 some warning',
            json.dumps(PASSED_ON_CPU),
            'Finished.',
        ]
    )
    assert report_from_journal(journal) == PASSED_ON_CPU


@pytest.mark.parametrize(
    ('journal', 'message'),
    [
        ('', 'the pre-load smoke printed no report; its journal ends:\n(the journal is empty)'),
        (
            'python: can\'t open file\n{"checks": "not a list"}',
            'the pre-load smoke printed no report; its journal ends:\npython: can\'t open file\n{"checks": "not a list"}',
        ),
        (None, "the smoke's journal must be text, got NoneType"),
    ],
    ids=['empty', 'no-report', 'not-text'],
)
def test_a_journal_without_a_report_is_refused_with_its_tail(journal, message):
    with pytest.raises(SmokeReportError) as raised:
        report_from_journal(journal)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ('report', 'message'),
    [
        ([], "the smoke's report must be an object with a list of checks, got []"),
        ({'checks': [{'status': 'passed'}]}, "check 0 of the smoke's report has no name: {'status': 'passed'}"),
        (
            {'checks': [{'name': 'parser', 'status': 'ok'}]},
            "check parser of the smoke's report has status 'ok', not one of passed, failed, skipped",
        ),
    ],
    ids=['not-an-object', 'nameless-check', 'unknown-status'],
)
def test_a_report_of_the_wrong_shape_is_refused(report, message):
    with pytest.raises(SmokeReportError) as raised:
        summarize(report)
    assert str(raised.value) == message
