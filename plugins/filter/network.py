# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.text.converters import to_text


def host_port(host, port):
    text = to_text(host).strip()
    if not text or any(c.isspace() for c in text) or text.startswith('['):
        raise AnsibleFilterError('host_port expects a host name or a bare IP address, got %r' % to_text(host))
    try:
        number = int(port)
    except (TypeError, ValueError):
        raise AnsibleFilterError('host_port expects a port number, got %r' % (port,)) from None
    if not 0 < number < 65536:
        raise AnsibleFilterError('host_port expects a port from 1 to 65535, got %d' % number)
    # An IPv6 address takes brackets, or its last group would read as the port.
    return '%s:%d' % ('[%s]' % text if ':' in text else text, number)


class FilterModule:
    def filters(self):
        return {'host_port': host_port}
