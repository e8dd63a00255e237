# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.progress against bad input: hostile results files, download directories, journals and options.

Every case runs the module as Ansible does (tests/adversarial/harness.py) and must end, by its deadline, in a
clean error that names the path or option and the cause, or in a success whose report is true: a job that has
ended is never reported running, a FIFO never holds the report, a journal of long lines is read in linear time.
The pure functions' properties over any input are in test_progress_properties.py.
"""

import json
import os
import socket
import time

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness

MODULE = 'progress'
RUNNING = json.dumps({'started': 1, 'finished': 0, 'ansible_job_id': 'j7.1'})
# The result of a fetch whose downloader printed its progress bars to stderr for hours: 2 MiB of JSON.
BIG_RESULT = json.dumps({'changed': True, 'rc': 0, 'stdout': '', 'stderr': 'Fetching 119 files: 42%|####\r' * 72000})
FAKE_SYSTEMCTL = '#!/bin/sh\nprintf "LoadState=loaded\\nActiveState=activating\\nInvocationID=0f2c9d4e8a1b4c5d\\n"\n'
FAKE_JOURNALCTL = '#!/bin/sh\ncat "$(dirname "$0")/journal.txt"\n'
SHARD_LINE = 'Loading safetensors checkpoint shards:  43% Completed | 51/119 [05:16<07:01, 6.2s/it]'
# Lines of 40,000 characters that a backtracking pattern reads in quadratic time: vLLM's progress bar's words
# before digits without a "/", and digits and commas (read by the figures' pattern "\b[\d,]+ GiB for CUDAGraph").
LONG = 40000
SHARD_WORDS_THEN_DIGITS = 'Loading safetensors checkpoint shards: ' + '1' * LONG
DIGITS_AND_COMMAS = '1,' * (LONG // 2)
UNIT_REFUSED = "argument 'unit' is of type str and we were unable to convert to unit_name: "
TOTAL_REFUSED = 'download.%s must be from 0 to 9223372036854775807, got '


def write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode('utf-8'))
    return str(path)


def job(tmp_path, content=RUNNING):
    return write(tmp_path / 'j7.1', content)


def fake_systemd(tmp_path, journal):
    """A bin folder whose systemctl names the unit's run and whose journalctl prints journal (bytes)."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, script in (('systemctl', FAKE_SYSTEMCTL), ('journalctl', FAKE_JOURNALCTL)):
        write(bin_dir / name, script)
        (bin_dir / name).chmod(0o755)
    write(bin_dir / 'journal.txt', journal)
    return str(bin_dir)


def run(tmp_path, args, path_prefix=None):
    started = time.monotonic()
    outcome = harness.run_module(MODULE, tmp_path, args, path_prefix=path_prefix)
    outcome.wall = time.monotonic() - started
    return outcome


def says(*parts):
    """check(result, path): the message says each part, {path} standing for the path the case made."""
    return lambda result, path=None: all(part.format(path=path) in result['msg'] for part in parts)


def running(result, path=None):
    return result['finished'] is False and result['msg'].startswith('running for ')


def ended(result, path=None):
    return result['finished'] is True and result['msg'].startswith('ended')


# --- the results file ----------------------------------------------------------------------------------------


def fifo(tmp_path):
    path = tmp_path / 'j7.1'
    os.mkfifo(str(path))
    return str(path)


def link_to_result(tmp_path):
    target = write(tmp_path / 'elsewhere', json.dumps({'changed': True}))
    os.symlink(target, str(tmp_path / 'j7.1'))
    return str(tmp_path / 'j7.1')


def unix_socket(tmp_path):
    path = str(tmp_path / 'j7.1')
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.close()
    return path


def unreadable(tmp_path):
    """A regular file this process cannot open: mode 000, or for root (who opens any mode) a write-only sysfs
    attribute, which the kernel opens for reading to no one."""
    if os.geteuid() != 0:
        path = tmp_path / 'j7.1'
        write(path, RUNNING)
        path.chmod(0)
        return str(path)
    if not os.path.exists('/sys/bus/pci/rescan'):
        pytest.skip('root on a machine without /sys/bus/pci/rescan: no file here is unreadable to root')
    return '/sys/bus/pci/rescan'


CANNOT_READ = 'cannot read the async job results file {path}: '
NOT_THE_FILE = '{path} is %s, not the file the async wrapper writes'
# (how the case makes the results file's path, whether the report should succeed, its check)
RESULTS_FILES = {
    'result over 1 MiB': (lambda t: job(t, BIG_RESULT), True, ended),
    'fifo': (fifo, False, says(NOT_THE_FILE % 'a FIFO')),
    'directory': (str, False, says(NOT_THE_FILE % 'a directory')),
    'character device': (lambda t: '/dev/zero', False, says(NOT_THE_FILE % 'a character device')),
    'symbolic link': (link_to_result, False, says(NOT_THE_FILE % 'a symbolic link')),
    'unreadable': (unreadable, False, says(CANNOT_READ + 'Permission denied')),
    'name too long': (lambda t: str(t / ('j' * 300)), False, says(CANNOT_READ + 'File name too long')),
    'unix socket': (unix_socket, False, says(CANNOT_READ + 'No such device or address')),
    'under a file': (lambda t: job(t) + '/j7.2', False, says(CANNOT_READ + 'Not a directory')),
    'not utf-8 nor json': (lambda t: job(t, b'\xff\xfe\x00{"started": 1\x00'), True, running),
    'running record': (job, True, running),
}


@pytest.mark.parametrize('make, expect_success, check', list(RESULTS_FILES.values()), ids=list(RESULTS_FILES))
def test_a_results_file(tmp_path, verdict, make, expect_success, check):
    path = make(tmp_path)
    run_ = run(tmp_path, {'results_file': path, 'wait': 0.1})
    outcome = harness.judge(run_, expect_success=expect_success, check=lambda result: check(result, path))
    verdict(MODULE, outcome, '%s (%.1f s)' % (str(run_.result)[:2000], run_.wall))


# --- the journal ---------------------------------------------------------------------------------------------


def phase(expected, line_at_most=None):
    def check(result):
        line = result['start']['line']
        return result['start']['phase'] == expected and (line_at_most is None or len(line) <= line_at_most)

    return check


# (what journalctl prints, the check). A phase's line is quoted cut to 1024 characters, the last line before any
# phase to 100, each with "... (N more characters)".
JOURNALS = {
    '50 lines of shard words then 40,000 digits': (
        '\n'.join([SHARD_WORDS_THEN_DIGITS] * 50).encode(),
        phase('starting, no progress line yet', 130),
    ),
    '50 lines of 40,000 digits and commas, then a phase': (
        '\n'.join([DIGITS_AND_COMMAS] * 50 + [SHARD_LINE]).encode(),
        phase('loading weights: shard 51 of 119'),
    ),
    'a phase line of 40,000 characters': (
        (SHARD_LINE + ' ' + 'x' * LONG).encode(),
        phase('loading weights: shard 51 of 119', 1060),
    ),
    'not utf-8 and nul bytes': (
        b'\xff\xfe\x00 garbage\n' + SHARD_LINE.encode() + b' \xc3\x28\x00\n',
        phase('loading weights: shard 51 of 119'),
    ),
    'more than journalctl may print': (
        ('%s\n' % SHARD_LINE * 60000).encode(),
        phase('starting, nothing in the journal yet'),
    ),
}


@pytest.mark.parametrize('journal, check', list(JOURNALS.values()), ids=list(JOURNALS))
def test_a_journal(tmp_path, verdict, journal, check):
    args = {'results_file': job(tmp_path), 'wait': 0.1, 'unit': 'vllm.service'}
    run_ = run(tmp_path, args, fake_systemd(tmp_path, journal))
    verdict(
        MODULE,
        harness.judge(run_, expect_success=True, check=check),
        '%s (%.1f s)' % (str(run_.result)[:2000], run_.wall),
    )


# --- the download directory ----------------------------------------------------------------------------------


def deep_tree(tmp_path, depth, name):
    """A download folder whose one file lies `depth` folders called name down, made one folder at a time (its path
    may be longer than the kernel takes in one call)."""
    root = tmp_path / 'model'
    root.mkdir()
    fd = os.open(str(root), os.O_RDONLY)
    for _level in range(depth):
        os.mkdir(name, dir_fd=fd)
        below = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = below
    with open(os.open('model.safetensors', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), 'wb') as f:
        f.write(b'x' * 700)
    os.close(fd)
    return str(root)


def odd_entries(tmp_path):
    """A download folder with a file in place, and beside it what a report must neither count nor block on."""
    root = tmp_path / 'model'
    root.mkdir()
    write(root / 'config.json', b'x' * 1000)
    os.mkfifo(str(root / 'fifo.safetensors'))
    os.symlink('/dev/zero', str(root / 'zero.safetensors'))
    os.symlink('.', str(root / 'loop'))
    os.symlink(str(root / 'config.json'), str(root / 'again.json'))
    return str(root)


def downloaded(done_bytes, files):
    return lambda result, path: (result['download']['bytes'], result['download']['files']) == (done_bytes, files)


CANNOT_LIST = 'cannot read the download directory {path}'
# (how the case makes download.path, whether the report should succeed, its check)
DOWNLOADS = {
    'a fifo': (fifo, False, says(CANNOT_LIST + ': Not a directory')),
    'not there yet': (lambda t: str(t / 'model'), True, downloaded(0, 0)),
    'odd entries': (odd_entries, True, downloaded(1000, 1)),
    '1100 folders deep': (lambda t: deep_tree(t, 1100, 'd'), True, downloaded(700, 1)),
    'deeper than a path may be': (
        lambda t: deep_tree(t, 25, 'd' * 200),
        False,
        says(CANNOT_LIST + '/' + 'd' * 200, ': File name too long'),
    ),
}


@pytest.mark.parametrize('make, expect_success, check', list(DOWNLOADS.values()), ids=list(DOWNLOADS))
def test_a_download_directory(tmp_path, verdict, make, expect_success, check):
    path = make(tmp_path)
    args = {'results_file': write(tmp_path / 'j9.9', RUNNING), 'wait': 0.1, 'download': {'path': path}}
    run_ = run(tmp_path, args)
    outcome = harness.judge(run_, expect_success=expect_success, check=lambda result: check(result, path))
    verdict(MODULE, outcome, '%s (%.1f s)' % (str(run_.result)[:2000], run_.wall))


# --- the options ---------------------------------------------------------------------------------------------

# A download of 1 byte since a report at the dawn of floats: a rate too small for its estimate to be a float.
DAWN = {'time': -1.7e308, 'bytes': 0}

# (the options beside results_file and wait, the finished job's result or None for a running job, whether the
# report should succeed, its check)
OPTIONS = {
    'unit with a nul': ({'unit': 'vllm\0.service'}, None, False, says(UNIT_REFUSED, "'vllm\\x00.service' is not")),
    'unit with a newline': ({'unit': 'vllm\n.service'}, None, False, says(UNIT_REFUSED, "'vllm\\n.service' is not")),
    'unit of 100,000 characters': (
        {'unit': 'u' * 100000},
        None,
        False,
        lambda r: r['msg'].startswith(UNIT_REFUSED) and '(99902 more characters)' in r['msg'] and len(r['msg']) < 400,
    ),
    'total_bytes negative': (
        {'download': {'total_bytes': -5}},
        None,
        False,
        says(TOTAL_REFUSED % 'total_bytes' + '-5'),
    ),
    'total_bytes beyond any float': (
        {'download': {'total_bytes': 10**400}},
        None,
        False,
        says(TOTAL_REFUSED % 'total_bytes' + '1' + '0' * 400),
    ),
    'previous started infinite': ({'previous': {'started': float('inf')}}, {'changed': True}, True, ended),
    'previous started beyond any float': ({'previous': {'started': 10**400}}, {'changed': True}, True, ended),
    'previous bytes nan': (
        {'download': {'total_bytes': 10}, 'previous': {'time': 1.0, 'bytes': float('nan')}},
        None,
        True,
        lambda r: r['download']['bytes_per_second'] is None and r['msg'].endswith('the rate at the next report'),
    ),
    'previous time at the dawn of floats': (
        {'download': {'total_bytes': 2**62}, 'previous': DAWN},
        None,
        True,
        lambda r: r['download']['bytes'] == 1 and r['download']['seconds_left'] is None,
    ),
    'previous phase_since infinite': (
        {'unit': 'vllm.service', 'previous': {'phase': 'starting, nothing in the journal yet', 'phase_since': 1e999}},
        None,
        True,
        lambda r: r['start']['phase_seconds'] == 0.0,
    ),
}


@pytest.mark.parametrize('options, result, expect_success, check', list(OPTIONS.values()), ids=list(OPTIONS))
def test_options(tmp_path, verdict, options, result, expect_success, check):
    if 'download' in options:
        model = tmp_path / 'model'
        model.mkdir()
        write(model / 'config.json', b'x')
        options = dict(options, download=dict(options['download'], path=str(model)))
    results_file = job(tmp_path, RUNNING if result is None else json.dumps(result))
    args = dict({'results_file': results_file, 'wait': 0.1}, **options)
    run_ = run(tmp_path, args, fake_systemd(tmp_path, b'') if 'unit' in options else None)
    verdict(
        MODULE,
        harness.judge(run_, expect_success=expect_success, check=check),
        '%s (%.1f s)' % (str(run_.result)[:2000], run_.wall),
    )
