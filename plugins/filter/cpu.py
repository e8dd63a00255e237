# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.module_utils._cpu_binding import (
    CpuListError,
    parse_cpu_list,
    threads_bind,
)


def cpu_threads_bind(cpu_list, ranks, source='the CPU list'):
    try:
        return threads_bind(parse_cpu_list(cpu_list), int(ranks))
    except (CpuListError, TypeError, ValueError, OverflowError) as exc:
        raise AnsibleFilterError('cpu_threads_bind: %s, from %s' % (exc, source)) from None


class FilterModule:
    def filters(self):
        return {'cpu_threads_bind': cpu_threads_bind}
