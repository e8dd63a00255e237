# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Where each replica of a vLLM group serves its API: the one answer that Prometheus's targets and the load balancer's
servers both read."""

from urllib.parse import urlsplit

from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.network import host_port


def _setting(host_vars, defaults, name):
    """The host's inventory value, else the vllm_kimi role's default."""
    return host_vars[name] if name in host_vars else defaults[name]


def _api_endpoint(host, host_vars, defaults):
    address = str(host_vars.get('ansible_host', host))
    if not _setting(host_vars, defaults, 'vllm_kimi_front_door'):
        return 'http', host_port(address, _setting(host_vars, defaults, 'vllm_kimi_port'))
    # vLLM listens on loopback behind its front door: clients, Prometheus and a load balancer meet the door.
    if 'vllm_kimi_front_url' in host_vars:
        return 'https', urlsplit(host_vars['vllm_kimi_front_url']).netloc
    return 'https', host_port(address, _setting(host_vars, defaults, 'vllm_kimi_front_port'))


def api_endpoints(hosts, hostvars, groups, defaults):
    """One entry per host that serves the API, in the order of hosts.

    The headless nodes of a multi-node model (every host of its vllm_kimi_cluster_group but the first, the head, as
    vllm_kimi decides) serve none and are left out.
    """
    endpoints = []
    for host in hosts:
        host_vars = hostvars[host]
        cluster = _setting(host_vars, defaults, 'vllm_kimi_cluster_group')
        if cluster and cluster not in groups:
            raise AnsibleFilterError('%s names vllm_kimi_cluster_group %s, which the inventory lacks' % (host, cluster))
        if cluster and groups[cluster][0] != host:
            continue
        scheme, address = _api_endpoint(host, host_vars, defaults)
        parts = urlsplit('//' + address)
        endpoints.append(
            {
                'replica': host,
                'address': address,
                'host': parts.hostname,
                'port': parts.port,
                'scheme': scheme,
                'cluster': cluster,
                'service': _setting(host_vars, defaults, 'vllm_kimi_service_name'),
            }
        )
    return endpoints


class FilterModule:
    def filters(self):
        return {'api_endpoints': api_endpoints}
