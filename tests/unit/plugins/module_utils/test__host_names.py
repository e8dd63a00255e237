# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The certificate's names against the host clients ask for: RFC 6125 as Python's ssl applies it."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.tls._host_names import name_for_host, url_host, wanted_entry

SANS = (['gpu1.example.com', '*.cluster.example.com', 'f*.example.org', '*.com', 'xn--bcher-kva.example'],
        ['192.0.2.10', '2001:db8::1'])  # fmt: skip


@pytest.mark.parametrize(
    'host, expected',
    [
        ('gpu1.example.com', 'DNS:gpu1.example.com'),
        ('GPU1.Example.COM', 'DNS:gpu1.example.com'),
        ('a.cluster.example.com', 'DNS:*.cluster.example.com'),
        ('cluster.example.com', None),
        ('a.b.cluster.example.com', None),
        ('foo.example.org', None),
        ('example.com', None),
        ('gpu2.example.com', None),
        ('bücher.example', 'DNS:xn--bcher-kva.example'),
        ('192.0.2.10', 'IP:192.0.2.10'),
        ('2001:db8:0::1', 'IP:2001:db8::1'),
        ('192.0.2.11', None),
    ],
    ids=[
        'exact',
        'case',
        'wildcard-one-label',
        'wildcard-not-parent',
        'wildcard-not-two-labels',
        'partial-wildcard',
        'wildcard-under-tld',
        'other-host',
        'idna',
        'ipv4',
        'ipv6-normalized',
        'other-address',
    ],  # fmt: skip
)
def test_the_entry_that_names_the_host(host, expected):
    assert name_for_host(host, *SANS) == expected


def test_an_address_is_never_matched_by_a_dns_name():
    assert name_for_host('192.0.2.10', ['192.0.2.10'], []) is None


@pytest.mark.parametrize(
    'url, host, entry',
    [
        ('https://gpu1.example.com:8443', 'gpu1.example.com', 'DNS:gpu1.example.com'),
        ('https://GPU1.example.com.:8443/v1', 'gpu1.example.com', 'DNS:gpu1.example.com'),
        ('https://[2001:db8::1]:8443', '2001:db8::1', 'IP:2001:db8::1'),
        ('https://192.0.2.10', '192.0.2.10', 'IP:192.0.2.10'),
        ('no url', '', 'DNS:'),
    ],
    ids=['name', 'trailing-dot', 'ipv6', 'ipv4', 'none'],
)
def test_the_host_of_a_url_and_the_entry_it_needs(url, host, entry):
    assert url_host(url) == host
    assert wanted_entry(host) == entry
