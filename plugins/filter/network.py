# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import ipaddress
import re

from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.module_utils._shown import shown

# A host name or an IPv4 address: nothing that a URL or nginx's listen would read as a port (:), user information
# (@), a path, a query or a fragment.
_HOST_NAME = re.compile(r'[A-Za-z0-9_][A-Za-z0-9._-]*')
# A port has at most five digits: int() of thousands of them raises (Python's limit on the digits it converts).
_PORT_DIGITS = re.compile(r'\s*[0-9]{1,5}\s*')


def _ipv6_address(text):
    """Whether text is an IPv6 address without a zone (fe80::1%eth0), which a URL would have to encode."""
    try:
        return '%' not in text and isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def host_port(host, port):
    text = host.strip() if isinstance(host, str) else ''
    if not (_HOST_NAME.fullmatch(text) or _ipv6_address(text)):
        raise AnsibleFilterError('host_port expects a host name or a bare IP address, got %s' % shown(host))
    # A number or its digits (-e port=8443 gives a text); a boolean or a fraction is no port.
    if not (
        (isinstance(port, str) and _PORT_DIGITS.fullmatch(port))
        or (isinstance(port, int) and not isinstance(port, bool))
    ):
        raise AnsibleFilterError('host_port expects a port number, got %s' % shown(port))
    number = int(port)
    if not 0 < number < 65536:
        # A port of more digits than Python writes is described, not written.
        raise AnsibleFilterError('host_port expects a port from 1 to 65535, got %s' % shown(number))
    # An IPv6 address takes brackets, or its last group would read as the port.
    return '%s:%d' % ('[%s]' % text if ':' in text else text, number)


class FilterModule:
    def filters(self):
        return {'host_port': host_port}
