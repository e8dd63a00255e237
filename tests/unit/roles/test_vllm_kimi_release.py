# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_kimi's release (tasks/venv.yml, vars/main.yml) as Ansible renders it: the release id, the install and check
command lines; and the preflight's refusal of an unreadable lock file and of credentials in the package sources
(tasks/preflight.yml), run by Ansible on values that must pass and values that must not."""

import hashlib
import json
import os

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import LOAD_VLLM_KIMI_VARS, VLLM_KIMI, run_local_play

# The id of the default spec before the lock and wheels-only settings existed: a role upgrade must not rebuild
# (and restart onto) a release that is already built.
DEFAULT_RELEASE_ID = '8eab15594598'
RELEASE = '/opt/vllm-kimi/%s'
LOCK = 'vllm==0.33.0 \\\n    --hash=sha256:%s\n' % ('0' * 64)
SECRET = 'hunter2-t0ken'


def _tasks(name):
    with open(os.path.join(VLLM_KIMI, 'tasks', name)) as handle:
        return yaml.safe_load(handle)


def _task(tasks, name):
    for task in tasks:
        if task.get('name') == name:
            return task
        found = _task(task.get('block', []), name)
        if found:
            return found
    return None


BUILD = _task(_tasks('venv.yml'), 'Build and check the release beside the running one')
INSTALL = _task(BUILD['block'], "Install vLLM into the release's venv as the service user")
COPY_LOCK = _task(BUILD['block'], 'Ensure the lock file the release is installed from is in place')
CHECK = _task(
    BUILD['block'], 'Check as the service user that vLLM imports, has the version asked for and its entry point starts'
)
SEAL = _task(
    BUILD['block'], "Seal the release, root's and read-only to the service user, before anything reads it back"
)
KEEP_LOCK = _task(BUILD['block'], 'Ensure the release holds the lock file it was installed from')
# What root itself runs while it builds a release: none of it starts the release's interpreter.
ROOT_COMMANDS = {
    'Look for uv': ['sh', '-c', 'command -v uv'],
    'Stop the build an earlier run left running, before root passes over its release': [
        'systemctl', 'stop', 'vllm-kimi-release.service',
    ],
    'Seal the release, root\'s and read-only to the service user, before anything reads it back': [
        '/usr/bin/python3', '-I', '/usr/local/libexec/llmserve-own-tree', 'seal', '{release}', '--group', 'root',
    ],
    'Stop what the failed build left running': ['systemctl', 'stop', 'vllm-kimi-release.service'],
}  # fmt: skip


def render(tmp_path, extra_vars=None, uv=''):
    """The role's release values, and the install and check tasks' command lines, for these variables."""
    out = tmp_path / 'release.json'
    values = {
        'id': '{{ _vllm_kimi_release_id }}',
        'spec': '{{ _vllm_kimi_venv_spec }}',
        'install': INSTALL['ansible.builtin.command']['argv'],
        'check': CHECK['ansible.builtin.command']['argv'],
        'commands': {
            task['name']: task['ansible.builtin.command']['argv']
            for task in BUILD['block'] + BUILD['rescue']
            if 'ansible.builtin.command' in task
        },
    }
    task = {
        'ansible.builtin.copy': {'content': '{{ _values | to_json }}', 'dest': str(out), 'mode': '0644'},
        'vars': dict(BUILD['vars'], _values=values, __vllm_kimi_uv={'stdout': uv}),
    }
    rc, output = run_local_play(tmp_path, LOAD_VLLM_KIMI_VARS + [task], extra_vars)
    assert rc == 0, output
    values = json.loads(out.read_text())
    # The install's own command line, after the options of systemd-run, which the tests below judge.
    after = [word for word in values['install'] if word.startswith('--property=ReadWritePaths=')][0]
    values['install'] = values['install'][values['install'].index(after) + 1 :]
    return values


def lock_file(tmp_path, text, name='requirements.lock'):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_default_release_keeps_its_id_and_installs_wheels_only(tmp_path):
    release = render(tmp_path)
    assert release['id'] == DEFAULT_RELEASE_ID
    python = RELEASE % DEFAULT_RELEASE_ID + '/bin/python'
    assert release['install'] == [python, '-m', 'pip', 'install', '--no-input', '--only-binary=:all:', 'vllm==0.33.0']


def test_uv_installs_wheels_only_too(tmp_path):
    release = render(
        tmp_path, {'vllm_kimi_pip_extra_args': ['--index-url', 'https://pypi.example.com/simple']}, '/usr/bin/uv'
    )
    python = RELEASE % release['id'] + '/bin/python'
    assert release['install'] == [
        '/usr/bin/uv', 'pip', 'install', '--compile-bytecode', '--python', python,
        '--only-binary=:all:', 'vllm==0.33.0', '--index-url', 'https://pypi.example.com/simple',
    ]  # fmt: skip


def test_sdists_allowed_is_a_release_of_its_own(tmp_path):
    release = render(tmp_path, {'vllm_kimi_pip_only_binary': False})
    assert release['spec']['pip_only_binary'] is False
    assert release['id'] != DEFAULT_RELEASE_ID
    assert release['install'][-1] == 'vllm==0.33.0' and '--only-binary=:all:' not in release['install']


@pytest.mark.parametrize('uv', ['', '/usr/bin/uv'], ids=['pip', 'uv'])
def test_a_lock_file_is_installed_with_its_hashes_checked(tmp_path, uv):
    release = render(
        tmp_path, {'vllm_kimi_pip_lock_file': lock_file(tmp_path, LOCK), 'vllm_kimi_pip_extra_args': ['-q']}, uv
    )
    lock = '/opt/vllm-kimi/.%s.requirements.lock' % release['id']
    assert release['install'][-5:] == ['--only-binary=:all:', '--require-hashes', '-r', lock, '-q']
    assert 'vllm==0.33.0' not in release['install']  # the lock pins it; the release check holds it to the spec


def test_the_release_id_follows_the_lock_files_content(tmp_path):
    first = render(tmp_path, {'vllm_kimi_pip_lock_file': lock_file(tmp_path, LOCK, 'a.lock')})
    same = render(tmp_path, {'vllm_kimi_pip_lock_file': lock_file(tmp_path, LOCK, 'b.lock')})
    other = render(
        tmp_path, {'vllm_kimi_pip_lock_file': lock_file(tmp_path, LOCK.replace('0' * 64, '1' * 64), 'c.lock')}
    )
    # sha256sum of the file, byte for byte (the file lookup strips no trailing newline here).
    assert first['spec']['pip_lock_sha256'] == hashlib.sha256(LOCK.encode()).hexdigest()
    assert first['id'] == same['id']
    assert len({first['id'], other['id'], DEFAULT_RELEASE_ID}) == 3


def test_the_release_holds_the_lock_it_was_hashed_from_root_owned():
    copy = COPY_LOCK['ansible.builtin.copy']
    assert (copy['content'], copy['dest']) == ('{{ _vllm_kimi_pip_lock }}', '{{ _vllm_kimi_pip_lock_input }}')
    assert (copy['owner'], copy['group'], copy['mode']) == ('root', 'root', '0644')
    assert COPY_LOCK['when'] == '_vllm_kimi_pip_locked | bool'
    assert BUILD['block'].index(COPY_LOCK) < BUILD['block'].index(INSTALL)
    # The copy the release keeps is written once root sealed the release, from the same content as the install's
    # input (not copied on the host, whose input check mode never writes).
    keep = KEEP_LOCK['ansible.builtin.copy']
    assert (keep['content'], keep['dest'], 'remote_src' in keep) == (
        '{{ _vllm_kimi_pip_lock }}',
        '{{ _vllm_kimi_pip_lock_path }}',
        False,
    )
    assert BUILD['block'].index(SEAL) < BUILD['block'].index(KEEP_LOCK)


def _unit(user='svc', group='svcgrp', offline=True, writes=None):
    """systemd-run's arguments for the service user's transient unit of the release's commands."""
    argv = [
        'systemd-run', '--unit=vllm-kimi-release', '--quiet', '--wait', '--pipe', '--collect',
        '--uid=' + user, '--gid=' + group, '--working-directory=/',
        '--setenv=HOME=/tmp', '--setenv=XDG_CACHE_HOME=/tmp/.cache', '--setenv=PIP_NO_CACHE_DIR=1',
        '--setenv=VLLM_NO_USAGE_STATS=1',
        '--property=ProtectSystem=strict', '--property=ProtectHome=yes', '--property=PrivateTmp=yes',
        '--property=PrivateDevices=yes', '--property=NoNewPrivileges=yes', '--property=CapabilityBoundingSet=',
        '--property=RestrictSUIDSGID=yes', '--property=RestrictNamespaces=yes', '--property=ProtectKernelTunables=yes',
        '--property=ProtectKernelModules=yes', '--property=ProtectControlGroups=yes', '--property=LockPersonality=yes',
        '--property=SystemCallArchitectures=native', '--property=UMask=0022',
    ]  # fmt: skip
    if writes:
        argv.append('--property=ReadWritePaths=' + writes)
    if offline:
        argv += ['--property=PrivateNetwork=yes', '--property=IPAddressDeny=any']
    return argv


def test_the_release_check_runs_as_the_service_user_offline_on_the_sealed_release(tmp_path):
    release = render(tmp_path, {'vllm_kimi_user': 'svc', 'vllm_kimi_group': 'svcgrp', 'vllm_kimi_state_dir': '/srv/st'})
    path = RELEASE % release['id']
    assert release['check'] == _unit() + [
        '--setenv=PYTHONDONTWRITEBYTECODE=1',
        path + '/bin/python', '/usr/local/libexec/llmserve-check-release', 'vllm==0.33.0', '--', path + '/bin/vllm', 'serve',
    ]  # fmt: skip
    assert BUILD['block'].index(SEAL) < BUILD['block'].index(CHECK)


@pytest.mark.parametrize('uv', ['', '/usr/bin/uv'], ids=['pip', 'uv'])
def test_root_never_starts_the_releases_interpreter(tmp_path, uv):
    """Every command of the build is root's own (no release code) or runs in the service user's unit: offline, but
    for the install, and writing the release only while it is built."""
    release = render(
        tmp_path,
        {'vllm_kimi_user': 'svc', 'vllm_kimi_group': 'svcgrp', 'vllm_kimi_accelerator': 'cpu'},
        uv,
    )
    path = RELEASE % release['id']
    as_user = {}
    for name, argv in release['commands'].items():
        if name in ROOT_COMMANDS:
            assert argv == [word.format(release=path) for word in ROOT_COMMANDS[name]], name
            continue
        offline = name != "Install vLLM into the release's venv as the service user"
        writes = None if name == CHECK['name'] else path
        unit = _unit(offline=offline, writes=writes)
        assert argv[: len(unit)] == unit, name
        as_user[name] = argv[len(unit) :]
    python = path + '/bin/python'
    assert as_user["Create the release's venv as the service user"] == (
        [uv, 'venv', '--python', 'python3', path] if uv else ['python3', '-m', 'venv', path]
    )
    assert as_user["Install vLLM into the release's venv as the service user"][:4] == (
        [uv, 'pip', 'install', '--compile-bytecode'] if uv else [python, '-m', 'pip', 'install']
    )
    assert as_user['Remove the torch extras that break the CPU build of vLLM, as the service user'][-3:] == [
        'torchvision', 'torchaudio', 'torchcodec',
    ]  # fmt: skip
    assert len(as_user) == 4


def test_the_release_is_the_service_users_only_until_it_is_sealed():
    names = [task['name'] for task in BUILD['block']]
    handover = names.index("Ensure the release's directory is the service user's while it is built")
    seal = names.index(SEAL['name'])
    built_as_user = [name for name in names if name.endswith('as the service user')]
    assert all(handover < names.index(name) < seal for name in built_as_user), names
    # Root reads nothing back from the release (the check's answer, the marker) before the seal.
    assert seal < names.index(CHECK['name']) < names.index('Record that the release passed its check')


PREFLIGHT = _tasks('preflight.yml')
REQUIRE_HASHES = _task(PREFLIGHT, 'Refuse a release without a lock file while hashes are required')
REFUSALS = [
    REQUIRE_HASHES,
    _task(PREFLIGHT, 'Refuse a lock file that cannot be read or checks no hashes'),
    _task(PREFLIGHT, 'Refuse package sources whose URLs carry credentials'),
]


def preflight(tmp_path, extra_vars):
    """The preflight's refusals of package sources; without a lock file named, with hashes not required."""
    if not extra_vars.get('vllm_kimi_pip_lock_file'):
        extra_vars = dict(extra_vars, vllm_kimi_pip_require_hashes=False)
    return run_local_play(tmp_path, LOAD_VLLM_KIMI_VARS + REFUSALS, extra_vars)


def test_by_default_a_release_without_a_lock_file_is_refused(tmp_path):
    rc, output = run_local_play(tmp_path, LOAD_VLLM_KIMI_VARS + [REQUIRE_HASHES])
    assert rc == 2, output
    assert (
        'vllm_kimi_pip_require_hashes is on and vllm_kimi_pip_lock_file is empty: a release is installed only from a '
        'lock with a hash for every package.'
    ) in ' '.join(output.split())
    rc, output = run_local_play(
        tmp_path, LOAD_VLLM_KIMI_VARS + [REQUIRE_HASHES], {'vllm_kimi_pip_require_hashes': False}
    )
    assert rc == 0, output


def test_the_preflight_passes_clean_sources(tmp_path):
    rc, output = preflight(
        tmp_path,
        {
            'vllm_kimi_pip_lock_file': lock_file(tmp_path, '--index-url https://pypi.example.com/simple\n' + LOCK),
            'vllm_kimi_pip_extra_args': ['--extra-index-url', 'https://download.pytorch.org/whl/cpu'],
        },
    )
    assert rc == 0, output


@pytest.mark.parametrize(
    'lock, message',
    [
        (
            None,
            'cannot be read on the controller: it is missing, not a file, or not readable by the user running Ansible.',
        ),
        ('directory', 'cannot be read on the controller'),
        ('vllm==0.33.0\n', 'has no --hash lines: generate it with `pip-compile --generate-hashes`'),
    ],
    ids=['missing', 'a directory', 'no hashes'],
)
def test_the_preflight_refuses_a_lock_file_it_cannot_use(tmp_path, lock, message):
    path = str(tmp_path / 'requirements.lock')
    if lock == 'directory':
        os.mkdir(path)
    elif lock is not None:
        lock_file(tmp_path, lock)
    rc, output = preflight(tmp_path, {'vllm_kimi_pip_lock_file': path})
    assert rc == 2, output
    assert 'vllm_kimi_pip_lock_file %s %s' % (path, message) in ' '.join(output.split())


@pytest.mark.parametrize(
    'extra_vars, where',
    [
        ({'vllm_kimi_package_spec': 'vllm @ https://me:%s@h.example/vllm.whl' % SECRET}, 'vllm_kimi_package_spec has'),
        (
            {'vllm_kimi_pip_extra_args': ['-q', '--index-url=https://me:%s@h.example/simple' % SECRET]},
            'vllm_kimi_pip_extra_args[1] has',
        ),
        (
            {'vllm_kimi_pip_extra_args': ['-i', 'https://%s@h.example/simple' % SECRET]},
            'vllm_kimi_pip_extra_args[1] has',
        ),
        (
            {'vllm_kimi_pip_extra_args': ['--find-links', 'https://me:%s@h.example/w/' % SECRET]},
            'vllm_kimi_pip_extra_args[1] has',
        ),
        (
            {'lock': '--extra-index-url https://me:%s@h.example/simple\n' % SECRET + LOCK},
            'vllm_kimi_pip_lock_file {lock}, line 1 has',
        ),
    ],
    ids=['package spec', 'index-url=', '-i', 'find-links', 'lock file'],
)
def test_the_preflight_refuses_credentials_without_showing_them(tmp_path, extra_vars, where):
    extra_vars = dict(extra_vars)
    if 'lock' in extra_vars:
        extra_vars['vllm_kimi_pip_lock_file'] = lock_file(tmp_path, extra_vars.pop('lock'))
    rc, output = preflight(tmp_path, extra_vars)
    assert rc == 2, output
    flat = ' '.join(output.split())
    assert where.format(lock=extra_vars.get('vllm_kimi_pip_lock_file')) + ' https://****@h.example/' in flat
    assert "root's ~/.netrc" in flat
    # Ansible prints the failed task's message; the play's own extra vars are never in its output.
    assert SECRET not in output
