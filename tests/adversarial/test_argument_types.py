# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The collection's argument types (plugins/module_utils/_arguments.py) against text that is not UTF-8.

A file name in another encoding reaches a module as text with a lone surrogate ('\\udcff' for the byte 0xff), in
the option or in a variable of the environment that the path expands. AnsibleModule encodes each argument to UTF-8
to log it, before the module's own code runs: the type has to refuse such a path by the option's name. Each case
runs a module that takes path options as Ansible does (tests/adversarial/harness.py) and must end in a clean error
that names the option and the path, or, for a path that is UTF-8 beyond ASCII, in the module's own success.
"""

import json

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness

REFUSED = (
    "argument '%s' is of type str and we were unable to convert to nul_free_path: a path must be valid UTF-8, got "
)
REFUSED_IN_DOWNLOAD = (
    "argument 'path' is of type str found in 'download'. and we were unable to convert to nul_free_path: "
    'a path must be valid UTF-8, got '
)
RUNNING = json.dumps({'started': 1, 'finished': 0, 'ansible_job_id': 'j7.1'})


def says(expected):
    """check(result, tmp_path): the message is expected, {tmp} standing for the case's folder."""
    return lambda result, tmp: result['msg'] == expected.format(tmp=ascii(str(tmp))[1:-1])


def running(result, tmp):
    return result['finished'] is False and result['msg'].startswith('running for ')


def job(tmp_path, name):
    """A running job's results file called name in tmp_path; its path."""
    path = tmp_path / name
    path.write_text(RUNNING)
    return str(path)


# (module, how the case makes its options from tmp_path, the environment it adds, whether the module should
# succeed, the check of its result)
CASES = {
    'kv_cache_quant path': (
        'kv_cache_quant',
        lambda tmp: {'path': '/ckpt/\udcff'},
        None,
        False,
        says(REFUSED % 'path' + "'/ckpt/\\udcff'"),
    ),
    'kv_cache_quant path under a HOME that is not utf-8': (
        'kv_cache_quant',
        lambda tmp: {'path': '~/ckpt'},
        {'HOME': '/home/\udcff'},
        False,
        says(REFUSED % 'path' + "'/home/\\udcff/ckpt'"),
    ),
    'deployment unit_file': (
        'deployment',
        lambda tmp: {'path': str(tmp), 'state': 'restored', 'unit_file': '/etc/\udcc3\udca9.service'},
        None,
        False,
        says(REFUSED % 'unit_file' + "'/etc/\\udcc3\\udca9.service'"),
    ),
    'progress results_file': (
        'progress',
        lambda tmp: {'results_file': str(tmp) + '/j\udcff.1', 'wait': 0.1},
        None,
        False,
        says(REFUSED % 'results_file' + "'{tmp}/j\\udcff.1'"),
    ),
    'progress download.path': (
        'progress',
        lambda tmp: {'results_file': job(tmp, 'j7.1'), 'wait': 0.1, 'download': {'path': '/models/\ud800x'}},
        None,
        False,
        says(REFUSED_IN_DOWNLOAD + "'/models/\\ud800x'"),
    ),
    'progress results_file of utf-8 beyond ascii': (
        'progress',
        lambda tmp: {'results_file': job(tmp, 'j-\u00e9-\U0001f600.1'), 'wait': 0.1},
        None,
        True,
        running,
    ),
}


@pytest.mark.parametrize('module, options, env, expect_success, check', list(CASES.values()), ids=list(CASES))
def test_a_path_that_is_not_utf8_is_refused_by_the_options_name(
    tmp_path, verdict, module, options, env, expect_success, check
):
    run_ = harness.run_module(module, tmp_path, options(tmp_path), env=env)
    outcome = harness.judge(run_, expect_success=expect_success, check=lambda result: check(result, tmp_path))
    verdict(module, outcome, (run_.stdout + run_.stderr)[-2000:])
