# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve-own-tree, root's open and seal passes over a revision the fetch's user owns, run for real as root against
another user's concurrent swaps of directories for links (the role stops the fetch's unit first; this proves the
passes need not rely on that)."""

import grp
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile

import pytest

PROGRAM = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'roles', 'vllm_kimi', 'files', 'llmserve-own-tree')
# The system's interpreter, as the role runs it.
PYTHON = '/usr/bin/python3'
PASSES = 50

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chowns to another user's: needs root")

NOBODY = pwd.getpwnam('nobody')
# The seal's group in these tests: any group but root's, so that a followed chown would show on a root:root canary.
SEAL_GROUP = grp.getgrgid(NOBODY.pw_gid).gr_name

# As the fetch's user: swaps the revision's inner directory for a link to the canary's directory of the same shape
# and back, as fast as it can, until it is told to stop; then says how many swaps it made.
SWAPPER = r"""
import os, signal, sys
revision, canary = sys.argv[1:3]
inner, away = os.path.join(revision, 'sub'), os.path.join(revision, 'sub.away')
swaps = 0
def stop(signum, frame):
    print(swaps, flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    try:
        # Back first: a pass that took the tree back while the directory was away must not end the swaps.
        if os.path.lexists(away):
            if os.path.islink(inner):
                os.unlink(inner)
            os.rename(away, inner)
        os.rename(inner, away)
        os.symlink(canary, inner)
        swaps += 1
    except OSError:
        pass
"""


def own_tree(*args):
    return subprocess.run([PYTHON, '-I', PROGRAM] + list(args), capture_output=True, text=True, check=False)


def state(top):
    """{relative path: (uid, gid, mode)} of everything under top, top included, links not followed."""
    found = {'.': os.lstat(top)}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            found[os.path.relpath(os.path.join(dirpath, name), top)] = os.lstat(os.path.join(dirpath, name))
    return {path: (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) for path, info in found.items()}


@pytest.fixture
def place():
    """A directory the fetch's user can reach (pytest's own tmp_path is root's alone)."""
    path = tempfile.mkdtemp(prefix='llmserve-own-tree-')
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def make_tree(top, mode):
    """A tree shaped as the revision's inner directory: sub/, sub/deeper/, sub/file, sub/deeper/file."""
    os.makedirs(os.path.join(top, 'sub', 'deeper'))
    for name in ('sub/file', 'sub/deeper/file'):
        with open(os.path.join(top, name), 'w') as handle:
            handle.write('x')
    for path in (top, os.path.join(top, 'sub'), os.path.join(top, 'sub', 'deeper')):
        os.chmod(path, mode | 0o111)
    for name in ('sub/file', 'sub/deeper/file'):
        os.chmod(os.path.join(top, name), mode)


def test_open_gives_the_directories_to_the_user_and_seal_takes_everything_back(place):
    revision = os.path.join(place, 'revision')
    make_tree(revision, 0o644)
    os.symlink('/etc/passwd', os.path.join(revision, 'link'))
    opened = own_tree('open', revision, '--user', 'nobody')
    assert opened.returncode == 0, opened.stderr
    assert sorted(opened.stdout.split()) == sorted([revision, revision + '/sub', revision + '/sub/deeper'])
    nobody = (NOBODY.pw_uid, NOBODY.pw_gid)
    assert {path: owner[:2] for path, owner in state(revision).items() if path != 'link'} == {
        '.': nobody,
        'sub': nobody,
        'sub/deeper': nobody,
        'sub/file': (0, 0),
        'sub/deeper/file': (0, 0),
    }
    # What the fetch's user writes: its own file, writable by everyone.
    with open(os.path.join(revision, 'sub', 'new'), 'w') as handle:
        handle.write('y')
    os.chown(os.path.join(revision, 'sub', 'new'), *nobody)
    os.chmod(os.path.join(revision, 'sub', 'new'), 0o666)
    sealed = own_tree('seal', revision, '--group', SEAL_GROUP)
    assert sealed.returncode == 0, sealed.stderr
    seal_group = (0, NOBODY.pw_gid)
    after = state(revision)
    assert after.pop('link')[:2] == (0, 0), 'the link itself is left as it is'
    assert {path: owner[:2] for path, owner in after.items()} == dict.fromkeys(after, seal_group)
    assert after['sub/new'][2] == 0o644
    # Only what was not sealed yet: a second seal changes nothing (a sealed file keeps its ctime).
    again = own_tree('seal', revision, '--group', SEAL_GROUP)
    assert (again.returncode, again.stdout) == (0, '')


def test_a_link_as_the_top_is_refused():
    result = own_tree('seal', '/proc/self/cwd', '--group', SEAL_GROUP)
    assert result.returncode == 1 and 'is not a directory this can walk (a link is refused)' in result.stderr


@pytest.mark.parametrize(
    'args, message',
    [
        (['open', '/tmp'], 'open takes --user, seal takes --group'),
        (['seal', '/tmp', '--user', 'nobody'], 'open takes --user, seal takes --group'),
        (
            ['open', '/tmp', '--user', 'llmserve-no-such-user'],
            'no such user or group: "getpwnam(): name not found: \'llmserve-no-such-user\'"',
        ),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(args, message):
    result = own_tree(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_root_canary_stays_as_it_was_while_the_fetch_user_swaps_a_directory_for_a_link_to_it(place):
    """50 open and seal passes while the fetch's user swaps the inner directory for a link to a root-owned canary of
    the same shape. A pass that resolved a path through the link (chown -h on sub/deeper once sub is the link, or
    chmod on sub) would change the canary's owner, group or mode."""
    revision, canary = os.path.join(place, 'revision'), os.path.join(place, 'canary')
    make_tree(revision, 0o644)
    # Writable by everyone, so that a followed seal (go-w) would show in its modes too.
    make_tree(canary, 0o666)
    os.chmod(canary, 0o755)
    before = state(canary)
    swapper = subprocess.Popen(
        ['setpriv', '--reuid=nobody', '--regid=%d' % NOBODY.pw_gid, '--clear-groups', PYTHON, '-I', '-c', SWAPPER]
        + [revision, os.path.join(canary, 'sub')],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for number in range(PASSES):
            for args in (['open', revision, '--user', 'nobody'], ['seal', revision, '--group', SEAL_GROUP]):
                result = own_tree(*args)
                assert result.returncode == 0, (number, args, result.stderr)
    finally:
        swapper.send_signal(signal.SIGTERM)
        swaps = int(swapper.communicate(timeout=30)[0] or 0)
    assert swaps > PASSES, 'the fetch user swapped %d times only: the race was not run' % swaps
    assert state(canary) == before
