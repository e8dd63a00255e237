# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Properties of the collection's filters over generated input.

Whatever a filter is handed, it answers or raises AnsibleFilterError naming itself, nothing else; what it answers
reads back as it was meant: systemd and pip would read the quoted words, the joined address and the URL's
credentials as the filter did.
"""

import ipaddress
import json
import re
from urllib.parse import urlsplit

import pytest
from ansible.errors import AnsibleFilterError
from ansible.module_utils.parsing.convert_bool import BOOLEANS_TRUE
from hypothesis import given, settings
from hypothesis import strategies as st

from ansible_collections.llmserve.vllm.plugins.filter.network import host_port
from ansible_collections.llmserve.vllm.plugins.filter.pip import pip_source_credentials
from ansible_collections.llmserve.vllm.plugins.filter.systemd import systemd_env_quote, systemd_exec_quote
from ansible_collections.llmserve.vllm.plugins.filter.vllm import (
    pinned_version,
    preload_smoke_report,
    vllm_flag_value,
    vllm_serve_argv,
)
from ansible_collections.llmserve.vllm.tests.adversarial.test_filters import SETTINGS

pytestmark = pytest.mark.adversarial

QUICK = settings(max_examples=100, deadline=None, derandomize=True, database=None)

# What Ansible may hand a filter: YAML's and JSON's values, -e's texts.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(['true', 'false', 'no', ' On ', '1', '0', '', '8000', '0.9', 'auto', 'text_only'])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
WORDS = st.text(max_size=12) | st.integers(0, 10**6) | st.floats(allow_nan=False, allow_infinity=False)


def answer_or_refusal(call, filter_name):
    """call()'s answer, or None where it refused with a message naming the filter; any other exception escapes."""
    try:
        return call()
    except AnsibleFilterError as error:
        assert str(error).startswith(filter_name), str(error)
        return None


@QUICK
@given(key=st.sampled_from(sorted(SETTINGS)), value=VALUES)
def test_vllm_serve_argv_answers_words_or_names_the_setting(key, value):
    try:
        argv = vllm_serve_argv(dict(SETTINGS, **{key: value}))
    except AnsibleFilterError as error:
        assert str(error).startswith('vllm_serve_argv: %s ' % key), str(error)
        return
    assert all(isinstance(word, str) for word in argv)
    if key == 'trust_remote_code':
        expected = value in BOOLEANS_TRUE or (isinstance(value, str) and value.lower().strip() in BOOLEANS_TRUE)
        assert ('--trust-remote-code' in argv) == expected
    if key in ('extra_args', 'cluster_args'):
        # A list's words are appended as they are, one argument each, the cluster's before the extra ones.
        tail = list(value) + ([] if key == 'extra_args' else SETTINGS['extra_args'])
        assert argv[len(argv) - len(tail) :] == [str(word) for word in tail]


@QUICK
@given(argv=VALUES | st.lists(WORDS | VALUES, max_size=4), flag=st.just('--max-num-seqs') | VALUES)
def test_vllm_flag_value_answers_a_text_or_refuses(argv, flag):
    value = answer_or_refusal(lambda: vllm_flag_value(argv, flag), 'vllm_flag_value')
    if value is not None:
        # An answer comes only from arguments that are texts or numbers, never None or True spelt out.
        assert isinstance(value, str)
        assert all(isinstance(word, (str, int, float)) and not isinstance(word, bool) for word in argv)


@QUICK
@given(spec=VALUES | st.from_regex(r'[a-z]{1,6}\s?={2,3}\s?[0-9][0-9*.a-z+!-]{0,9}(;.*)?', fullmatch=True))
def test_pinned_version_answers_a_release_of_the_spec_or_nothing(spec):
    version = answer_or_refusal(lambda: pinned_version(spec), 'pinned_version')
    if version is not None:
        assert isinstance(spec, str), 'only a text is a requirement'
    if version:
        assert re.fullmatch(r'[0-9][A-Za-z0-9.!+_-]*', version), version
        assert re.search(r'===?\s*' + re.escape(version) + r'\s*(;|$)', spec), (spec, version)


HOST_NAMES = st.from_regex(r'[a-z0-9][a-z0-9.-]{0,20}', fullmatch=True)
ADDRESSES = st.ip_addresses().map(str)


@QUICK
@given(host=VALUES | HOST_NAMES | ADDRESSES, port=VALUES | st.integers(-5, 70000))
def test_host_port_answers_an_address_that_reads_back(host, port):
    joined = answer_or_refusal(lambda: host_port(host, port), 'host_port')
    if joined is None:
        return
    parts = urlsplit('https://%s/' % joined)
    # A URL reads back the host and the port, and nothing else: no user information, path or query.
    assert parts.hostname == host.strip().lower()
    assert parts.port == int(port)
    assert parts.netloc == joined and parts.path == '/'
    if ':' in host:
        assert isinstance(ipaddress.ip_address(host.strip()), ipaddress.IPv6Address)


def systemd_words(line):
    """The words systemd reads from the double-quoted words of an ExecStart= line, with $$ and %% restored."""
    words = []
    for quoted in re.findall(r'"((?:[^"\\]|\\.)*)"', line):
        words.append(re.sub(r'\\(.)', r'\1', quoted).replace('$$', '$').replace('%%', '%'))
    return words


@QUICK
@given(argv=st.lists(WORDS | VALUES, max_size=5) | VALUES)
def test_systemd_exec_quote_answers_words_systemd_reads_back(argv):
    line = answer_or_refusal(lambda: systemd_exec_quote(argv), 'systemd_exec_quote')
    if line is None:
        return
    assert argv, 'an empty ExecStart= resets the unit'
    assert not str(argv[0]).startswith(('-', '@', ':', '+', '!', '|'))
    assert '\n' not in line and '\0' not in line
    assert systemd_words(line) == [str(word) for word in argv]


@QUICK
@given(value=WORDS | VALUES)
def test_systemd_env_quote_answers_a_value_systemd_reads_back(value):
    quoted = answer_or_refusal(lambda: systemd_env_quote(value), 'systemd_env_quote')
    if quoted is None:
        return
    assert isinstance(value, (str, int, float)) and not isinstance(value, bool), 'None or True spelt out'
    # An EnvironmentFile= double-quoted value: a backslash keeps the next character.
    assert quoted[0] == quoted[-1] == '"' and '\n' not in quoted
    assert re.sub(r'\\(.)', r'\1', quoted[1:-1]) == str(value)


MARK = 'ZQ9'
# What pip keeps in a password: anything printable up to the path, query or fragment, quotes and angle brackets
# too; a square bracket makes the URL no URL to pip (urlsplit refuses it).
PASSWORDS = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters='/?#@[]'), max_size=10
).map(lambda text: MARK + text + MARK)


@QUICK
@given(password=PASSWORDS, before=st.sampled_from(['', '-i ', '--index-url=', '"', "'", '<']))
def test_pip_source_credentials_finds_every_password_pip_would_send(password, before):
    url = 'https://me:%s@pypi.example/simple' % password
    assert urlsplit(url).password == password
    message = pip_source_credentials({'args': [before + url]})
    assert 'args[0] has https://****@pypi.example/simple' in message
    assert MARK not in message


# Reports of the smoke's shape with any JSON in any field, integers beyond a float's range among them.
ANY_JSON = VALUES | st.integers(min_value=2**1024, max_value=2**1100)
CHECKS = st.fixed_dictionaries(
    {'name': st.text(max_size=6), 'status': st.sampled_from(['passed', 'failed', 'skipped'])},
    optional={
        'seconds': ANY_JSON,
        'detail': ANY_JSON,
        'cause': ANY_JSON,
        'remedy': ANY_JSON,
    },
)
REPORTS = st.fixed_dictionaries(
    {'checks': st.lists(CHECKS | ANY_JSON, max_size=3)},
    optional={'backend': ANY_JSON, 'ranks': ANY_JSON, 'versions': ANY_JSON, 'devices': ANY_JSON, 'passed': ANY_JSON},
)


@QUICK
@given(journal=VALUES | st.text(max_size=200) | REPORTS.map(lambda report: 'starting\n%s\n' % json.dumps(report)))
def test_preload_smoke_report_answers_a_summary_or_refuses(journal):
    report = answer_or_refusal(lambda: preload_smoke_report(journal), 'preload_smoke_report')
    assert report is None or set(report) == {'passed', 'figures', 'failure'}
