# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fault scenarios on the sandbox host, with the real vLLM (CPU build) and the real role.

1. A context that does not fit the KV cache: the play stops in the preflight and
   nothing on the host changes.
2. `kill -9` of the engine: systemd brings the service back, the gate passes,
   and the restart's shared-memory cleaner removes a dead run's segments while
   a live process's segments stay.

The tests run in file order; each leaves the service as the deploy made it.
"""

import re

import pytest
from sandbox_helpers import first_failure

PREFLIGHT_TASK = 'Check GPUs, weights and KV cache against the requested context'
# What tools/make_tiny_models.py taught the two models.
RIGHT_ANSWER = 'The capital of France is Paris.'
# MLA: (512 + 64) x 2 B x 3 layers = 3456 B/token; the sandbox's 13.5 MiB hold 4096 tokens.
MISFIT_MAX_MODEL_LEN = 8192


def snapshot(sandbox):
    """What a deploy could change: the files it writes and the running process."""
    unit_file = '/etc/systemd/system/%s.service' % sandbox.unit
    env_file = '/etc/%s/environment' % sandbox.unit
    files = sandbox.sh('sha256sum %s %s' % (unit_file, env_file))
    releases = sandbox.sh('ls -1 %s' % sandbox.vars['vllm_kimi_venv_root'])
    return files, releases, sandbox.show('MainPID', 'NRestarts', 'ExecMainStartTimestampMonotonic', 'ActiveState')


def test_misfit_context_stops_in_the_preflight_before_anything_changes(sandbox):
    before = snapshot(sandbox)
    rc, output, report = sandbox.deploy('-e', 'vllm_kimi_max_model_len=%d' % MISFIT_MAX_MODEL_LEN)
    name, result = first_failure(report, sandbox.name)
    assert rc == 2, output[-3000:]
    assert name == PREFLIGHT_TASK, result
    assert str(MISFIT_MAX_MODEL_LEN) in result['msg'], result['msg']
    assert report['stats'][sandbox.name]['changed'] == 0
    assert [e['task'] for e in report['tasks'] if e['status'] == 'changed'] == []
    assert snapshot(sandbox) == before


SHM_STALE = '/dev/shm/psm_llmserve_test_stale'  # a dead run's: old, nobody holds it
SHM_LIVE = '/dev/shm/psm_llmserve_test_live'  # old, but a live process has it open
SHM_YOUNG = '/dev/shm/sem.mp-llmserve_test_young'  # nobody holds it, but too young to judge
HOLDER = 'llmserve-test-shm-holder'


@pytest.fixture(scope='module')
def engine_killed(sandbox):
    """Plant /dev/shm segments, kill -9 the engine core, wait for systemd's restart and the gate."""
    # An interrupted earlier run may have left its holder behind.
    sandbox.host.run('systemctl stop %s; systemctl reset-failed %s', HOLDER, HOLDER)
    sandbox.sh('touch %s %s %s' % (SHM_STALE, SHM_LIVE, SHM_YOUNG))
    sandbox.sh(
        'systemd-run --unit=%s --property=Type=exec /usr/bin/python3 -c '
        "\"import time; f = open('%s', 'rb'); time.sleep(3600)\"" % (HOLDER, SHM_LIVE)
    )
    sandbox.wait_for(
        'the holder opening %s' % SHM_LIVE,
        lambda: (
            SHM_LIVE
            in sandbox.sh('ls -l /proc/$(systemctl show -p MainPID --value %s)/fd/ 2>/dev/null || true' % HOLDER)
        ),
        20,
    )
    sandbox.sh("touch -d '2 hours ago' %s %s" % (SHM_STALE, SHM_LIVE))
    before = sandbox.show('MainPID', 'NRestarts')
    engine = sandbox.sh('pgrep -u %s -f VLLM::EngineCore' % sandbox.vars['vllm_kimi_user']).split()
    assert len(engine) == 1, engine
    sandbox.sh('kill -9 %s' % engine[0])
    sandbox.wait_for(
        'systemd restarting %s' % sandbox.unit,
        lambda: int(sandbox.show('NRestarts')['NRestarts']) > int(before['NRestarts']),
        120,
    )
    gate = sandbox.gate()
    after = sandbox.show('MainPID', 'NRestarts', 'ActiveState')
    listing = sandbox.sh('ls -1 /dev/shm').split()
    yield {
        'before': before,
        'after': after,
        'gate': gate,
        'engine': engine[0],
        'shm': listing,
        'journal': sandbox.journal(200),
    }
    sandbox.host.run('systemctl stop %s', HOLDER)
    sandbox.host.run('rm -f %s %s %s', SHM_STALE, SHM_LIVE, SHM_YOUNG)


def test_killed_engine_service_is_restarted_by_systemd(engine_killed):
    before, after = engine_killed['before'], engine_killed['after']
    assert int(after['NRestarts']) == int(before['NRestarts']) + 1
    assert after['MainPID'] not in ('0', before['MainPID'])
    assert after['ActiveState'] == 'active'


def test_killed_engine_gate_passes_after_the_restart(engine_killed):
    gate = engine_killed['gate']
    assert not gate.get('failed'), gate.get('msg')
    assert gate['answer'] == RIGHT_ANSWER
    assert re.search(r'(?i)paris', gate['answer'])


def test_stale_shm_segment_of_the_dead_run_is_removed(engine_killed):
    assert SHM_STALE.rsplit('/', 1)[1] not in engine_killed['shm']
    assert 'removed stale segment %s' % SHM_STALE in engine_killed['journal']


@pytest.mark.parametrize('segment', [SHM_LIVE, SHM_YOUNG], ids=['held-open-by-a-live-process', 'too-young'])
def test_shm_segment_in_use_or_young_is_kept(engine_killed, segment):
    assert segment.rsplit('/', 1)[1] in engine_killed['shm']
