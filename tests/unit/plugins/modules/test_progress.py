# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Run llmserve.vllm.progress as Ansible runs it, on results files as Ansible's async wrapper writes them.

tests/integration/sandbox/test_changes.py follows a real fetch and a real vLLM start through the role.
"""

import json
import re

import pytest

STARTED = json.dumps({'started': 1, 'finished': 0, 'ansible_job_id': 'j42.7'})
INVOCATION = '0f2c9d4e8a1b4c5d9e7f6a5b4c3d2e1f'
JOURNAL = (
    '(APIServer pid=7) INFO 12-01 10:00:01 [api_server.py:1896] vLLM API server version 0.32.0\n'
    'Loading safetensors checkpoint shards:  42% Completed | 50/119 [05:10<07:02, 6.2s/it]\r'
    'Loading safetensors checkpoint shards:  43% Completed | 51/119 [05:16<07:01, 6.2s/it]\n'
)
FAKE_SYSTEMCTL = (
    """#!/bin/sh
echo "$*" >> "$(dirname "$0")/systemctl.args"
printf 'LoadState=loaded\\nActiveState=activating\\nInvocationID=%s\\n'
"""
    % INVOCATION
)
FAKE_JOURNALCTL = r"""#!/bin/sh
dir=$(dirname "$0")
echo "$*" >> "$dir/journalctl.args"
cat "$dir/journal.txt"
"""


@pytest.fixture
def job(tmp_path):
    path = tmp_path / 'j42.7'
    path.write_text(STARTED)
    return path


def fake_systemd(tmp_path, journal=JOURNAL):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('systemctl', FAKE_SYSTEMCTL), ('journalctl', FAKE_JOURNALCTL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (bin_dir / 'journal.txt').write_text(journal)
    return bin_dir


def test_a_running_download_is_read_from_the_disk(tmp_path, job, module_result):
    model = tmp_path / 'model'
    (model / '.cache' / 'huggingface' / 'download').mkdir(parents=True)
    (model / 'config.json').write_bytes(b'x' * 1000)
    (model / 'model-00001-of-00002.safetensors').write_bytes(b'x' * 4000)
    (model / '.cache' / 'huggingface' / 'download' / 'model-00002-of-00002.safetensors.0a1b.incomplete').write_bytes(
        b'x' * 2500
    )
    # The downloader's own records are not checkpoint bytes.
    (model / '.cache' / 'huggingface' / 'download' / 'config.json.metadata').write_bytes(b'x' * 300)
    (model / 'link.json').symlink_to(model / 'config.json')
    args = dict(results_file=str(job), wait=0.2, download=dict(path=str(model), total_bytes=10000, total_files=3))
    rc, first = module_result('progress', args)
    assert rc == 0, first
    assert first['finished'] is False and first['changed'] is False
    assert first['download'] == {
        'bytes': 7500,
        'total_bytes': 10000,
        'files': 2,
        'total_files': 3,
        'bytes_per_second': None,
        'seconds_left': None,
    }
    assert first['msg'] == '7.5 kB of 10.0 kB, 2 of 3 files, the rate at the next report'

    # 2500 bytes since a report 1000 s before the first: 2.5 B/s, and the last 2500 bytes in about 1000 s more.
    previous = dict(first['sample'], time=first['sample']['time'] - 1000, bytes=5000)
    rc, second = module_result('progress', dict(args, previous=previous))
    assert rc == 0, second
    assert 2.49 <= second['download']['bytes_per_second'] <= 2.5
    assert 1000 <= second['download']['seconds_left'] <= 1005
    assert second['msg'].startswith('7.5 kB of 10.0 kB, 2 of 3 files, 2 B/s, about 16m4'), second['msg']
    assert second['sample']['started'] == first['sample']['started']


def test_a_finished_job_is_reported_at_once(tmp_path, job, module_result):
    job.write_text(json.dumps({'changed': True, 'rc': 0, 'stdout': '{}'}))
    previous = {'started': 1.0, 'time': 2.0, 'bytes': 0}
    rc, result = module_result(
        'progress', dict(results_file=str(job), wait=3600, download=dict(path=str(tmp_path)), previous=previous)
    )
    assert rc == 0, result
    assert result['finished'] is True
    assert result['msg'].startswith('ended after ')
    assert 'download' not in result


def test_a_finished_start_names_the_phase_it_reached(tmp_path, job, module_result):
    job.write_text(json.dumps({'changed': False, 'answer': 'Paris'}))
    bin_dir = fake_systemd(tmp_path)
    rc, result = module_result(
        'progress',
        dict(results_file=str(job), wait=3600, unit='vllm-kimi.service', previous={'started': 1.0}),
        path_prefix=str(bin_dir),
    )
    assert rc == 0, result
    assert result['finished'] is True
    assert result['start']['phase'] == 'loading weights: shard 51 of 119'
    assert re.match(r'ended after \S+; the start reached: loading weights: shard 51 of 119$', result['msg']), result


def test_a_start_is_read_from_the_journal_of_its_current_run(tmp_path, job, module_result):
    bin_dir = fake_systemd(tmp_path)
    rc, result = module_result(
        'progress', dict(results_file=str(job), wait=0.2, unit='vllm-kimi.service'), path_prefix=str(bin_dir)
    )
    assert rc == 0, result
    assert result['start']['phase'] == 'loading weights: shard 51 of 119'
    assert result['msg'].startswith('loading weights: shard 51 of 119 (0s in this phase, ')
    journal_args = (bin_dir / 'journalctl.args').read_text()
    assert '_SYSTEMD_INVOCATION_ID=%s + INVOCATION_ID=%s' % (INVOCATION, INVOCATION) in journal_args


def test_an_unreadable_journal_leaves_the_phase_unknown_and_the_report_stands(tmp_path, job, module_result):
    bin_dir = fake_systemd(tmp_path)
    (bin_dir / 'journalctl').write_text('#!/bin/sh\necho "No journal files were found." >&2\nexit 1\n')
    rc, result = module_result(
        'progress', dict(results_file=str(job), wait=0.2, unit='vllm-kimi.service'), path_prefix=str(bin_dir)
    )
    assert rc == 0, result
    assert result['start']['phase'] == 'starting, nothing in the journal yet'


def test_a_missing_results_file_fails_naming_it(tmp_path, module_result):
    missing = tmp_path / 'j1.1'
    rc, result = module_result('progress', dict(results_file=str(missing)))
    assert rc == 1
    assert result['msg'] == (
        'no async job results file at %s: was the task started with async and poll 0, on this host and as this '
        'user?' % missing
    )


@pytest.mark.parametrize('wait', [0, -1, 3601])
def test_a_wait_out_of_range_is_refused(job, module_result, wait):
    rc, result = module_result('progress', dict(results_file=str(job), wait=wait))
    assert rc == 1
    assert result['msg'] == 'wait must be more than 0 and at most 3600 seconds, got %s' % float(wait)


def test_download_and_unit_are_exclusive(tmp_path, job, module_result):
    rc, result = module_result('progress', dict(results_file=str(job), unit='u', download=dict(path=str(tmp_path))))
    assert rc == 1
    assert 'mutually exclusive: download|unit' in result['msg']
