# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Bad input against llmserve.vllm.deployment, run as Ansible runs it.

Every failure must name the file or the value and the cause and leave every file as it was (the deployments
directory, the unit and the environment file, byte for byte, mode for mode and link for link); every success must be
the right one and leave no temporary file behind. No run may outlive its deadline (a FIFO where a file is read must
not block the module), print the environment file's secrets, or leave a state from which the next rollback fails.
Write failures are real: immutable files (chattr +i), a full tmpfs, concurrent runs and runs killed with SIGKILL.
"""

import errno
import json
import math
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tests.support import warning_texts

pytestmark = pytest.mark.adversarial

MODULE = 'deployment'
TEMP_PREFIX = '.llmserve-tmp-'
LOCK = '.llmserve-deployment.lock'
MAX_FILE_BYTES = 1 << 20
MAX_RECORD_DEPTH = 32

GOOD = '20261201T120000Z-0123456789ab'
OLD = '20261101T120000Z-00112233aabb'
NEW_RELEASE = 'fedcba987654'
SECRET = 'good-secret-1b7e'
CHANGED_SECRET = 'changed-secret-9c2d'
GOOD_UNIT = '[Service]\nExecStart=/opt/vllm-kimi/0123456789ab/bin/vllm serve /models/m\n'
CHANGED_UNIT = '[Service]\nExecStart=/opt/vllm-kimi/fedcba987654/bin/vllm serve /models/m\n'
GOOD_ENV = 'VLLM_API_KEY="%s"\n' % SECRET
CHANGED_ENV = 'VLLM_API_KEY="%s"\n' % CHANGED_SECRET
SECRETS = (SECRET, CHANGED_SECRET)
GOOD_RECORD = {
    'deployment': GOOD,
    'recorded_at': '2026-12-01T12:00:00Z',
    'release': '0123456789ab',
    'model_path': '/models/m',
    'kv_cache_quant_state': 'absent',
}
NEW_RECORD = {'release': NEW_RELEASE, 'model_path': '/models/m', 'kv_cache_quant_state': 'absent'}
NAME = re.compile(r'[0-9]{8}T[0-9]{6}Z-[0-9a-f]{12}')


class Host:
    """A host as the role leaves it mid-change: the deployments directory with one good deployment (last-good), the
    changed unit and environment file, the releases; outside, a place a planted link could point to."""

    def __init__(self, root, workdir):
        self.root = root
        self.workdir = workdir
        self.d = root / 'deployments'
        self.unit = root / 'etc' / 'vllm-kimi.service'
        self.env = root / 'etc' / 'vllm-kimi.env'
        self.releases = root / 'releases'
        self.outside = root / 'outside'
        self.names = dict(d=self.d, unit=self.unit, unit_dir=self.unit.parent, env=self.env, out=self.outside)

    def make(self):
        for directory in (self.d, self.unit.parent, self.releases / '0123456789ab', self.releases / NEW_RELEASE):
            directory.mkdir(parents=True)
        os.chmod(str(self.d), 0o700)
        self.outside.mkdir()
        write_deployment(self.d, GOOD, GOOD_RECORD)
        os.symlink(GOOD, str(self.d / 'last-good'))
        self.unit.write_text(CHANGED_UNIT)
        self.env.write_text(CHANGED_ENV)
        os.chmod(str(self.env), 0o600)
        return self

    def args(self, state, **overrides):
        args = {'path': str(self.d), 'state': state}
        if state != 'read':
            args.update(unit_file=str(self.unit), environment_file=str(self.env))
        if state == 'recorded':
            args.update(record=dict(NEW_RECORD), releases_dir=str(self.releases), keep=3)
        args.update(overrides)
        return args


def write_deployment(directory, name, record, unit=GOOD_UNIT, env=GOOD_ENV):
    snapshot = directory / name
    snapshot.mkdir(mode=0o700)
    (snapshot / 'unit').write_text(unit)
    (snapshot / 'environment').write_text(env)
    (snapshot / 'record.json').write_text(json.dumps(record, indent=2, sort_keys=True) + '\n')
    for child in snapshot.iterdir():
        os.chmod(str(child), 0o600)


def tree(root):
    """Every entry under root: relative name -> ('file', bytes, mode) | ('link', target) | ('dir', mode) | (kind,)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(str(root)):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            info = os.lstat(full)
            rel = os.path.relpath(full, str(root))
            if stat.S_ISLNK(info.st_mode):
                found[rel] = ('link', os.readlink(full))
            elif stat.S_ISREG(info.st_mode):
                with open(full, 'rb') as handle:
                    found[rel] = ('file', handle.read(), stat.S_IMODE(info.st_mode))
            elif stat.S_ISDIR(info.st_mode):
                found[rel] = ('dir', stat.S_IMODE(info.st_mode))
            else:
                found[rel] = (stat.S_IFMT(info.st_mode),)
    return found


def ours(names):
    """Names only a run of the module leaves: its temporary files and its lock."""
    return sorted(n for n in names if os.path.basename(n).startswith(TEMP_PREFIX) or os.path.basename(n) == LOCK)


def run(host, args):
    """One run of the module within the deadline, its arguments file in the host's work directory."""
    host.workdir.mkdir(exist_ok=True)
    return harness.run_module(MODULE, host.workdir, args)


def detail(run_):
    return run_.result.get('msg') if run_.result else run_.stderr[-2000:]


# Setups: each changes the good host of Host.make.


def then(*setups):
    def setup(host):
        for one in setups:
            one(host)

    return setup


def fifo(*parts):
    def setup(host):
        path = os.path.join(str(host.root), *parts)
        os.unlink(path)
        os.mkfifo(path)

    return setup


def write(relative, data):
    def setup(host):
        path = host.root / relative
        if path.is_symlink() or path.exists():
            path.unlink()
        path.write_bytes(data if isinstance(data, bytes) else data.encode('utf-8'))

    return setup


def sparse(relative, size):
    def setup(host):
        with open(str(host.root / relative), 'wb') as handle:
            handle.truncate(size)

    return setup


def planted_elsewhere(host):
    """GOOD itself a link to a directory outside, with a record and a unit of an attacker's."""
    write_deployment(host.outside, 'planted', dict(GOOD_RECORD, model_path='/planted'), unit='[Service]\nUser=root\n')
    shutil.rmtree(str(host.d / GOOD))
    os.symlink(str(host.outside / 'planted'), str(host.d / GOOD))


def link_file(relative, target_relative):
    def setup(host):
        os.unlink(str(host.root / relative))
        os.symlink(str(host.root / target_relative), str(host.root / relative))

    return setup


def retarget_last_good(target):
    def setup(host):
        os.unlink(str(host.d / 'last-good'))
        os.symlink(target, str(host.d / 'last-good'))

    return setup


def renamed_with_newline(host):
    os.rename(str(host.d / GOOD), str(host.d / (GOOD + '\n')))
    retarget_last_good(GOOD + '\n')(host)


def last_good_a_directory(host):
    os.unlink(str(host.d / 'last-good'))
    (host.d / 'last-good').mkdir()


def link_named_as_a_deployment(host):
    """OLD is a link to a directory outside: neither followed nor pruned."""
    (host.outside / 'kept').mkdir()
    (host.outside / 'kept' / 'precious').write_text('x')
    os.symlink(str(host.outside / 'kept'), str(host.d / OLD))


def deployments_directory_a_link(host):
    os.rename(str(host.d), str(host.outside / 'real'))
    os.symlink(str(host.outside / 'real'), str(host.d))


def this_second_taken(host):
    """The deployments of NEW_RELEASE for the next seconds already there: the run's own name is taken."""
    now = time.time()
    for ahead in range(12):
        name = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now + ahead)) + '-' + NEW_RELEASE
        write_deployment(host.d, name, dict(NEW_RECORD, deployment=name, recorded_at='x'))


def nested(depth):
    """A JSON value that nests depth objects."""
    value = {}
    for dummy in range(depth - 1):
        value = {'a': value}
    return value


def nested_text(depth):
    return '{"release": "0123456789ab", "x": ' + '[' * depth + ']' * depth + '}'


def json_error(data):
    """What Python's json says of data, as the module quotes it."""
    try:
        json.loads(data.decode('utf-8'))
    except ValueError as exc:
        return str(exc)
    raise AssertionError('%r is valid JSON' % data)


def record_of_size(size):
    """A record option whose record.json (with the deployment and recorded_at the module adds) is size bytes."""
    probe = dict(NEW_RECORD, pad='', deployment=GOOD, recorded_at='2026-12-01T12:00:00Z')
    base = len(json.dumps(probe, indent=2, sort_keys=True)) + 1
    return dict(NEW_RECORD, pad='x' * (size - base))


# Checks of a success: check(result, host) -> bool.


def read_back(host, expected):
    """The module's own read, after the run, gives expected (or the record the run returned)."""
    again = run(host, host.args('read'))
    return bool(again.result) and not again.result.get('failed') and again.result['last_good'] == expected


def recorded_as_given(expected_extra=None, reread=False):
    """A check that the run recorded NEW_RECORD (with expected_extra) as given, and, with reread, that the
    module's own read gives it back."""

    def check(result, host):
        name = result['deployment']
        snapshot = host.d / name
        written = json.loads((snapshot / 'record.json').read_text())
        want = dict(NEW_RECORD, **(expected_extra or {}))
        return (
            bool(NAME.fullmatch(name))
            and name.endswith('-' + NEW_RELEASE)
            and os.readlink(str(host.d / 'last-good')) == name
            and written == result['record'] == result['last_good']
            and all(written[k] == v for k, v in want.items())
            and (snapshot / 'unit').read_text() == CHANGED_UNIT
            and (snapshot / 'environment').read_text() == CHANGED_ENV
            and (not reread or read_back(host, written))
        )

    return check


def recorded_with(check_record, reread=False):
    def check(result, host):
        return recorded_as_given(reread=reread)(result, host) and check_record(result['record'])

    return check


def restored_good(result, host):
    return (
        result['rolled_back'] is True
        and result['deployment'] == GOOD
        and host.unit.read_text() == GOOD_UNIT
        and host.env.read_text() == GOOD_ENV
        and stat.S_IMODE(os.stat(str(host.env)).st_mode) == 0o600
        and json.loads((host.d / 'rollbacks.json').read_text())['total'] == 1
    )


def record_kept_link(result, host):
    return (
        recorded_as_given()(result, host)
        and os.readlink(str(host.d / OLD)) == str(host.outside / 'kept')
        and (host.outside / 'kept' / 'precious').read_text() == 'x'
        and result['pruned'] == [str(host.d / GOOD), str(host.releases / '0123456789ab')]
    )


SNAP = '{d}/' + GOOD
NOT_FOLLOWED = (
    SNAP + " is a link, which is not followed (a link to '{out}/planted'; no link under {d} is followed but last-good)"
)
TOO_DEEP = ' nests arrays and objects more than %d levels deep' % MAX_RECORD_DEPTH
TOO_LARGE = ' is larger than %d bytes, the most a deployment file may hold' % MAX_FILE_BYTES
BAD_RELEASE = 'record must hold release, the 12 hexadecimal digits of the release that passed, got %s'

# (id, setup(host), (state, argument overrides), expected): expected is the exact failure message ({d}, {unit},
# {env} and {out} are the host's paths), a compiled pattern it must match in full, or check(result, host) of a success.
CASES = [
    # 1. A FIFO where a file is read: refused at once, never opened for a read that would block.
    ('record.json a FIFO', fifo('deployments', GOOD, 'record.json'), ('read', {}),
     SNAP + '/record.json is a FIFO, not a regular file: it is not read'),
    ('snapshot unit a FIFO', fifo('deployments', GOOD, 'unit'), ('restored', {}),
     SNAP + '/unit is a FIFO, not a regular file: it is not read'),
    ('snapshot environment a FIFO', fifo('deployments', GOOD, 'environment'), ('restored', {}),
     SNAP + '/environment is a FIFO, not a regular file: it is not read'),
    ('unit_file a FIFO to record', fifo('etc', 'vllm-kimi.service'), ('recorded', {}),
     '{unit} is a FIFO, not a regular file: it is not read'),
    ('environment_file a FIFO to record', fifo('etc', 'vllm-kimi.env'), ('recorded', {}),
     '{env} is a FIFO, not a regular file: it is not read'),
    ('unit_file a FIFO to restore over', fifo('etc', 'vllm-kimi.service'), ('restored', {}),
     '{unit} is a FIFO, not a regular file: it is not read'),
    ('rollbacks.json a FIFO', then(write('deployments/rollbacks.json', ''), fifo('deployments', 'rollbacks.json')),
     ('read', {}), '{d}/rollbacks.json is a FIFO, not a regular file: it is not read'),
    ('lock file a FIFO', lambda host: os.mkfifo(str(host.d / LOCK)), ('read', {}),
     'cannot lock {d}/%s: not a regular file (a FIFO)' % LOCK),
    ('unit_file a character device', lambda host: None, ('recorded', {'unit_file': '/dev/zero'}),
     '/dev/zero is a character device, not a regular file: it is not read'),
    # 2. Deep nesting: a clean failure naming the file, from the reader and the writer alike.
    ('record.json nested 100,000 deep', write('deployments/%s/record.json' % GOOD, nested_text(100000)),
     ('read', {}), SNAP + '/record.json' + TOO_DEEP),
    ('record.json nested 100,000 deep, restored', write('deployments/%s/record.json' % GOOD, nested_text(100000)),
     ('restored', {}), SNAP + '/record.json' + TOO_DEEP),
    ('record.json one level deeper than a record may', write('deployments/%s/record.json' % GOOD,
     json.dumps(dict(GOOD_RECORD, x=nested(MAX_RECORD_DEPTH)))), ('read', {}), SNAP + '/record.json' + TOO_DEEP),
    ('rollbacks.json nested 100,000 deep', write('deployments/rollbacks.json', '[' * 100000 + ']' * 100000),
     ('read', {}), '{d}/rollbacks.json nests arrays and objects more than 32 levels deep'),
    ('record option one level too deep', lambda host: None,
     ('recorded', {'record': dict(NEW_RECORD, x=nested(MAX_RECORD_DEPTH))}),
     'the record nests arrays and objects more than 32 levels deep, more than a record may: nothing was recorded'),
    ('record option as deep as a record may', lambda host: None,
     ('recorded', {'record': dict(NEW_RECORD, x=nested(MAX_RECORD_DEPTH - 1))}),
     recorded_as_given(reread=True)),
    # 3. Size: the writer refuses what its reader would, before anything is written.
    ('record one byte over the limit', lambda host: None,
     ('recorded', {'record': record_of_size(MAX_FILE_BYTES + 1)}),
     'the record is %d bytes as JSON, more than the %d bytes a record may hold: nothing was recorded'
     % (MAX_FILE_BYTES + 1, MAX_FILE_BYTES)),
    ('record at the limit', lambda host: None, ('recorded', {'record': record_of_size(MAX_FILE_BYTES)}),
     recorded_with(lambda record: len(json.dumps(record, indent=2, sort_keys=True)) + 1 == MAX_FILE_BYTES,
                   reread=True)),
    ('unit_file larger than a deployment file may be', sparse('etc/vllm-kimi.service', 2 * MAX_FILE_BYTES),
     ('recorded', {}), '{unit}' + TOO_LARGE),
    ('record.json larger than a record may be', sparse('deployments/%s/record.json' % GOOD, MAX_FILE_BYTES + 1),
     ('read', {}), SNAP + '/record.json' + TOO_LARGE),
    # 4. Names matched in full.
    ('release with a trailing newline', lambda host: None,
     ('recorded', {'record': dict(NEW_RECORD, release=NEW_RELEASE + '\n')}), BAD_RELEASE % "'fedcba987654\\n'"),
    ('release with a NUL', lambda host: None,
     ('recorded', {'record': dict(NEW_RECORD, release=NEW_RELEASE + '\0')}), BAD_RELEASE % "'fedcba987654\\x00'"),
    ('release in capitals', lambda host: None, ('recorded', {'record': dict(NEW_RECORD, release='FEDCBA987654')}),
     BAD_RELEASE % "'FEDCBA987654'"),
    ('release a number', lambda host: None, ('recorded', {'record': dict(NEW_RECORD, release=123456789012)}),
     BAD_RELEASE % '123456789012'),
    ('last-good to a name with a trailing newline', renamed_with_newline, ('read', {}),
     "{d}/last-good points to '%s\\n', which is no deployment of this directory" % GOOD),
    # 5. Links: none followed under the deployments directory but last-good.
    ('deployment directory a link elsewhere, read', planted_elsewhere, ('read', {}), NOT_FOLLOWED),
    ('deployment directory a link elsewhere, restored', planted_elsewhere, ('restored', {}), NOT_FOLLOWED),
    ('record.json a link', link_file('deployments/%s/record.json' % GOOD, 'etc/vllm-kimi.env'), ('read', {}),
     SNAP + '/record.json is a link, which is not followed'),
    ('unit_file a link to record', link_file('etc/vllm-kimi.service', 'etc/vllm-kimi.env'), ('recorded', {}),
     '{unit} is a link, which is not followed'),
    ('last-good a directory', last_good_a_directory, ('read', {}),
     '{d}/last-good is not the link to the last good deployment: Invalid argument'),
    ('last-good dangling', lambda host: shutil.rmtree(str(host.d / GOOD)), ('restored', {}), SNAP + ' is missing'),
    ('deployments directory a link', deployments_directory_a_link, ('read', {}),
     '{d} is not a directory (a link or a file there is not followed)'),
    ('a link named as a deployment is neither followed nor pruned', link_named_as_a_deployment,
     ('recorded', {'keep': 1}), record_kept_link),
    # Junk in the files read.
    ('record.json not UTF-8', write('deployments/%s/record.json' % GOOD, b'\xff{}'), ('read', {}),
     SNAP + '/record.json is not UTF-8 text: ' + "'utf-8' codec can't decode byte 0xff in position 0: invalid "
     'start byte'),
    ('record.json with a NUL', write('deployments/%s/record.json' % GOOD, b'{"release": "01\x00"}'), ('read', {}),
     SNAP + '/record.json is not valid JSON: ' + json_error(b'{"release": "01\x00"}')),
    ('record.json empty', write('deployments/%s/record.json' % GOOD, b''), ('restored', {}),
     SNAP + '/record.json is not valid JSON: ' + json_error(b'')),
    ('record.json a list', write('deployments/%s/record.json' % GOOD, '[1, 2]'), ('read', {}),
     SNAP + '/record.json does not hold a JSON object'),
    ('rollbacks.json counts true', write('deployments/rollbacks.json', '{"total": true, "last": 0}'),
     ('restored', {}), '{d}/rollbacks.json is not a rollback count ({{"total": N, "last": T}})'),
    ('rollbacks.json counts below zero', write('deployments/rollbacks.json', '{"total": -1, "last": 0}'),
     ('read', {}), '{d}/rollbacks.json is not a rollback count ({{"total": N, "last": T}})'),
    # Odd values that a record may hold: written, and read back as they were.
    ('record with lone surrogates', lambda host: None,
     ('recorded', {'record': dict(NEW_RECORD, note='\udcff\ud800')}), recorded_as_given({'note': '\udcff\ud800'}, reread=True)),
    ('record with NUL characters', lambda host: None, ('recorded', {'record': dict(NEW_RECORD, **{'a\0b': 'c\0d'})}),
     recorded_as_given({'a\0b': 'c\0d'})),
    ('record with a 4000-digit number', lambda host: None, ('recorded', {'record': dict(NEW_RECORD, n=10**3999)}),
     recorded_as_given({'n': 10**3999})),
    ('record with NaN', lambda host: None, ('recorded', {'record': dict(NEW_RECORD, x=float('nan'))}),
     recorded_with(lambda record: math.isnan(record['x']), reread=True)),
    ('record naming its own deployment', lambda host: None,
     ('recorded', {'record': dict(NEW_RECORD, deployment='../../etc', recorded_at=7)}),
     recorded_with(lambda record: record['deployment'] != '../../etc' and isinstance(record['recorded_at'], str))),
    ('record a list', lambda host: None, ('recorded', {'record': [1]}),
     re.compile(r"argument 'record' is of type .*list.* and we were unable to convert to dict.*")),
    # Options.
    ('keep 2**62', lambda host: None, ('recorded', {'keep': 2**62}), recorded_as_given()),
    ('lock_timeout negative', lambda host: None, ('read', {'lock_timeout': -1}), 'lock_timeout must be at least 0, got -1'),
    ('path relative', lambda host: None, ('read', {'path': 'relative/deployments'}),
     "path must be an absolute path, got 'relative/deployments'"),
    ('unit_file relative', lambda host: None, ('restored', {'unit_file': 'vllm-kimi.service'}),
     "unit_file must be an absolute path, got 'vllm-kimi.service'"),
    ('unit_file and environment_file one file', lambda host: None, ('restored', {'environment_file': '{unit}'}),
     'unit_file and environment_file must be two files, got {unit} for both'),
    ('unit_file a directory to restore over',
     then(lambda host: host.unit.unlink(), lambda host: host.unit.mkdir()), ('restored', {}),
     '{unit} is a directory, not a regular file: it is not read'),
    ('environment_file a directory to restore over',
     then(lambda host: host.env.unlink(), lambda host: host.env.mkdir()), ('restored', {}),
     'cannot write {env}: it is a directory'),
    ('unit_file missing to record', lambda host: host.unit.unlink(), ('recorded', {}), '{unit} is missing'),
    ('environment_file missing to restore', lambda host: host.env.unlink(), ('restored', {}), restored_good),
    ('a deployment of this second already there', this_second_taken, ('recorded', {}),
     re.compile(r'{d}/[0-9]{{8}}T[0-9]{{6}}Z-fedcba987654 is already there: a deployment of release fedcba987654 '
                r'was recorded in this same second; nothing was recorded')),
    ('restored', lambda host: None, ('restored', {}), restored_good),
    # The secrets of now, in place of the last good deployment's.
    ('environment_secrets to read', lambda host: None, ('read', {'environment_secrets': {'VLLM_API_KEY': CHANGED_SECRET}}),
     'environment_secrets applies to state restored only, not to state read'),
    ('environment_secrets with a line break', lambda host: None,
     ('restored', {'environment_secrets': {'VLLM_API_KEY': CHANGED_SECRET + '\nLD_PRELOAD=/tmp/x.so'}}),
     'environment_secrets: the value of VLLM_API_KEY holds a line break or a NUL, which an environment file cannot '
     'carry'),
    ('environment_secrets with a NUL', lambda host: None,
     ('restored', {'environment_secrets': {'VLLM_API_KEY': CHANGED_SECRET + '\0'}}),
     'environment_secrets: the value of VLLM_API_KEY holds a line break or a NUL, which an environment file cannot '
     'carry'),
    ('environment_secrets named with a newline', lambda host: None,
     ('restored', {'environment_secrets': {'VLLM_API_KEY\nLD_PRELOAD': CHANGED_SECRET}}),
     "environment_secrets: 'VLLM_API_KEY\\nLD_PRELOAD' is not the name of an environment variable"),
    ('environment_secrets a list value', lambda host: None,
     ('restored', {'environment_secrets': {'VLLM_API_KEY': [CHANGED_SECRET]}}),
     'environment_secrets: the value of VLLM_API_KEY must be a text, got list'),
    ('environment snapshot not UTF-8, with secrets', write('deployments/%s/environment' % GOOD, b'A=\xff\n'),
     ('restored', {'environment_secrets': {'VLLM_API_KEY': CHANGED_SECRET}}),
     SNAP + '/environment is not UTF-8 text: its secrets cannot be set'),
    ('restored with the key of now', lambda host: None,
     ('restored', {'environment_secrets': {'VLLM_API_KEY': CHANGED_SECRET}}),
     lambda result, host: host.env.read_text() == GOOD_ENV.replace(SECRET, CHANGED_SECRET)),
]  # fmt: skip


def formatted(value, host):
    """value with the host's paths for {d}, {unit}, {env}, {out}: a string, a pattern, or the arguments' values."""
    names = dict((k, str(v)) for k, v in host.names.items())
    if isinstance(value, str):
        return value.format(**names)
    if isinstance(value, re.Pattern):
        return re.compile(value.pattern.format(**dict((k, re.escape(v)) for k, v in names.items())))
    return value


@pytest.mark.parametrize('setup, call, expected', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, verdict, setup, call, expected):
    host = Host(tmp_path / 'host', tmp_path / 'run').make()
    setup(host)
    state, overrides = call
    args = host.args(state, **dict((k, formatted(v, host)) for k, v in overrides.items()))
    before = tree(host.root)
    run_ = run(host, args)
    after = tree(host.root)
    if callable(expected):
        outcome = harness.judge(
            run_, True, check=lambda result: expected(result, host), secrets=SECRETS, stray=ours(tree(host.root))
        )
    else:
        message = formatted(expected, host)

        def check(result):
            said = result['msg']
            named = message.fullmatch(said) if isinstance(message, re.Pattern) else said == message
            return bool(named) and after == before

        outcome = harness.judge(run_, False, check=check, secrets=SECRETS, stray=sorted(set(before) ^ set(after)))
    verdict(MODULE, outcome, detail(run_))


# Real write failures ---------------------------------------------------------------


def chattr(flag, *paths):
    subprocess.run(['chattr', flag] + [str(p) for p in paths], check=True, capture_output=True)


@pytest.fixture
def immutable(tmp_path):
    """immutable(path...) makes paths immutable (chattr +i) until the test ends; skips where that is not possible."""
    made = []
    probe = tmp_path / 'chattr-probe'
    probe.write_text('x')
    try:
        chattr('+i', probe)
        chattr('-i', probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip('chattr +i does not work in %s: %s' % (tmp_path, exc))
    probe.unlink()

    def make(*paths):
        chattr('+i', *paths)
        made.extend(paths)

    yield make
    if made:
        chattr('-i', *made)


def counted_once(host):
    (host.d / 'rollbacks.json').write_text('{"total": 1, "last": 1796126400}\n')
    return [host.d / 'rollbacks.json']


# (id, what is made immutable (host -> paths), state, expected message, a pattern where it names the new deployment)
IMMUTABLE_CASES = [
    ('environment file immutable: the unit stays', lambda host: [host.env], 'restored',
     'cannot replace {env}: Operation not permitted; nothing was changed'),
    ('rollback count immutable: unit and environment stay', counted_once, 'restored',
     'cannot replace {d}/rollbacks.json: Operation not permitted; nothing was changed'),
    ('unit directory immutable', lambda host: [host.unit.parent], 'restored',
     'cannot write {unit}: Operation not permitted (a temporary file in {unit_dir})'),
    ('deployments directory immutable', lambda host: [host.d], 'recorded',
     re.compile(r'cannot record {d}/[0-9]{{8}}T[0-9]{{6}}Z-fedcba987654: Operation not permitted; nothing was '
                r'recorded')),
]  # fmt: skip


@pytest.mark.parametrize(
    'frozen, state, expected', [c[1:] for c in IMMUTABLE_CASES], ids=[c[0] for c in IMMUTABLE_CASES]
)
def test_immutable_files(tmp_path, verdict, immutable, frozen, state, expected):
    host = Host(tmp_path / 'host', tmp_path / 'run').make()
    immutable(*frozen(host))
    before = tree(host.root)
    run_ = run(host, host.args(state))
    after = tree(host.root)
    message = formatted(expected, host)

    def check(result):
        named = message.fullmatch(result['msg']) if isinstance(message, re.Pattern) else result['msg'] == message
        return bool(named) and after == before

    outcome = harness.judge(run_, False, check=check, secrets=SECRETS, stray=sorted(set(before) ^ set(after)))
    verdict(MODULE, outcome, detail(run_))


def test_a_prune_that_fails_is_a_warning(tmp_path, verdict, immutable):
    """An old deployment that cannot be removed stays, with a warning: the new one is recorded all the same, and
    pruned lists only what was removed."""
    host = Host(tmp_path / 'host', tmp_path / 'run').make()
    immutable(host.d / GOOD / 'record.json')
    run_ = run(host, host.args('recorded', keep=1))
    warned = '%s was not pruned: Operation not permitted' % (host.d / GOOD)

    def check(result):
        return (
            recorded_as_given()(result, host)
            and result['pruned'] == [str(host.releases / '0123456789ab')]
            and warning_texts(result) == [warned]
        )

    outcome = harness.judge(run_, True, check=check, secrets=SECRETS, stray=ours(tree(host.root)))
    verdict(MODULE, outcome, detail(run_))


PAGE = 4096


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs, mounted for the test and unmounted after it; skips where mount is not permitted."""
    disk = tmp_path / 'disk'
    disk.mkdir()
    proc = subprocess.run(
        ['mount', '-t', 'tmpfs', '-o', 'size=64k', 'tmpfs', str(disk)], capture_output=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip('cannot mount a tmpfs: %s' % proc.stderr.decode('utf-8', 'replace').strip())
    yield disk
    subprocess.run(['umount', str(disk)], check=True)


def fill(disk, free_pages):
    """Fill the tmpfs, then free free_pages pages of it."""
    filler = disk / 'filler'
    handle = os.open(str(filler), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(handle, b'\0' * PAGE)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(handle)
    os.truncate(str(filler), max(0, os.path.getsize(str(filler)) - free_pages * PAGE))


# A record of three pages, beside a unit and an environment file of one page each: a record needs five pages free,
# and fails with none (at the unit), one (at the environment file) or three (half way through the record); a restore
# needs three, and fails with one (at the environment file) or two (at the rollback count).
BIG_RECORD = dict(NEW_RECORD, pad='x' * (2 * PAGE + 100))
RECORD_FREE_PAGES = (0, 1, 3, 5)
RESTORE_FREE_PAGES = (1, 2, 3)


@pytest.mark.parametrize(
    'state, free_pages',
    [('recorded', n) for n in RECORD_FREE_PAGES] + [('restored', n) for n in RESTORE_FREE_PAGES],
    ids=['recorded, %d pages free' % n for n in RECORD_FREE_PAGES]
    + ['restored, %d pages free' % n for n in RESTORE_FREE_PAGES],
)
def test_full_disk(tmp_path, verdict, small_disk, state, free_pages):
    host = Host(small_disk / 'host', tmp_path / 'run').make()
    fill(small_disk, free_pages)
    before = tree(host.root)
    run_ = run(host, host.args(state, record=BIG_RECORD) if state == 'recorded' else host.args(state))
    after = tree(host.root)
    if run_.result is not None and not run_.result.get('failed'):
        done = (
            recorded_with(lambda record: record['pad'] == BIG_RECORD['pad']) if state == 'recorded' else restored_good
        )
        outcome = harness.judge(
            run_, True, check=lambda result: done(result, host), secrets=SECRETS, stray=ours(tree(host.root))
        )
    else:
        outcome = harness.judge(
            run_,
            False,
            check=lambda result: 'No space left on device' in result['msg'] and after == before,
            secrets=SECRETS,
            stray=sorted(set(before) ^ set(after)),
        )
    verdict(MODULE, outcome, detail(run_))


# Concurrency and SIGKILL -----------------------------------------------------------


def run_together(host, tmp_path, arguments):
    """One run per arguments, all started at once, each from its own work directory."""
    runs = [None] * len(arguments)
    barrier = threading.Barrier(len(arguments))

    def one(index):
        workdir = tmp_path / ('run%d' % index)
        workdir.mkdir(exist_ok=True)
        barrier.wait()
        runs[index] = harness.run_module(MODULE, workdir, arguments[index])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(arguments))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


CONCURRENT_RUNS = 3


def test_concurrent_runs_take_turns(tmp_path, verdict):
    """Records of several releases at once, keep 1, then restores at once: last-good names a whole deployment, every
    run succeeds, every rollback is counted and the unit put back is the last good one."""
    host = Host(tmp_path / 'host', tmp_path / 'run').make()
    releases = ['%012x' % (0xABC000 + i) for i in range(CONCURRENT_RUNS)]
    for release in releases:
        (host.releases / release).mkdir()
    records = run_together(
        host,
        tmp_path,
        [host.args('recorded', keep=1, record=dict(NEW_RECORD, release=release)) for release in releases],
    )
    name = os.readlink(str(host.d / 'last-good'))
    whole = (
        NAME.fullmatch(name) is not None
        and json.loads((host.d / name / 'record.json').read_text())['deployment'] == name
        and (host.d / name / 'unit').read_text() == CHANGED_UNIT
        and not ours(tree(host.root))
    )
    for one in records:
        outcome = harness.judge(one, True, check=lambda result: whole, secrets=SECRETS)
        verdict(MODULE, outcome, detail(one) if one.result and one.result.get('failed') else 'last-good %s' % name)
    host.unit.write_text('[Service]\nUser=root\n')
    restores = run_together(host, tmp_path, [host.args('restored')] * CONCURRENT_RUNS)
    counted = json.loads((host.d / 'rollbacks.json').read_text())['total']
    good = counted == CONCURRENT_RUNS and host.unit.read_text() == CHANGED_UNIT and not ours(tree(host.root))
    for one in restores:
        outcome = harness.judge(one, True, check=lambda result: good, secrets=SECRETS)
        verdict(MODULE, outcome, detail(one) if one.result and one.result.get('failed') else 'counted %d' % counted)


KILL_ATTEMPTS = 4
# Syscalls that change the deployments directory: slowed down under strace, so that the kills land among them.
CHANGING_CALLS = 'rename,renameat,renameat2,unlink,unlinkat,symlink,symlinkat,mkdir,mkdirat,link,linkat,fsync,flock'


def slowed(argv):
    """argv run under strace with every changing syscall delayed by 20 ms, where strace can trace here."""
    strace = shutil.which('strace')
    if strace is None or subprocess.run([strace, '-o', os.devnull, 'true'], check=False).returncode != 0:
        return argv
    delay = 'inject=%s:delay_enter=20000' % CHANGING_CALLS
    return [strace, '-f', '-qq', '-o', os.devnull, '-e', 'trace=' + CHANGING_CALLS, '-e', delay] + argv


def test_sigkill_never_blocks_the_next_rollback(tmp_path, verdict):
    """SIGKILL a record or a restore at a random moment: the next restore must put back a whole good deployment."""
    host = Host(tmp_path / 'host', tmp_path / 'run').make()
    args_file = tmp_path / 'kill-args.json'
    env = dict(os.environ, PYTHONPATH=harness.COLLECTIONS_PATH)
    argv = slowed([sys.executable, '-m', 'ansible_collections.llmserve.vllm.plugins.modules.' + MODULE, str(args_file)])

    def start(args):
        args_file.write_text(json.dumps({'ANSIBLE_MODULE_ARGS': args}))
        return subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    started = time.monotonic()
    start(host.args('restored')).wait()
    duration = time.monotonic() - started
    chance = random.Random(20261203)
    for attempt in range(KILL_ATTEMPTS):
        state = ('recorded', 'restored')[attempt % 2]
        host.unit.write_text(CHANGED_UNIT)
        proc = start(host.args(state))
        time.sleep(chance.uniform(0.3, 1.0) * duration)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        name = os.readlink(str(host.d / 'last-good'))
        # Whatever last-good names now must be whole: the next restore puts back its unit.
        after_kill = run(host, host.args('restored'))
        expected_unit = (host.d / name / 'unit').read_text() if (host.d / name).is_dir() else None
        good = (
            expected_unit is not None
            and host.unit.read_text() == expected_unit
            and not any(ours(os.listdir(str(d))) for d in (host.d, host.unit.parent, host.env.parent))
        )
        outcome = harness.judge(after_kill, True, check=lambda result, good=good: good, secrets=SECRETS)
        verdict(MODULE, outcome, 'attempt %d (%s): last-good %s, %s' % (attempt, state, name, detail(after_kill)))
