# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run llmserve.vllm.deployment as Ansible runs it: read, recorded and restored, in check and diff mode."""

import os
import re

import pytest

SECRET = 'deployment-test-secret'


@pytest.fixture
def host(tmp_path):
    unit = tmp_path / 'vllm-kimi.service'
    unit.write_text('[Service]\nExecStart=/opt/vllm-kimi/0123456789ab/bin/vllm serve /models/m\n')
    env = tmp_path / 'vllm-kimi.env'
    env.write_text('VLLM_API_KEY="%s"\n' % SECRET)
    releases = tmp_path / 'releases'
    (releases / '0123456789ab').mkdir(parents=True)
    return dict(
        path=str(tmp_path / 'deployments'), unit_file=str(unit), environment_file=str(env), releases_dir=str(releases)
    )


def test_read_before_any_deployment_changes_nothing(host, module_result):
    for check_mode in (True, False):
        rc, r = module_result('deployment', dict(path=host['path'], _ansible_check_mode=check_mode))
        assert (rc, r['changed'], r['last_good'], r['rollbacks']) == (0, False, {}, {'total': 0, 'last': 0})
        assert not os.path.lexists(host['path'])


def test_recording_creates_the_private_directory(host, module_result):
    rc, r = module_result('deployment', dict(host, state='recorded', record={'release': '0123456789ab'}))
    assert (rc, r['changed']) == (0, True), r
    assert oct(os.stat(host['path']).st_mode & 0o777) == '0o700'


def test_recorded_then_read_then_restored(host, module_result):
    record = dict(release='0123456789ab', kv_cache_quant_state='absent', model_path='/models/m')
    rc, done = module_result('deployment', dict(host, state='recorded', record=record, _ansible_check_mode=True))
    assert (rc, done['changed'], os.path.exists(host['path'])) == (0, True, False)
    rc, done = module_result('deployment', dict(host, state='recorded', record=record))
    assert rc == 0, done
    assert re.fullmatch(r'[0-9]{8}T[0-9]{6}Z-0123456789ab', done['deployment'])
    assert done['last_good'] == done['record'] and done['record']['kv_cache_quant_state'] == 'absent'
    assert SECRET not in str(done)
    rc, read = module_result('deployment', dict(path=host['path']))
    assert (read['changed'], read['last_good']) == (False, done['record'])

    with open(host['unit_file'], 'w') as f:
        f.write('[Service]\nUser=root\n')
    rc, restored = module_result('deployment', dict(host, state='restored', _ansible_diff=True))
    assert rc == 0, restored
    assert (restored['rolled_back'], restored['deployment'], restored['rollbacks']['total']) == (
        True,
        done['deployment'],
        1,
    )
    assert restored['record'] == done['record']
    assert restored['diff']['before'] == '[Service]\nUser=root\n'
    assert restored['diff']['after'].startswith('[Service]\nExecStart=')
    assert SECRET not in str(restored)


ROTATED = 'rotated-key-$HOME`x`"'


def test_a_rollback_keeps_the_secret_of_now_not_the_last_good_ones(host, module_result):
    """The key was rotated by the change that failed: the restored environment file has the new key, quoted as
    systemd reads it, and the rest as it passed; neither key shows in the result, the diff included."""
    rc, done = module_result('deployment', dict(host, state='recorded', record=dict(release='0123456789ab')))
    assert rc == 0, done
    with open(host['environment_file'], 'w') as f:
        f.write('VLLM_API_KEY="%s"\nBROKEN=1\n' % ROTATED)
    rc, restored = module_result(
        'deployment', dict(host, state='restored', environment_secrets={'VLLM_API_KEY': ROTATED}, _ansible_diff=True)
    )
    assert rc == 0, restored
    with open(host['environment_file']) as f:
        assert f.read() == 'VLLM_API_KEY="rotated-key-\\$HOME\\`x\\`\\""\n'
    assert SECRET not in str(restored) and 'rotated-key' not in str(restored)
    # Without the secrets, the last good file comes back as it was.
    rc, restored = module_result('deployment', dict(host, state='restored'))
    with open(host['environment_file']) as f:
        assert f.read() == 'VLLM_API_KEY="%s"\n' % SECRET


def test_a_first_deploy_cannot_be_restored(host, module_result):
    rc, r = module_result('deployment', dict(host, state='restored'))
    assert (rc, r['failed'], r['rolled_back']) == (1, True, False)
    assert r['msg'] == '%s has no good deployment to roll back to (last-good is missing: a first deploy)' % host['path']


@pytest.mark.parametrize(
    'args, message',
    [
        (
            dict(state='recorded', record={}),
            'record must hold release, the 12 hexadecimal digits of the release that passed',
        ),
        (
            dict(state='recorded', record={'release': '../../etc'}),
            "record must hold release, the 12 hexadecimal digits of the release that passed, got '../../etc'",
        ),
        (dict(keep=0), 'keep must be at least 1, got 0'),
        (dict(state='restored', unit_file=''), 'state restored needs unit_file and environment_file'),
        (
            dict(state='read', environment_secrets={'VLLM_API_KEY': 'k'}),
            'environment_secrets applies to state restored only, not to state read',
        ),
        (
            dict(state='restored', environment_secrets={'VLLM API KEY': 'k'}),
            "environment_secrets: 'VLLM API KEY' is not the name of an environment variable",
        ),
        (
            dict(state='restored', environment_secrets={'VLLM_API_KEY': SECRET + '\nLD_PRELOAD=/tmp/x.so'}),
            'environment_secrets: the value of VLLM_API_KEY holds a line break or a NUL, which an environment file '
            'cannot carry',
        ),
        (
            dict(state='restored', environment_secrets={'VLLM_API_KEY': 12}),
            'environment_secrets: the value of VLLM_API_KEY must be a text, got int',
        ),
    ],
    ids=[
        'no-release',
        'bad-release',
        'keep-0',
        'restored-without-unit',
        'secrets-not-restoring',
        'secret-name',
        'secret-line-break',
        'secret-not-text',
    ],
)
def test_bad_input_is_refused_and_writes_nothing(host, module_result, args, message):
    rc, r = module_result('deployment', dict(host, **args))
    assert rc == 1 and message in r['msg'], r
    assert not os.path.exists(host['path'])


def test_a_directory_the_service_user_could_write_is_refused(host, module_result):
    os.makedirs(host['path'])
    os.chmod(host['path'], 0o770)
    rc, r = module_result('deployment', dict(path=host['path']))
    assert rc == 1 and r['msg'].startswith('%s must be private to the user the role runs as' % host['path'])
