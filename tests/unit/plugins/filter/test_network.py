# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.network import host_port


@pytest.mark.parametrize(
    ('host', 'port', 'expected'),
    [
        ('127.0.0.1', 8000, '127.0.0.1:8000'),
        ('gpu-01.example.org', '8443', 'gpu-01.example.org:8443'),
        ('::1', 8443, '[::1]:8443'),
        ('fd00::12', 65535, '[fd00::12]:65535'),
    ],
)
def test_host_port_joins_with_brackets_for_ipv6(host, port, expected):
    assert host_port(host, port) == expected


@pytest.mark.parametrize(
    ('host', 'port', 'message'),
    [
        ('', 8000, "host_port expects a host name or a bare IP address, got ''"),
        ('[::1]', 8000, "host_port expects a host name or a bare IP address, got '[::1]'"),
        ('a b', 8000, "host_port expects a host name or a bare IP address, got 'a b'"),
        ('::1', 'http', "host_port expects a port number, got 'http'"),
        ('::1', 0, 'host_port expects a port from 1 to 65535, got 0'),
        ('::1', 70000, 'host_port expects a port from 1 to 65535, got 70000'),
    ],
)
def test_host_port_refuses_what_it_cannot_join(host, port, message):
    with pytest.raises(AnsibleFilterError) as error:
        host_port(host, port)
    assert str(error.value) == message
