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
import re

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tests.support import run_local_play

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


# What a play can put in a text option: a lone surrogate cannot be written in YAML nor JSON that Ansible loads, only
# made by a template. Each module below gets one in a text option of its own: (module, options, that option).
SURROGATE = "{{ 'm%c' | format(55296) }}"
TEXT_OPTIONS = [
    ('ansible.builtin.stat', {'path': SURROGATE}, 'path'),
    ('llmserve.vllm.chat_check', {'url': 'http://127.0.0.1:9', 'model': SURROGATE}, 'model'),
    ('llmserve.vllm.load_probe', {'url': 'http://127.0.0.1:9', 'model': SURROGATE}, 'model'),
    ('llmserve.vllm.checkpoint_verify', {'path': '/nonexistent', 'repo_id': 'o/m', 'revision': SURROGATE}, 'revision'),
    ('llmserve.vllm.gpu_preflight', {'model_path': '/nonexistent', 'service_name': SURROGATE}, 'service_name'),
    ('llmserve.vllm.progress', {'results_file': '/nonexistent', 'unit': SURROGATE}, 'unit'),
    ('llmserve.vllm.deployment', {'path': '/nonexistent', 'state': SURROGATE}, 'state'),
]
# ansible-core's failure: AnsibleModule's where it logs its arguments, before any module's code runs, or the
# controller's where a module's result repeats the text.
ANSIBLE_CORE_REFUSAL = re.compile(
    r"^Task failed: (Module failed|Refusing to deserialize an invalid UTF8 string value): 'utf-8' codec can't encode character "
    r"'\\ud800' in position [0-9]+: surrogates not allowed$"
)


def test_a_lone_surrogate_in_a_text_option_fails_the_task_cleanly_as_ansible_builtin_stat_does(tmp_path):
    """Each module's task fails with a message, changes nothing, and runs none of the module's work: with
    AnsibleModule's own message where it logs its arguments (as ansible.builtin.stat's does), or with the
    collection's refusal naming the option, where the option has a type of the collection's. (Naming the option for
    every text option would take a type of the collection's, and a validate-modules exception, for each of them.)"""
    tasks = [
        {module: options, 'register': 'result_%d' % index, 'ignore_errors': True}
        for index, (module, options, _option) in enumerate(TEXT_OPTIONS)
    ]
    names = ', '.join('result_%d' % index for index in range(len(TEXT_OPTIONS)))
    tasks.append(
        {'ansible.builtin.copy': {'dest': str(tmp_path / 'results.json'), 'content': '{{ [%s] | to_json }}' % names}}
    )
    rc, output = run_local_play(tmp_path, tasks)
    assert rc == 0, output
    results = json.loads((tmp_path / 'results.json').read_text())
    for (module, _options, option), result in zip(TEXT_OPTIONS, results):
        named = result.get('msg', '').startswith("argument '%s' is of type str and we were unable to convert" % option)
        assert result.get('failed') is True and result.get('changed') is False, (module, result)
        assert ANSIBLE_CORE_REFUSAL.match(result['msg']) or named, (module, result)
    assert ANSIBLE_CORE_REFUSAL.match(results[0]['msg'])
