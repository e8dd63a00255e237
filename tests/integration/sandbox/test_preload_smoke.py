# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The pre-load smoke refuses, before any restart, what would fail only after the load (molecule verify).

One change carries five faults at once, each of which real hosts met after a long load: a flag the release's
parser rejects, TP 2 on a node whose devices (the CPU build's worker groups: one NUMA node here) cannot hold two
ranks, the previous unit's shape for a parallel start (on TCP behind the IP fence, no GLOO_SOCKET_IFNAME: Gloo binds
to the address the host name resolves to, which the unit's enforced IP fence drops), no C compiler, and no C++
compiler for torch inductor (the CPU build's first request compiles with it). The smoke runs in the service's own
sandbox and must name each; the host keeps serving what it served, untouched.
"""

import json

import pytest
from sandbox_helpers import first_failure, served, task_results

SMOKE_TASK = 'Refuse the change before any restart when the smoke failed'
NO_COMPILER = '/usr/bin/llmserve-no-such-cc'
NO_CXX = '/usr/bin/llmserve-no-such-cxx'


@pytest.fixture(scope='module')
def faulty_change(sandbox):
    before = served(sandbox)
    environment = dict(sandbox.vars.get('vllm_kimi_environment') or {})
    # An empty GLOO_SOCKET_IFNAME is what the unit rendered before a single node's ranks were kept on lo. That unit
    # served on TCP behind the IP fence: in the Unix socket's shape (a network namespace of its own, the default)
    # Gloo finds no such address there and falls back to loopback by itself.
    environment.update(CC=NO_COMPILER, CXX=NO_CXX, GLOO_SOCKET_IFNAME='')
    # vLLM's own binding (its default, auto), which the role leaves alone where the user sets it: the preflight would
    # otherwise split the sandbox's one CPU between the two ranks and refuse the change before the smoke ran, and the
    # smoke's refusal of vLLM's own NUMA assertion is one of the causes below.
    environment['VLLM_CPU_OMP_THREADS_BIND'] = 'auto'
    change = {
        'vllm_kimi_listen': 'tcp',
        'vllm_kimi_extra_args': list(sandbox.vars['vllm_kimi_extra_args']) + ['--no-such-flag'],
        'vllm_kimi_tensor_parallel_size': 2,
        'vllm_kimi_environment': environment,
        'vllm_kimi_smoke_timeout': 20,
    }
    rc, output, report = sandbox.deploy('-e', json.dumps(change))
    return before, rc, output, report


def test_the_smoke_refuses_the_change(sandbox, faulty_change):
    before, rc, output, report = faulty_change
    assert rc == 2, output[-3000:]
    name, result = first_failure(report, sandbox.name)
    assert name == SMOKE_TASK, (name, result)


@pytest.mark.parametrize(
    'cause',
    [
        # vLLM's own parser, in its own words.
        'parser failed: vllm: error: unrecognized arguments: --no-such-flag',
        # vLLM's CPU worker's own assertion, before the load rather than after it.
        'Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers',
        'VLLM_CPU_OMP_THREADS_BIND',
        'allreduce failed',
        'GLOO_SOCKET_IFNAME',
        'compiler failed',
        NO_COMPILER,
        'inductor failed',
        # torch inductor's own words, before the load rather than at the first request.
        "InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, '%s')" % NO_CXX,
    ],
)
def test_the_refusal_names_each_cause_and_its_remedy(sandbox, faulty_change, cause):
    before, rc, output, report = faulty_change
    name, result = first_failure(report, sandbox.name)
    assert cause in result['msg'], result['msg']


def test_the_refused_change_left_the_host_serving_as_before(sandbox, faulty_change):
    before, rc, output, report = faulty_change
    assert served(sandbox) == before
    names = [name for name, result in task_results(report, sandbox.name)]
    assert not [name for name in names if name.startswith('Restart')], names
    gate = sandbox.gate()
    assert not gate.get('failed'), gate.get('msg')


def test_the_smoke_leaves_no_unit_nor_environment_behind(sandbox, faulty_change):
    left = sandbox.sh('ls /run/systemd/system/ /run/ | grep -c smoke || true').strip()
    assert left == '0'
