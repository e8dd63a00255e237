# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.cpu import cpu_threads_bind


@pytest.mark.parametrize(
    ('cpus', 'ranks', 'bind'),
    [
        ('0-1', 2, '0|1'),
        ('0-3', 2, '0-1|2-3'),
        ('0-2', 2, '0-1|2'),
        ('0 2 4 6', 2, '0,2|4,6'),
        ('8-11,0-3', 4, '0-1|2-3|8-9|10-11'),
        ('0-47', 1, '0-47'),
    ],
    ids=['sandbox-2-cpus', 'even', 'uneven', 'systemd-spaces', 'unsorted-ranges', 'one-rank'],
)
def test_each_rank_gets_cpus_of_its_own(cpus, ranks, bind):
    assert cpu_threads_bind(cpus, ranks) == bind


@pytest.mark.parametrize(
    ('cpus', 'ranks', 'message'),
    [
        ('0', 2, 'cpu_threads_bind: 1 CPU(s) (0) for 2 ranks: each rank needs one of its own, from AllowedCPUs'),
        (
            '0-x',
            2,
            "cpu_threads_bind: '0-x' is not a CPU list: '0-x' is neither a CPU number nor a range a-b, from AllowedCPUs",
        ),
        (
            '3-1',
            2,
            "cpu_threads_bind: '3-1' is not a CPU list: the range '3-1' is empty or larger than 65536, from AllowedCPUs",
        ),
        ('', 2, "cpu_threads_bind: '' names no CPU, from AllowedCPUs"),
    ],
    ids=['too-few', 'not-a-list', 'empty-range', 'empty'],
)
def test_a_list_that_cannot_bind_the_ranks_is_refused_naming_its_source(cpus, ranks, message):
    with pytest.raises(AnsibleFilterError) as error:
        cpu_threads_bind(cpus, ranks, source='AllowedCPUs')
    assert str(error.value) == message
