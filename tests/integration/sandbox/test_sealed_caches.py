# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Sealed caches on the sandbox host, with the real vLLM (CPU build) and the real role.

vLLM loads its caches as code. The service's HOME and every cache live in its runtime directory, which systemd
empties at each stop; what a change's gated run warmed is sealed into root's store, and each start is seeded from it.
Here a change turns torch.compile on (the inventory's flags without --enforce-eager), so that its gated start
compiles kernels and the role seals them; then the service user plants files everywhere it can write, the service
restarts, and the next run's caches hold what the store holds, nothing that was planted, and no kernel compiled
again. The host keeps that change, gated and recorded as its last good deployment: the tests after this file
(test_stock_host.py, molecule's test_default.py) read what every deployment of the sandbox inventory serves, and
deploying the inventory's settings again would cost a start and its gates (about two minutes) for nothing they read.
"""

import json
import re
import shlex

import pytest

PLANTED = 'llmserve-planted.py'
# The variables that name where the service writes what it loads again: its HOME and every cache.
CACHE_VARIABLE = re.compile(r'HOME|CACHE|_DIR$|_ROOT$|WORKSPACE')


def environment_of(sandbox, pid):
    """The environment of a process of the service, its API key left out."""
    text = sandbox.sh('tr "\\0" "\\n" < /proc/%s/environ' % pid)
    pairs = (line.split('=', 1) for line in text.splitlines() if '=' in line)
    return dict((name, value) for name, value in pairs if name != 'VLLM_API_KEY')


def files_under(sandbox, top):
    return set(sandbox.sh('cd %s && find . -type f | sort' % top).split())


def cache_directories(environment):
    """The directories the environment names for the service's HOME and caches."""
    return sorted(
        value
        for name, value in environment.items()
        if CACHE_VARIABLE.search(name) and value.startswith('/') and name != 'RUNTIME_DIRECTORY'
    )


def files_in(sandbox, directories):
    """Every file under these directories, by its full path."""
    return set(sandbox.sh('find %s -type f 2>/dev/null || true' % ' '.join(directories)).split())


def as_service_user(sandbox, command):
    return sandbox.host.run('runuser -u %s -- sh -c %s', sandbox.vars['vllm_kimi_user'], command)


def files_with_times(sandbox, top):
    """relative path -> modification time (seconds since the epoch) of every file under top."""
    lines = sandbox.sh("cd %s && find . -type f -printf '%%T@ %%p\\n'" % top).splitlines()
    return dict((path, float(when)) for when, path in (line.split(' ', 1) for line in lines))


def main_start(sandbox):
    """When the service's main process started, in seconds since the epoch (microseconds kept)."""
    shown = sandbox.sh('systemctl show -p ExecMainStartTimestamp --value --timestamp=us+utc %s' % sandbox.unit)
    return float(sandbox.sh('date -d %s +%%s.%%N' % shlex.quote(shown.strip())))


@pytest.fixture(scope='module')
def compiled_change(sandbox):
    """A change with torch.compile on, gated and sealed, which the host keeps."""
    settings = {
        'vllm_kimi_extra_args': [arg for arg in sandbox.vars['vllm_kimi_extra_args'] if arg != '--enforce-eager'],
        'vllm_kimi_environment': dict(sandbox.vars.get('vllm_kimi_environment') or {}, LLMSERVE_SEALED_TEST='1'),
    }
    rc, output, _report = sandbox.deploy('-e', json.dumps(settings))
    assert rc == 0, output[-3000:]
    return settings


@pytest.fixture(scope='module')
def planted_and_restarted(sandbox, compiled_change):
    unit = sandbox.sh('cat /etc/systemd/system/%s.service' % sandbox.unit)
    store = re.search(r'"seed" "(/[^"]+)"', unit).group(1)
    home = environment_of(sandbox, sandbox.show('MainPID')['MainPID'])['HOME']
    state = sandbox.vars['vllm_kimi_state_dir']
    planted_in = [home + '/.cache/vllm', home + '/.triton/cache', state + '/.cache/vllm', state + '/cache/vllm']
    for directory in planted_in:
        planting = as_service_user(sandbox, 'mkdir -p %s && echo import os > %s/%s' % (directory, directory, PLANTED))
        assert planting.rc == 0, (directory, planting.stderr)
    into_store = as_service_user(sandbox, 'echo import os > %s/%s' % (store, PLANTED))
    before = sandbox.show('MainPID')
    try:
        sandbox.sh('systemctl restart %s' % sandbox.unit)
        gate = sandbox.gate()
        after = sandbox.show('MainPID', 'ReadWritePaths')
        environment = environment_of(sandbox, after['MainPID'])
        yield {
            'home_files': files_with_times(sandbox, home),
            'main_start': main_start(sandbox),
            'store': store,
            'stored': files_under(sandbox, store),
            'store_stat': sandbox.sh('stat -c "%%U %%G %%a" %s' % store),
            'into_store': into_store,
            'home': home,
            'seeded': files_under(sandbox, home),
            'environment': environment,
            'in_caches': files_in(sandbox, cache_directories(environment)),
            'runtime_dir': '/run/%s' % sandbox.unit,
            'before': before,
            'after': after,
            'gate': gate,
        }
    finally:
        sandbox.sh('rm -f %s/.cache/vllm/%s %s/cache/vllm/%s' % (state, PLANTED, state, PLANTED))


def test_the_restart_served_again(planted_and_restarted):
    run = planted_and_restarted
    assert run['after']['MainPID'] != run['before']['MainPID']
    assert not run['gate']['failed'], run['gate']


def test_a_file_the_service_user_planted_is_absent_from_the_next_runs_caches(planted_and_restarted):
    run = planted_and_restarted
    assert run['in_caches'], 'no file in the caches of %s' % cache_directories(run['environment'])
    assert [path for path in run['in_caches'] if PLANTED in path] == []


def test_the_next_run_is_seeded_from_the_sealed_store(planted_and_restarted):
    run = planted_and_restarted
    # On the CPU build vLLM caches what it learnt of the model's class (modelinfos), numba its compiled functions.
    assert run['stored'], 'the store %s is empty' % run['store']
    assert run['stored'] <= run['seeded'], sorted(run['stored'] - run['seeded'])


def test_the_next_run_compiled_no_kernel_again(planted_and_restarted):
    """Every compiled kernel (torch inductor's shared objects) in the warm run's HOME was copied in by the seed before
    vLLM started; none was written by vLLM since. A cold start writes every one of them after its start."""
    run = planted_and_restarted
    kernels = dict((path, when) for path, when in run['home_files'].items() if path.endswith('.so'))
    assert kernels, 'no compiled kernel in %s: was torch.compile on?' % run['home']
    assert dict((p, w) for p, w in kernels.items() if w >= run['main_start']) == {}
    assert set(kernels) <= run['stored']


def test_the_store_is_roots_and_the_service_user_cannot_write_it(planted_and_restarted):
    run = planted_and_restarted
    assert run['into_store'].rc != 0 and 'Permission denied' in run['into_store'].stderr, run['into_store']
    owner, group, mode = run['store_stat'].split()
    assert owner == 'root' and int(mode, 8) & 0o022 == 0, run['store_stat']


def test_no_cache_variable_points_at_a_persistent_directory(planted_and_restarted):
    run = planted_and_restarted
    outside = [path for path in cache_directories(run['environment']) if not path.startswith(run['runtime_dir'] + '/')]
    assert outside == []
    assert run['home'].startswith(run['runtime_dir'] + '/')
    # Nothing persistent is the service's to write: besides its runtime directory, only the socket's directory, which
    # each run empties ("-": the commands of a first start, before it exists, start without it; systemctl may show the
    # prefix or not).
    socket_directory = '/run/%s-api' % run['runtime_dir'].rsplit('/', 1)[1]
    assert run['after']['ReadWritePaths'] in ('', socket_directory, '-' + socket_directory)
