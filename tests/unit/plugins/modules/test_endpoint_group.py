# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The action group llmserve.vllm.endpoint (meta/runtime.yml): module_defaults given once reach every module that
asks a served endpoint."""

import socket

from ansible_collections.llmserve.vllm.tests.support import run_local_play


def closed_port():
    """A loopback port nothing listens on: bound, then let go."""
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return probe.getsockname()[1]


def test_the_groups_defaults_reach_chat_check_and_load_probe(tmp_path):
    url = 'http://127.0.0.1:%d' % closed_port()
    play = [
        {
            'name': 'Ask an endpoint given once for the group',
            'module_defaults': {'group/llmserve.vllm.endpoint': {'url': url, 'model': 'from-the-group'}},
            'block': [
                {'name': 'Gate', 'llmserve.vllm.chat_check': {'timeout': 1}, 'ignore_errors': True},
                {
                    'name': 'Probe',
                    'llmserve.vllm.load_probe': {'duration': 1, 'request_timeout': 1},
                    'ignore_errors': True,
                },
            ],
        }
    ]
    rc, output = run_local_play(tmp_path, play)
    assert rc == 0, output
    gate, probe = output.split('TASK [Gate]', 1)[1].split('TASK [Probe]', 1)
    # Each asked the group's URL, the only place it was given, and failed there (nothing listens).
    assert 'waiting for /health to answer 200 at %s;' % url in gate, gate
    assert 'The load probe of %s failed' % url in probe, probe
