# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Where each replica of a vLLM group serves its API: the one answer that Prometheus's targets and the load balancer's
servers both read."""

from collections.abc import Mapping
from urllib.parse import urlsplit

from ansible.errors import AnsibleFilterError
from ansible.module_utils.parsing.convert_bool import boolean

from ansible_collections.llmserve.vllm.plugins.filter.network import host_port
from ansible_collections.llmserve.vllm.plugins.module_utils._shown import shown

# The port of an https:// URL that names none.
_HTTPS_PORT = 443


def _setting(host, host_vars, defaults, name):
    """The host's inventory value, else the vllm_kimi role's default."""
    if name in host_vars:
        return host_vars[name]
    if name not in defaults:
        raise AnsibleFilterError('api_endpoints: %s has no %s, and the defaults given lack it' % (host, name))
    return defaults[name]


def _front_door(host, host_vars, defaults):
    """vllm_kimi_front_door as the role reads it (| bool): INI inventories and -e give it as the text 'false'."""
    value = _setting(host, host_vars, defaults, 'vllm_kimi_front_door')
    try:
        return boolean(value, strict=True)
    except (TypeError, ValueError):  # ValueError: its own message could not write an integer of 5,000 digits
        raise AnsibleFilterError(
            'api_endpoints: %s has vllm_kimi_front_door %s, which is no boolean: true or false (or yes, no, on, off, '
            '1, 0)' % (host, shown(value))
        ) from None


def _front_url_address(host, url):
    """host:port of the front door's URL. The URL is refused where it carries credentials (they would be written into
    haproxy.cfg and Prometheus's targets), is no https:// URL of a host, or names a port out of range. A refusal
    never quotes a URL that holds an @: what comes before it may be a password."""
    if not isinstance(url, str):
        raise AnsibleFilterError(
            'api_endpoints: %s has vllm_kimi_front_url of type %s, which is no URL' % (host, type(url).__name__)
        )
    quoted = '(not shown: it holds an @)' if '@' in url else shown(url)
    refusal = 'api_endpoints: %s has vllm_kimi_front_url %s, %%s' % (host, quoted)
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise AnsibleFilterError(refusal % ('which is no URL (%s)' % exc)) from None
    if parts.username is not None or '@' in parts.netloc:
        raise AnsibleFilterError(
            refusal % "with user information (user:password@), which would be written into the load balancer's and "
            "Prometheus's settings: give the URL without it"
        )
    if parts.scheme.lower() != 'https' or not parts.hostname:
        raise AnsibleFilterError(refusal % 'which is no https:// URL of a host')
    try:
        return host_port(parts.hostname, port or _HTTPS_PORT)
    except AnsibleFilterError as exc:
        raise AnsibleFilterError(refusal % ('whose host is no bare host name (%s)' % exc)) from None


def _api_endpoint(host, host_vars, defaults):
    """(scheme, host:port) where the host's API is reached."""
    address = host_vars.get('ansible_host', host)
    if not _front_door(host, host_vars, defaults):
        port_name = 'vllm_kimi_port'
    elif 'vllm_kimi_front_url' in host_vars:
        return 'https', _front_url_address(host, host_vars['vllm_kimi_front_url'])
    else:
        # vLLM listens on loopback behind its front door: clients, Prometheus and a load balancer meet the door.
        port_name = 'vllm_kimi_front_port'
    try:
        joined = host_port(address, _setting(host, host_vars, defaults, port_name))
    except AnsibleFilterError as exc:
        raise AnsibleFilterError('api_endpoints: %s (ansible_host, %s): %s' % (host, port_name, exc)) from None
    return 'http' if port_name == 'vllm_kimi_port' else 'https', joined


def _head_of(host, cluster, groups):
    """The head of the host's cluster group: its first host."""
    members = groups.get(cluster)
    if members is None:
        raise AnsibleFilterError('%s names vllm_kimi_cluster_group %s, which the inventory lacks' % (host, cluster))
    if isinstance(members, str) or not isinstance(members, (list, tuple)) or not members:
        raise AnsibleFilterError(
            'api_endpoints: %s names vllm_kimi_cluster_group %s, which holds no host: its first host is the head that '
            'serves the API' % (host, cluster)
        )
    return members[0]


def _check_inputs(hosts, hostvars, groups, defaults):
    if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)):
        raise AnsibleFilterError('api_endpoints expects a list of hosts, got %s' % type(hosts).__name__)
    for name, value in (('hostvars', hostvars), ('groups', groups), ('defaults', defaults)):
        if not isinstance(value, Mapping):
            raise AnsibleFilterError('api_endpoints expects %s to be a mapping, got %s' % (name, type(value).__name__))


def api_endpoints(hosts, hostvars, groups, defaults):
    """One entry per host that serves the API, in the order of hosts.

    The headless nodes of a multi-node model (every host of its vllm_kimi_cluster_group but the first, the head, as
    vllm_kimi decides) serve none and are left out.
    """
    _check_inputs(hosts, hostvars, groups, defaults)
    endpoints = []
    for host in hosts:
        if host not in hostvars or not isinstance(hostvars[host], Mapping):
            raise AnsibleFilterError('api_endpoints: %s is no host of the inventory' % shown(host))
        host_vars = hostvars[host]
        cluster = _setting(host, host_vars, defaults, 'vllm_kimi_cluster_group')
        if cluster is not None and not isinstance(cluster, str):
            raise AnsibleFilterError(
                'api_endpoints: %s has vllm_kimi_cluster_group of type %s, which is no group name'
                % (host, type(cluster).__name__)
            )
        if cluster and _head_of(host, cluster, groups) != host:
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
                'service': _setting(host, host_vars, defaults, 'vllm_kimi_service_name'),
            }
        )
    return endpoints


class FilterModule:
    def filters(self):
        return {'api_endpoints': api_endpoints}
