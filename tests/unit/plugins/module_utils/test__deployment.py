# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _deployment: a host's deployments that passed their gate, recorded, read back, restored, pruned."""

import json
import os

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils._deployment import (
    DeploymentError,
    deployment_name,
    ensure_private_directory,
    last_good,
    prune_plan,
    record,
    restore,
    rollbacks,
    with_secrets,
)

OLD = '20261101T120000Z-00112233aabb'
MIDDLE = '20261115T120000Z-445566778899'
NEW = '20261201T120000Z-0123456789ab'


@pytest.fixture
def host(tmp_path):
    """A deployments directory (0700), a unit and an environment file as the role writes them, a releases root."""
    deployments = tmp_path / 'deployments'
    ensure_private_directory(str(deployments), False)
    unit = tmp_path / 'vllm-kimi.service'
    unit.write_text('[Service]\nExecStart=/opt/vllm-kimi/0123456789ab/bin/vllm serve\n')
    env = tmp_path / 'vllm-kimi.env'
    env.write_text('VLLM_API_KEY="secret"\n')
    # The releases root holds one release no deployment uses (a build whose change failed).
    releases = tmp_path / 'releases'
    (releases / 'ffffffffffff').mkdir(parents=True)
    return str(deployments), str(unit), str(env), str(releases)


def read(path):
    with open(path) as handle:
        return handle.read()


def recorded(host, name, **content):
    deployments, unit, env, releases = host
    return record(deployments, name, dict({'release': name[-12:]}, **content), unit, env, releases, 3, False)


def test_a_record_snapshots_what_served_and_points_last_good_at_it(host):
    deployments, unit, env = host[:3]
    done = recorded(host, NEW, kv_cache_quant_state='absent')
    assert done['deployment'] == NEW and done['record']['deployment'] == NEW
    snapshot = os.path.join(deployments, NEW)
    assert read(os.path.join(snapshot, 'unit')) == read(unit)
    assert read(os.path.join(snapshot, 'environment')) == 'VLLM_API_KEY="secret"\n'
    assert {name: oct(os.stat(os.path.join(snapshot, name)).st_mode & 0o777) for name in os.listdir(snapshot)} == {
        'unit': '0o600',
        'environment': '0o600',
        'record.json': '0o600',
    }
    assert os.readlink(os.path.join(deployments, 'last-good')) == NEW
    assert last_good(deployments) == (NEW, done['record'])
    assert not [n for n in os.listdir(deployments) if n.startswith('.llmserve-deployment-')]


def test_before_any_good_deployment_there_is_none(host):
    assert last_good(host[0]) == (None, {})
    assert rollbacks(host[0]) == {'total': 0, 'last': 0}


def test_the_prune_keeps_the_newest_and_the_releases_they_use(host):
    deployments, releases = host[0], host[3]
    pruned = []
    for name in (OLD, MIDDLE, NEW):
        os.mkdir(os.path.join(releases, name[-12:]))  # each change builds its release, then records once it passed
        if name != NEW:
            pruned.append(recorded(host, name)['pruned'])
    assert pruned == [[os.path.join(releases, 'ffffffffffff')], []]
    # keep 2: OLD goes, and with it its release; the serving NEW and MIDDLE keep theirs.
    assert prune_plan(deployments, releases, 2, NEW) == [
        os.path.join(deployments, OLD),
        os.path.join(releases, '00112233aabb'),
    ]
    done = record(deployments, NEW, {'release': NEW[-12:]}, host[1], host[2], releases, 2, False)
    assert done['pruned'] == [os.path.join(deployments, OLD), os.path.join(releases, '00112233aabb')]
    assert sorted(os.listdir(deployments)) == [MIDDLE, NEW, 'last-good']
    assert sorted(os.listdir(releases)) == ['0123456789ab', '445566778899']


def test_check_mode_records_nothing(host):
    deployments = host[0]
    done = record(deployments, NEW, {'release': NEW[-12:]}, host[1], host[2], host[3], 3, True)
    assert done['deployment'] == NEW
    assert os.listdir(deployments) == []


def test_restore_puts_back_the_last_good_files_and_counts_the_rollback(host):
    deployments, unit, env = host[:3]
    recorded(host, NEW, model_path='/models/kimi', kv_cache_quant_state='absent')
    good_unit = read(unit)
    with open(unit, 'w') as f:
        f.write('[Service]\nUser=root\n')
    with open(env, 'w') as f:
        f.write('VLLM_API_KEY="changed"\n')
    done = restore(deployments, unit, env, lambda: 1796126400.5, False)
    assert (done['deployment'], done['rolled_back'], done['rollbacks']) == (NEW, True, {'total': 1, 'last': 1796126400})
    assert done['record']['kv_cache_quant_state'] == 'absent' and done['record']['model_path'] == '/models/kimi'
    assert (done['unit_before'], done['unit_after']) == ('[Service]\nUser=root\n', good_unit)
    assert read(unit) == good_unit and read(env) == 'VLLM_API_KEY="secret"\n'
    assert oct(os.stat(env).st_mode & 0o777) == '0o600'
    assert restore(deployments, unit, env, lambda: 1796126500, False)['rollbacks'] == {'total': 2, 'last': 1796126500}
    assert rollbacks(deployments) == {'total': 2, 'last': 1796126500}


def test_a_first_deploy_has_nothing_to_restore(host):
    deployments, unit, env = host[:3]
    with pytest.raises(DeploymentError) as err:
        restore(deployments, unit, env, lambda: 0, False)
    assert (
        str(err.value)
        == '%s has no good deployment to roll back to (last-good is missing: a first deploy)' % deployments
    )


def test_check_mode_restores_nothing(host):
    deployments, unit, env = host[:3]
    recorded(host, NEW)
    with open(unit, 'w') as f:
        f.write('changed\n')
    assert restore(deployments, unit, env, lambda: 5, True)['rollbacks'] == {'total': 1, 'last': 5}
    assert read(unit) == 'changed\n' and rollbacks(deployments) == {'total': 0, 'last': 0}


def test_a_planted_link_is_never_followed(host, tmp_path):
    """Where last-good's deployment holds a link instead of its unit, the restore refuses and changes nothing."""
    deployments, unit, env = host[:3]
    recorded(host, NEW)
    planted = tmp_path / 'planted'
    planted.write_text('[Service]\nUser=root\n')
    os.unlink(os.path.join(deployments, NEW, 'unit'))
    os.symlink(str(planted), os.path.join(deployments, NEW, 'unit'))
    before = read(unit)
    with pytest.raises(DeploymentError) as err:
        restore(deployments, unit, env, lambda: 0, False)
    assert str(err.value) == '%s is a link, which is not followed' % os.path.join(deployments, NEW, 'unit')
    assert read(unit) == before


@pytest.mark.parametrize(
    'target, message',
    [
        ('../elsewhere', "points to '../elsewhere', which is no deployment of this directory"),
        ('/etc', "points to '/etc', which is no deployment of this directory"),
    ],
)
def test_a_last_good_pointing_outside_is_refused(host, target, message):
    os.symlink(target, os.path.join(host[0], 'last-good'))
    with pytest.raises(DeploymentError) as err:
        last_good(host[0])
    assert str(err.value) == '%s/last-good %s' % (host[0], message)


@pytest.mark.parametrize('mode', [0o750, 0o707, 0o777])
def test_a_directory_others_may_write_is_refused(tmp_path, mode):
    shared = tmp_path / 'shared'
    shared.mkdir()
    os.chmod(str(shared), mode)
    with pytest.raises(DeploymentError) as err:
        ensure_private_directory(str(shared), False)
    assert str(
        err.value
    ) == '%s must be private to the user the role runs as (owner uid %d, mode 0700): found owner uid %d, mode %04o' % (
        shared,
        os.geteuid(),
        os.geteuid(),
        mode,
    )


def test_a_broken_record_names_the_file(host):
    deployments = host[0]
    recorded(host, NEW)
    with open(os.path.join(deployments, NEW, 'record.json'), 'w') as f:
        f.write('[1, 2')
    with pytest.raises(DeploymentError) as err:
        last_good(deployments)
    assert str(err.value).startswith('%s/%s/record.json is not valid JSON: ' % (deployments, NEW))


def test_a_broken_rollback_count_names_the_file(host):
    with open(os.path.join(host[0], 'rollbacks.json'), 'w') as f:
        json.dump({'total': 'many'}, f)
    with pytest.raises(DeploymentError) as err:
        rollbacks(host[0])
    assert str(err.value) == '%s/rollbacks.json is not a rollback count ({"total": N, "last": T})' % host[0]


def test_deployment_names():
    assert deployment_name('20261201T120000Z', '0123456789ab') == NEW
    with pytest.raises(DeploymentError):
        deployment_name('20261201T120000Z', '../../etc')


@pytest.mark.parametrize(
    'environment, secrets, expected',
    [
        (b'A=1\nVLLM_API_KEY="old"\nB=2\n', {'VLLM_API_KEY': 'new'}, b'A=1\nVLLM_API_KEY="new"\nB=2\n'),
        # A key set where the last good deployment had none is added; an empty one removes it.
        (b'A=1\n', {'VLLM_API_KEY': 'new'}, b'A=1\nVLLM_API_KEY="new"\n'),
        (b'VLLM_API_KEY="old"\nA=1\n', {'VLLM_API_KEY': ''}, b'A=1\n'),
        # A second line of the same name would win in systemd: only the first place is kept.
        (b'VLLM_API_KEY="old"\nA=1\nVLLM_API_KEY="older"\n', {'VLLM_API_KEY': 'n'}, b'VLLM_API_KEY="n"\nA=1\n'),
        # Comments and other names that begin alike stay.
        (
            b'# VLLM_API_KEY=x\nVLLM_API_KEY_FILE=f\n',
            {'VLLM_API_KEY': 'k'},
            b'# VLLM_API_KEY=x\nVLLM_API_KEY_FILE=f\nVLLM_API_KEY="k"\n',
        ),
        (b'', {'VLLM_API_KEY': 'a$b'}, b'VLLM_API_KEY="a\\$b"\n'),
    ],
    ids=['replaced', 'added', 'removed', 'duplicates', 'look-alikes', 'empty-file'],
)
def test_secrets_take_their_values_of_now(environment, secrets, expected):
    assert with_secrets(environment, secrets) == expected


def test_a_restore_with_secrets_replaces_them_in_the_restored_file(host):
    deployments, unit, env, releases = host
    recorded(host, NEW)
    restore(deployments, unit, env, lambda: 1, False, {'VLLM_API_KEY': 'rotated'})
    assert read(env) == 'VLLM_API_KEY="rotated"\n'
