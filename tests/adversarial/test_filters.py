# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Bad input against the collection's filters, called as the Python functions Ansible calls.

Each case ends in one outcome of harness.py, judged here by hand: a refusal must be an AnsibleFilterError naming
the filter, the value and the cause (a clean error); any other exception is a traceback; a result where a refusal
is due, or a wrong result, is a wrong success; a refusal of good input a wrong error; a secret in a message a leak.
The values are those Ansible hands a filter: -e name=false gives the text 'false', a YAML slip a text for a list.
"""

import json

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.checkpoint import checkpoint_writers
from ansible_collections.llmserve.vllm.plugins.filter.cpu import cpu_threads_bind
from ansible_collections.llmserve.vllm.plugins.filter.network import host_port
from ansible_collections.llmserve.vllm.plugins.filter.pip import pip_source_credentials
from ansible_collections.llmserve.vllm.plugins.filter.replicas import api_endpoints
from ansible_collections.llmserve.vllm.plugins.filter.systemd import systemd_env_quote, systemd_exec_quote
from ansible_collections.llmserve.vllm.plugins.filter.vllm import (
    pinned_version,
    preload_smoke_report,
    vllm_flag_value,
    vllm_serve_argv,
)
from ansible_collections.llmserve.vllm.tests.adversarial import harness

pytestmark = pytest.mark.adversarial


def outcome_of(call, expect_success, check, secrets=()):
    """The one outcome of call() and what it gave. check: for a result, True when it is right; for a refusal, True
    when its message names what it must."""
    try:
        answer = call()
    except AnsibleFilterError as error:
        answer = str(error)
        failed = True
    except Exception as error:  # noqa: BLE001 - any other exception is the defect this suite counts
        return harness.TRACEBACK, repr(error)
    else:
        failed = False
    if any(secret in repr(answer) for secret in secrets):
        return harness.LEAK, repr(answer)
    if failed:
        good = not expect_success and check(answer)
        return (harness.CLEAN_ERROR if good else harness.WRONG_ERROR), answer
    if not expect_success:
        return harness.WRONG_SUCCESS, repr(answer)
    return (harness.CORRECT_SUCCESS if check(answer) else harness.WRONG_SUCCESS), repr(answer)


def names(*parts):
    return lambda message: all(part in message for part in parts)


def refused(verdict, filter_name, call, *parts, secrets=()):
    """The case's verdict where call() must be refused with a message naming the filter and each of parts."""
    outcome, detail = outcome_of(call, False, names(filter_name, *parts), secrets)
    verdict(filter_name, outcome, detail)


def answered(verdict, filter_name, call, check, secrets=()):
    """The case's verdict where call() must answer, and check(answer) hold."""
    outcome, detail = outcome_of(call, True, check, secrets)
    verdict(filter_name, outcome, detail)


SETTINGS = {
    'entrypoint': ['/opt/vllm/0123456789ab/bin/vllm', 'serve'],
    'model': '/models/kimi-k2.5-nvfp4',
    'served_model_name': 'kimi-k2.5',
    'host': '127.0.0.1',
    'port': 8000,
    'uds': '',
    'tensor_parallel_size': 8,
    'pipeline_parallel_size': 1,
    'max_model_len': 131072,
    'gpu_memory_utilization': 0.95,
    'kv_cache_memory_bytes': 0,
    'kv_cache_dtype': 'auto',
    'tool_call_parser': 'kimi_k2',
    'trust_remote_code': True,
    'multimodal': 'encoder_data_parallel',
    'allowed_media_domains': [],
    'limit_mm_per_prompt': {'image': 8, 'video': 0},
    'flags': {'--reasoning-parser': 'kimi_k2', '--shutdown-timeout': 120},
    'cluster_args': [],
    'extra_args': ['--max-num-seqs', '64'],
}


def serve_argv(**changes):
    return lambda: vllm_serve_argv(dict(SETTINGS, **changes))


def has_run(*run):
    """argv holds these words in a row."""
    return lambda argv: any(list(argv[start : start + len(run)]) == list(run) for start in range(len(argv)))


def lacks(word):
    return lambda argv: word not in argv


@pytest.mark.parametrize(
    'value, trusted',
    [
        ('false', False),
        ('False', False),
        (' no ', False),
        ('off', False),
        ('0', False),
        (0, False),
        (False, False),
        ('true', True),
        ('yes', True),
        (1, True),
        (True, True),
    ],
)
def test_trust_remote_code_reads_a_boolean_as_ansible_does(verdict, value, trusted):
    # -e vllm_kimi_trust_remote_code=false gives the text 'false', which the role's argument spec (type: bool)
    # validates without converting.
    check = has_run('--trust-remote-code') if trusted else lacks('--trust-remote-code')
    answered(verdict, 'vllm_serve_argv', serve_argv(trust_remote_code=value), check)


@pytest.mark.parametrize(
    'key, value, cause',
    [
        ('trust_remote_code', 'maybe', 'must be a boolean'),
        ('trust_remote_code', '', 'must be a boolean'),
        ('trust_remote_code', None, 'must be a boolean'),
        ('trust_remote_code', 2, 'must be a boolean'),
        ('trust_remote_code', ['true'], 'must be a boolean'),
        # A text where a list belongs would be a word per character.
        ('extra_args', '--enforce-eager', 'must be a list'),
        ('cluster_args', '--headless', 'must be a list'),
        ('allowed_media_domains', 'cdn.example.org', 'must be a list'),
        ('entrypoint', '/opt/vllm/bin/vllm serve', 'must be a list'),
        ('entrypoint', [], 'not empty'),
        ('extra_args', None, 'must be a list'),
        ('cluster_args', {'--nnodes': 2}, 'must be a list'),
        ('extra_args', ['--max-num-seqs', None], 'texts or numbers'),
        ('extra_args', ['--enforce-eager', True], 'texts or numbers'),
        ('allowed_media_domains', [['cdn.example.org']], 'texts or numbers'),
        ('model', None, 'must be a text'),
        ('model', '', 'not empty'),
        ('host', ['127.0.0.1'], 'must be a text'),
        ('kv_cache_dtype', None, 'must be a text'),
        ('tool_call_parser', {'name': 'kimi_k2'}, 'must be a text'),
        ('multimodal', ['text_only'], 'must be a text'),
        ('multimodal', 'text-only', 'must be one of encoder_data_parallel, encoder_tensor_parallel, text_only'),
        ('port', None, 'whole number'),
        ('port', True, 'whole number'),
        ('port', 8000.5, 'whole number'),
        ('port', '8000.0', 'whole number'),
        ('port', '-1', 'whole number'),
        ('uds', 'run/vllm.sock', 'an absolute path, or empty'),
        ('uds', ['/run/vllm.sock'], 'must be a text'),
        ('tensor_parallel_size', 'eight', 'whole number'),
        ('max_model_len', 'auto', 'whole number'),
        ('kv_cache_memory_bytes', '8G', 'whole number'),
        ('flags', {'--shutdown-timeout': [120]}, 'a mapping of long options'),
        ('flags', {'--shutdown-timeout': float('inf')}, 'a mapping of long options'),
        ('flags', {'--shutdown timeout': 120}, 'a mapping of long options'),
        ('flags', {'--shutdown-timeout\n--api-key': 'x'}, 'a mapping of long options'),
        ('flags', {None: 120}, 'a mapping of long options'),
        ('flags', '--shutdown-timeout 120', 'a mapping of long options'),
        ('gpu_memory_utilization', None, 'a number'),
        ('gpu_memory_utilization', 'nan', 'a number'),
        ('gpu_memory_utilization', float('inf'), 'a number'),
        ('gpu_memory_utilization', False, 'a number'),
        ('limit_mm_per_prompt', [['image', 8]], 'a mapping'),
        ('limit_mm_per_prompt', None, 'a mapping'),
        ('limit_mm_per_prompt', {'image': 'eight'}, 'a mapping'),
        ('limit_mm_per_prompt', {'image': True}, 'a mapping'),
        ('limit_mm_per_prompt', {'image': 8, 1: 2}, 'a mapping'),
        ('limit_mm_per_prompt', {'image': {'count': float('nan')}}, 'no JSON'),
        ('limit_mm_per_prompt', {'image': {'count': {1, 2}}}, 'no JSON'),
    ],
)
def test_vllm_serve_argv_refuses_a_value_of_the_wrong_type(verdict, key, value, cause):
    refused(verdict, 'vllm_serve_argv', serve_argv(**{key: value}), key, cause, repr(value))


@pytest.mark.parametrize(
    'changes, check',
    [
        ({'port': '8001'}, has_run('--port', '8001')),
        ({'max_model_len': ' 65536 '}, has_run('--max-model-len', '65536')),
        ({'gpu_memory_utilization': '0.9'}, has_run('--gpu-memory-utilization', '0.9')),
        ({'gpu_memory_utilization': 1}, has_run('--gpu-memory-utilization', '1')),
        ({'kv_cache_memory_bytes': None}, lacks('--kv-cache-memory-bytes')),
        ({'kv_cache_memory_bytes': '1048576'}, has_run('--kv-cache-memory-bytes', '1048576')),
        ({'flags': {'--shutdown-timeout': ''}}, lacks('--shutdown-timeout')),
        ({'flags': {'--shutdown-timeout': '60'}}, has_run('--shutdown-timeout', '60')),
        ({'tool_call_parser': None, 'flags': {'--reasoning-parser': None}}, lacks('--enable-auto-tool-choice')),
        ({'multimodal': None}, lacks('--mm-encoder-tp-mode')),
        ({'extra_args': ('--max-num-seqs', 64, '--swap-space', 0.5)}, has_run('--max-num-seqs', '64', '--swap-space')),
        (
            {'limit_mm_per_prompt': {'image': {'count': 2, 'width': 512}}},
            has_run('--limit-mm-per-prompt', json.dumps({'image': {'count': 2, 'width': 512}})),
        ),
    ],
    ids=lambda value: None if callable(value) else repr(value),
)
def test_vllm_serve_argv_reads_every_good_form(verdict, changes, check):
    answered(verdict, 'vllm_serve_argv', serve_argv(**changes), check)


def test_vllm_serve_argv_names_unknown_settings_of_any_type(verdict):
    settings = dict(SETTINGS, **{'max_num_seqs': 8})
    settings[1] = 'one'
    refused(verdict, 'vllm_serve_argv', lambda: vllm_serve_argv(settings), 'unknown 1, max_num_seqs')


@pytest.mark.parametrize(
    'argv',
    [['--max-num-seqs', None], ['--max-num-seqs', ['64']], ['--max-num-seqs', True]],
    ids=['none', 'a list', 'a boolean'],
)
def test_vllm_flag_value_refuses_words_that_are_no_text(verdict, argv):
    refused(verdict, 'vllm_flag_value', lambda: vllm_flag_value(argv, '--max-num-seqs'), 'texts or numbers')


@pytest.mark.parametrize(
    'spec, expected',
    [
        ('vllm==0.33.*', ''),
        ('vllm == 0.33.*', ''),
        ('vllm===0.33.*', ''),
        ('vllm==0.*; python_version >= "3.10"', ''),
        ('vllm==0.33.0)', ''),
        ('vllm==0.33.0+cu129', '0.33.0+cu129'),
        ('vllm[audio]==0.33.0', '0.33.0'),
    ],
)
def test_pinned_version_calls_only_one_release_pinned(verdict, spec, expected):
    answered(verdict, 'pinned_version', lambda: pinned_version(spec), lambda version: version == expected)


@pytest.mark.parametrize('spec', [None, ['vllm==0.33.0'], 0.33], ids=['none', 'a list', 'a number'])
def test_pinned_version_refuses_what_is_no_requirement(verdict, spec):
    refused(verdict, 'pinned_version', lambda: pinned_version(spec), 'a text', repr(spec))


SECRET = 'zq7secret'


@pytest.mark.parametrize(
    'sources, where',
    [
        ({'args': ['--index-url', 'https://me:%s"x@pypi.example/simple' % SECRET]}, 'args[1] has'),
        ({'args': ["--index-url=https://me:it's-%s@pypi.example/simple" % SECRET]}, 'args[0] has'),
        ({'spec': 'vllm @ https://%s<x>@files.example/vllm.whl' % SECRET}, 'spec has'),
        (
            {'lock': 'six==1.16\n--extra-index-url "https://tok:%s"q@pypi.example/simple"\n' % SECRET},
            'lock, line 2 has',
        ),
        ({'args': ['-i', 'https://me:%s@x@pypi.example/simple' % SECRET]}, 'args[1] has'),
        # urlsplit, as pip calls it, reads host "user" and the password as the path: it was no credential to the
        # filter, and went into the release's record.
        ({'args': ['-i', 'https://user:pa/%s@pypi.example/simple' % SECRET]}, 'args[1] has'),
        ({'lock': '--index-url https://user:a/b/%s@pypi.example/simple\n' % SECRET}, 'lock has'),
    ],
    ids=['double quote', 'single quote', 'brackets', 'quoted in a lock', 'an at sign', 'a slash', 'two slashes'],
)
def test_a_password_with_quotes_brackets_or_slashes_is_found_and_masked(verdict, sources, where):
    # pip takes the user information up to the netloc's last "@", quotes and brackets included.
    answered(
        verdict,
        'pip_source_credentials',
        lambda: pip_source_credentials(sources),
        lambda message: where + ' https://****@' in message,
        secrets=(SECRET,),
    )


@pytest.mark.parametrize(
    'host, port, cause',
    [
        ('gpu-01.example.org:8000', 8443, 'a host name or a bare IP address'),
        ('127.0.0.1:80', 8443, 'a host name or a bare IP address'),
        ('admin@gpu-01.example.org', 8443, 'a host name or a bare IP address'),
        ('gpu-01.example.org/v1', 8443, 'a host name or a bare IP address'),
        ('gpu-01.example.org?x=1', 8443, 'a host name or a bare IP address'),
        ('gpu-01#x', 8443, 'a host name or a bare IP address'),
        ('fe80::1%eth0', 8443, 'a host name or a bare IP address'),
        ('not:an:address', 8443, 'a host name or a bare IP address'),
        (None, 8443, 'a host name or a bare IP address'),
        (['10.0.0.1'], 8443, 'a host name or a bare IP address'),
        ('10.0.0.1', 8443.9, 'a port number'),
        ('10.0.0.1', True, 'a port number'),
        ('10.0.0.1', None, 'a port number'),
        ('10.0.0.1', '0x20fb', 'a port number'),
    ],
)
def test_host_port_refuses_what_is_no_bare_host_or_port(verdict, host, port, cause):
    value = repr(port) if cause == 'a port number' else repr(host)
    refused(verdict, 'host_port', lambda: host_port(host, port), cause, value)


@pytest.mark.parametrize(
    'port, cause',
    [
        # int() of more digits than Python converts raised ValueError: a traceback.
        ('9' * 5000, "a port number, got '9999"),
        (' ' + '0' * 5000 + '8443', "a port number, got ' 0000"),
        # Writing the integer in a message raised the same.
        (10**5000, 'a port from 1 to 65535, got a value holding an integer of more digits than Python writes'),
        ('99999', 'a port from 1 to 65535, got 99999'),
    ],
    ids=['5,000 digits', 'zeros before a port', 'an integer of 5,000 digits', 'five digits above the range'],
)
def test_host_port_bounds_the_digits_of_a_port(verdict, port, cause):
    refused(verdict, 'host_port', lambda: host_port('10.0.0.1', port), cause)


@pytest.mark.parametrize(
    'host, port, expected',
    [
        ('gpu-01.example.org', ' 8443 ', 'gpu-01.example.org:8443'),
        ('10.0.0.1', 8443, '10.0.0.1:8443'),
        ('::ffff:10.0.0.1', 8443, '[::ffff:10.0.0.1]:8443'),
        ('fd00::12', '65535', '[fd00::12]:65535'),
    ],
)
def test_host_port_joins_a_bare_host_and_a_port(verdict, host, port, expected):
    answered(verdict, 'host_port', lambda: host_port(host, port), lambda joined: joined == expected)


@pytest.mark.parametrize(
    'argv, cause',
    [
        ([], 'a program and its arguments'),
        (['+/bin/sh', '-c', 'id'], 'a prefix'),
        (['-/usr/bin/vllm'], 'a prefix'),
        (['@/usr/bin/vllm', 'vllm'], 'a prefix'),
        (['!/usr/bin/vllm'], 'a prefix'),
        (['!!/usr/bin/vllm'], 'a prefix'),
        ([':/usr/bin/vllm'], 'a prefix'),
        ([''], 'not empty'),
        ([None, 'serve'], 'texts or numbers'),
        (['/usr/bin/vllm', None], 'texts or numbers'),
        (['/usr/bin/vllm', False], 'texts or numbers'),
        (['/usr/bin/vllm', ['serve']], 'texts or numbers'),
        (['/usr/bin/vllm', 'a\0b'], 'a NUL'),
    ],
)
def test_systemd_exec_quote_refuses_what_systemd_would_misread(verdict, argv, cause):
    parts = (cause, repr(argv[0])) if argv and cause == 'a prefix' else (cause,)
    refused(verdict, 'systemd_exec_quote', lambda: systemd_exec_quote(argv), *parts)


@pytest.mark.parametrize(
    'argv, parts',
    [
        (['/usr/bin/vllm', '--api-key', 'sk-zq7\n'], ('the argument at position 2 contains a line break',)),
        (['/usr/bin/vllm', '--api-key', 'sk-zq7\r'], ('the argument at position 2 contains a line break',)),
        (['/usr/bin/vllm', '--api-key=sk-zq7\0'], ('the argument at position 1 contains a NUL',)),
        ('/usr/bin/vllm --api-key sk-zq7', ('expects a list of arguments, got str',)),
    ],
    ids=['a line break', 'a carriage return', 'a NUL', 'a command line as one text'],
)
def test_systemd_exec_quote_refuses_without_quoting_the_argument(verdict, argv, parts):
    # The refusal quoted the argument, and with it the key after --api-key, into Ansible's output.
    refused(verdict, 'systemd_exec_quote', lambda: systemd_exec_quote(argv), *parts, secrets=('zq7',))


def test_systemd_exec_quote_keeps_a_dash_after_the_program(verdict):
    answered(
        verdict,
        'systemd_exec_quote',
        lambda: systemd_exec_quote(['/usr/bin/vllm', '-', '+x', '@y']),
        lambda line: line == '"/usr/bin/vllm" "-" "+x" "@y"',
    )


@pytest.mark.parametrize(
    'value, cause',
    [(None, 'NoneType'), (['sk-zq7'], 'list'), (True, 'bool'), ('sk-zq7\0tail', 'a NUL')],
    ids=['none', 'a list', 'a boolean', 'a NUL'],
)
def test_systemd_env_quote_refuses_without_quoting_the_value(verdict, value, cause):
    refused(verdict, 'systemd_env_quote', lambda: systemd_env_quote(value), cause, secrets=('zq7',))


def smoke_journal(*checks):
    return 'starting\n%s\n' % json.dumps({'backend': 'cuda', 'ranks': 8, 'checks': list(checks)})


@pytest.mark.parametrize(
    'journal, check',
    [
        (
            smoke_journal({'name': 'nccl', 'status': 'passed', 'seconds': 10**400}),
            lambda report: 'nccl: passed' in report['figures'],
        ),
        (
            smoke_journal({'name': 'nccl', 'status': 'failed', 'cause': 42, 'remedy': ['reboot']}),
            lambda report: report['failure'] == "nccl failed: 42. Remedy: ['reboot']." and not report['passed'],
        ),
    ],
    ids=['seconds beyond a float', 'cause and remedy no text'],
)
def test_preload_smoke_report_reads_a_report_of_odd_types(verdict, journal, check):
    answered(verdict, 'preload_smoke_report', lambda: preload_smoke_report(journal), check)


def test_preload_smoke_report_refuses_a_line_nested_past_the_parser(verdict):
    journal = '{"checks": %s%s}' % ('[' * 100000, ']' * 100000)
    refused(verdict, 'preload_smoke_report', lambda: preload_smoke_report(journal), 'printed no report')


ROOTS_FILE = {'path': '/m/config.json', 'uid': 0, 'gid': 0, 'islnk': False, 'wgrp': False, 'woth': False}


@pytest.mark.parametrize(
    'entries, parts',
    [
        ('/m', ('expects a list of stat or find results, got str',)),
        ({'files': []}, ('expects a list of stat or find results, got dict',)),
        (None, ('got NoneType',)),
        ([ROOTS_FILE, None], ('entry 1 is not a stat or find result (no path, uid, gid, islnk, wgrp, woth)',)),
        # A stat of a path that does not exist: {'exists': false}.
        ([{'exists': False}], ('entry 0 is not a stat or find result (no path, uid, gid, islnk, wgrp, woth)',)),
    ],
    ids=['a text', 'the whole find result', 'nothing', 'an entry that is nothing', 'a missing path'],
)
def test_checkpoint_writers_refuses_what_is_no_list_of_entries(verdict, entries, parts):
    refused(verdict, 'checkpoint_writers', lambda: checkpoint_writers(entries), *parts)


@pytest.mark.parametrize(
    'entry, expected',
    [
        (dict(ROOTS_FILE), []),
        # Ansible's find gives the owner's name where it has one; a uid without a name is still another user.
        (dict(ROOTS_FILE, uid=4242, pw_name=''), ['/m/config.json is owned by uid 4242']),
        (dict(ROOTS_FILE, islnk=True, uid=0), ['/m/config.json is a symbolic link']),
        (dict(ROOTS_FILE, path='/m/a\nb', woth=True), ['/m/a\nb is writable by every user']),
    ],
    ids=['root alone', 'a uid with no name', "root's link", 'a name with a line break'],
)
def test_checkpoint_writers_names_each_entry_another_user_could_change(verdict, entry, expected):
    answered(verdict, 'checkpoint_writers', lambda: checkpoint_writers([entry]), lambda answer: answer == expected)


# The vllm_kimi role's defaults that api_endpoints reads.
KIMI_DEFAULTS = {
    'vllm_kimi_front_door': True,
    'vllm_kimi_front_port': 8443,
    'vllm_kimi_port': 8000,
    'vllm_kimi_cluster_group': '',
    'vllm_kimi_service_name': 'vllm-kimi',
}


def endpoints_of(host_vars, groups=None, hosts=('gpu-01',)):
    """api_endpoints of hosts (gpu-01 alone by default), each with host_vars, under the role's defaults."""
    hostvars = {host: dict(host_vars) for host in hosts}
    return lambda: api_endpoints(list(hosts), hostvars, groups or {'vllm': list(hosts)}, KIMI_DEFAULTS)


def address_is(address, scheme):
    return lambda endpoints: [(entry['address'], entry['scheme']) for entry in endpoints] == [(address, scheme)]


@pytest.mark.parametrize(
    'host_vars, check',
    [
        # An INI inventory and -e give the text "false", which the role reads with | bool as off: the filter took
        # the text as on, and Prometheus and HAProxy met a front door that was never set up.
        ({'vllm_kimi_front_door': 'false'}, address_is('gpu-01:8000', 'http')),
        ({'vllm_kimi_front_door': 'False'}, address_is('gpu-01:8000', 'http')),
        ({'vllm_kimi_front_door': ' no '}, address_is('gpu-01:8000', 'http')),
        ({'vllm_kimi_front_door': '0'}, address_is('gpu-01:8000', 'http')),
        ({'vllm_kimi_front_door': 0}, address_is('gpu-01:8000', 'http')),
        ({'vllm_kimi_front_door': 'yes'}, address_is('gpu-01:8443', 'https')),
        ({'vllm_kimi_front_door': 'on', 'vllm_kimi_port': '8001'}, address_is('gpu-01:8443', 'https')),
        ({'vllm_kimi_front_door': 'off', 'vllm_kimi_port': '8001'}, address_is('gpu-01:8001', 'http')),
        # A URL without a port is https's 443, which a server line and a scrape target need written out.
        ({'vllm_kimi_front_url': 'https://kimi.example.org'}, address_is('kimi.example.org:443', 'https')),
        ({'vllm_kimi_front_url': 'https://[fd00::7]:9443/'}, address_is('[fd00::7]:9443', 'https')),
    ],
    ids=[
        'the text false',
        'False',
        'no, with spaces',
        'the text 0',
        'the number 0',
        'yes',
        'on',
        'off',
        'a URL without a port',
        'an IPv6 URL',
    ],
)
def test_api_endpoints_reads_the_inventorys_values_as_the_role_does(verdict, host_vars, check):
    answered(verdict, 'api_endpoints', endpoints_of(host_vars), check)


@pytest.mark.parametrize(
    'host_vars, parts',
    [
        # The password went into haproxy.cfg's server line and Prometheus's targets.
        (
            {'vllm_kimi_front_url': 'https://ops:zq7pass@kimi.example.org:8443'},
            ('gpu-01 has vllm_kimi_front_url (not shown: it holds an @)', 'user information (user:password@)'),
        ),
        (
            {'vllm_kimi_front_url': 'https://zq7token@kimi.example.org'},
            ('(not shown: it holds an @)', 'user information'),
        ),
        (
            {'vllm_kimi_front_url': 'ops:zq7pass@kimi.example.org:8443'},
            ('(not shown: it holds an @)', 'no https:// URL of a host'),
        ),
        # An unparsable URL gave an empty address, or a traceback.
        ({'vllm_kimi_front_url': 'https://[fd00::7:8443'}, ("'https://[fd00::7:8443'", 'which is no URL')),
        ({'vllm_kimi_front_url': 'https://kimi.example.org:99999'}, ('which is no URL', 'out of range')),
        ({'vllm_kimi_front_url': 'https://kimi.example.org:https'}, ('which is no URL',)),
        ({'vllm_kimi_front_url': 'kimi.example.org:8443'}, ('no https:// URL of a host',)),
        ({'vllm_kimi_front_url': 'https:///v1'}, ('no https:// URL of a host',)),
        ({'vllm_kimi_front_url': ['https://kimi.example.org']}, ('vllm_kimi_front_url of type list',)),
        ({'vllm_kimi_front_port': 99999}, ('gpu-01 (ansible_host, vllm_kimi_front_port)', 'from 1 to 65535')),
        (
            {'vllm_kimi_front_door': 'false', 'vllm_kimi_port': '99999'},
            ('gpu-01 (ansible_host, vllm_kimi_port)', 'from 1 to 65535'),
        ),
        ({'vllm_kimi_front_door': 'maybe'}, ("vllm_kimi_front_door 'maybe', which is no boolean",)),
        ({'vllm_kimi_front_door': None}, ('vllm_kimi_front_door', 'which is no boolean')),
        ({'vllm_kimi_cluster_group': ['mn']}, ('vllm_kimi_cluster_group of type list',)),
        ({'ansible_host': None}, ('a host name or a bare IP address',)),
    ],
    ids=[
        'user and password',
        'a token as the user',
        'credentials without a scheme',
        'an open bracket',
        'port 99999',
        'a port that is a word',
        'no scheme',
        'no host',
        'a list',
        'front port 99999',
        'vllm port 99999',
        'a boolean that is none',
        'none for a boolean',
        'a list for a group',
        'no ansible_host',
    ],
)
def test_api_endpoints_refuses_what_is_no_address_without_showing_a_credential(verdict, host_vars, parts):
    refused(verdict, 'api_endpoints', endpoints_of(host_vars), *parts, secrets=('zq7',))


@pytest.mark.parametrize(
    'hosts, hostvars, groups, parts',
    [
        # groups[cluster][0] of an empty group raised IndexError: a traceback.
        (
            ['a'],
            {'a': {'vllm_kimi_cluster_group': 'mn'}},
            {'mn': []},
            ('a names vllm_kimi_cluster_group mn', 'no host'),
        ),
        (
            ['a'],
            {'a': {'vllm_kimi_cluster_group': 'mn'}},
            {'mn': 'a'},
            ('a names vllm_kimi_cluster_group mn', 'no host'),
        ),
        (['a'], {}, {}, ("'a' is no host of the inventory",)),
        ('a', {'a': {}}, {}, ('expects a list of hosts, got str',)),
        (['a'], [{'a': {}}], {}, ('expects hostvars to be a mapping, got list',)),
        (['a'], {'a': {}}, None, ('expects groups to be a mapping, got NoneType',)),
    ],
    ids=[
        'an empty group',
        'a group that is a text',
        'a host without variables',
        'a text for the hosts',
        'a list',
        'none',
    ],
)
def test_api_endpoints_refuses_inputs_of_the_wrong_shape(verdict, hosts, hostvars, groups, parts):
    refused(verdict, 'api_endpoints', lambda: api_endpoints(hosts, hostvars, groups, KIMI_DEFAULTS), *parts)


HUGE = 10**5000


@pytest.mark.parametrize(
    'filter_name, call, parts',
    [
        # str() and repr() of an integer of more digits than Python writes raise ValueError: each refusal that wrote
        # the value, and each quoting that wrote the word, ended in a traceback.
        ('systemd_exec_quote', lambda: systemd_exec_quote(['/usr/bin/vllm', HUGE]), ('texts or numbers', 'position 1')),
        ('systemd_env_quote', lambda: systemd_env_quote(HUGE), ('a text or a number, got int',)),
        ('vllm_serve_argv', serve_argv(port=HUGE), ('port', 'more digits than Python writes')),
        ('vllm_serve_argv', serve_argv(extra_args=['--max-num-seqs', HUGE]), ('texts or numbers',)),
        ('vllm_serve_argv', serve_argv(trust_remote_code=HUGE), ('trust_remote_code must be a boolean',)),
        ('vllm_serve_argv', serve_argv(gpu_memory_utilization=HUGE), ('gpu_memory_utilization must be a number',)),
        ('api_endpoints', endpoints_of({'vllm_kimi_front_door': HUGE}), ('vllm_kimi_front_door', 'no boolean')),
        ('vllm_flag_value', lambda: vllm_flag_value([HUGE], '--max-num-seqs'), ('texts or numbers',)),
        ('vllm_flag_value', lambda: vllm_flag_value([], HUGE), ('a long option',)),
        ('pinned_version', lambda: pinned_version(HUGE), ('a text, got a value holding an integer',)),
        ('vllm_serve_argv', lambda: vllm_serve_argv([HUGE]), ('a mapping of settings',)),
        ('vllm_serve_argv', lambda: vllm_serve_argv('x' * 100000), ('a mapping of settings', '(100002 characters)')),
        # int(inf) raised OverflowError.
        ('cpu_threads_bind', lambda: cpu_threads_bind('0-3', float('inf')), ('cpu_threads_bind',)),
    ],
    ids=[
        'exec argument',
        'environment value',
        'port',
        'extra argument',
        'a boolean',
        'a fraction',
        'the front door',
        'an argument',
        'the flag',
        'a requirement',
        'in a list',
        'a long text',
        'ranks of infinity',
    ],
)
def test_huge_values_are_refused_without_writing_them_out(verdict, filter_name, call, parts):
    refused(verdict, filter_name, call, *parts)
