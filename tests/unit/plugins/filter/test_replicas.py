# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""api_endpoints: where each replica serves its API, as Prometheus's targets and the load balancer's servers read it.

tests/unit/roles/test_vllm_monitoring.py renders it through a real play (hostvars as Ansible gives them)."""

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.replicas import api_endpoints

DEFAULTS = {
    'vllm_kimi_front_door': True,
    'vllm_kimi_front_port': 8443,
    'vllm_kimi_port': 8000,
    'vllm_kimi_cluster_group': '',
    'vllm_kimi_service_name': 'vllm-kimi',
}


def endpoint(replica, address, scheme='https', cluster='', service='vllm-kimi'):
    host, port = address.rsplit(':', 1)
    return {
        'replica': replica,
        'address': address,
        'host': host.strip('[]'),
        'port': int(port),
        'scheme': scheme,
        'cluster': cluster,
        'service': service,
    }


@pytest.mark.parametrize(
    ('host_vars', 'expected'),
    [
        ({'ansible_host': '10.0.0.1'}, endpoint('a', '10.0.0.1:8443')),
        ({}, endpoint('a', 'a:8443')),
        ({'ansible_host': 'fd00::5', 'vllm_kimi_front_port': 9443}, endpoint('a', '[fd00::5]:9443')),
        (
            {'ansible_host': '10.0.0.1', 'vllm_kimi_front_url': 'https://kimi.example.org:9443'},
            endpoint('a', 'kimi.example.org:9443'),
        ),
        ({'vllm_kimi_front_door': False, 'vllm_kimi_port': 8001}, endpoint('a', 'a:8001', scheme='http')),
        ({'vllm_kimi_service_name': 'vllm-other'}, endpoint('a', 'a:8443', service='vllm-other')),
    ],
    ids=['ansible_host', 'inventory name', 'ipv6 and port', 'front url', 'no front door', 'service'],
)
def test_one_replica_is_reached_at_its_front_door_or_its_port(host_vars, expected):
    assert api_endpoints(['a'], {'a': host_vars}, {'vllm': ['a']}, DEFAULTS) == [expected]


def test_only_the_head_of_a_multi_node_model_serves():
    hostvars = {host: {'vllm_kimi_cluster_group': 'mn'} for host in ('worker', 'head')}
    groups = {'vllm': ['worker', 'head'], 'mn': ['head', 'worker']}
    assert api_endpoints(['worker', 'head'], hostvars, groups, DEFAULTS) == [
        endpoint('head', 'head:8443', cluster='mn')
    ]


def test_a_cluster_group_the_inventory_lacks_is_named():
    with pytest.raises(
        AnsibleFilterError, match='^worker names vllm_kimi_cluster_group mn, which the inventory lacks$'
    ):
        api_endpoints(['worker'], {'worker': {'vllm_kimi_cluster_group': 'mn'}}, {'vllm': ['worker']}, DEFAULTS)
