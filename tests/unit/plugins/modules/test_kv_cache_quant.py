# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import errno
import json
import os

import pytest

from ansible_collections.llmserve.vllm.plugins.modules import kv_cache_quant
from ansible_collections.llmserve.vllm.tests.support import module_args, recorded, warning_texts

KIMI = 'checkpoints/kimi-k2.5-nvfp4'
HF_NESTED = recorded(KIMI, 'hf_quant_config.json')
HF_STRIPPED = HF_NESTED.replace('"kv_cache_quant_algo": "FP8"', '"kv_cache_quant_algo": null')
CONFIG = recorded(KIMI, 'config.json')
RECORD = '.llmserve-kv-cache-quant.json'


@pytest.fixture
def run(module_result):
    """run(args, check_mode=False, diff=False) -> (rc, result): the module run as Ansible runs it."""

    def run_kv_cache_quant(args, check_mode=False, diff=False):
        return module_result('kv_cache_quant', dict(args, _ansible_check_mode=check_mode, _ansible_diff=diff))

    return run_kv_cache_quant


def run_in_process(args, capsys):
    """For the cases that patch this process (a full disk): (rc, result)."""
    with module_args(args), pytest.raises(SystemExit) as caught:
        kv_cache_quant.main()
    return caught.value.code, json.loads(capsys.readouterr().out)


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / 'checkpoint'
    path.mkdir()
    (path / 'config.json').write_text(CONFIG)
    (path / 'hf_quant_config.json').write_text(HF_NESTED)
    return path


def snapshot(directory):
    return dict((p.name, p.read_bytes()) for p in sorted(directory.iterdir()))


EXPECTED_FILES = [
    {'path': None, 'changes': [{'key': 'quantization.kv_cache_quant_algo', 'before': 'FP8', 'after': None}]}
]


def expected_files(path):
    return [dict(EXPECTED_FILES[0], path=str(path / 'hf_quant_config.json'))]


@pytest.mark.parametrize(
    'check_mode, diff',
    [(True, False), (True, True), (False, False), (False, True)],
    ids=['check', 'check+diff', 'real', 'real+diff'],
)
def test_strip(run, checkpoint, check_mode, diff):
    before = snapshot(checkpoint)
    rc, result = run({'path': str(checkpoint)}, check_mode=check_mode, diff=diff)
    assert rc == 0, result
    assert result['changed'] is True
    assert result['path'] == str(checkpoint)
    assert result['record'] == str(checkpoint / RECORD)
    assert result['files'] == expected_files(checkpoint)
    assert (result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == ('fp8', 'auto')
    assert warning_texts(result) == []
    if diff:
        assert result['diff'] == [
            {
                'before': HF_NESTED,
                'after': HF_STRIPPED,
                'before_header': str(checkpoint / 'hf_quant_config.json'),
                'after_header': str(checkpoint / 'hf_quant_config.json'),
            }
        ]
    else:
        assert 'diff' not in result
    if check_mode:
        assert snapshot(checkpoint) == before
    else:
        assert (checkpoint / 'hf_quant_config.json').read_text() == HF_STRIPPED
        assert (checkpoint / 'config.json').read_text() == CONFIG
        record = json.loads((checkpoint / RECORD).read_text())
        assert [
            (e['file'], e['key'], e['before'], e['before_text'], e['after'], e['symlink']) for e in record['entries']
        ] == [('hf_quant_config.json', 'quantization.kv_cache_quant_algo', 'FP8', '"FP8"', None, None)]
        assert sorted(os.listdir(str(checkpoint))) == [RECORD, 'config.json', 'hf_quant_config.json']


def test_strip_twice_then_restore(run, checkpoint):
    before = snapshot(checkpoint)
    assert run({'path': str(checkpoint)})[0] == 0
    stripped = snapshot(checkpoint)
    rc, result = run({'path': str(checkpoint)})
    assert rc == 0
    assert (result['changed'], result['files'], result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == (
        False,
        [],
        'auto',
        'auto',
    )
    assert snapshot(checkpoint) == stripped

    rc, result = run({'path': str(checkpoint), 'state': 'present'}, check_mode=True)
    assert rc == 0
    assert result['changed'] is True
    assert result['files'] == [
        {
            'path': str(checkpoint / 'hf_quant_config.json'),
            'changes': [{'key': 'quantization.kv_cache_quant_algo', 'before': None, 'after': 'FP8'}],
        }
    ]
    assert (result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == ('auto', 'fp8')
    assert snapshot(checkpoint) == stripped

    rc, result = run({'path': str(checkpoint), 'state': 'present'})
    assert (rc, result['changed']) == (0, True)
    assert snapshot(checkpoint) == before

    # Restored, the checkpoint is as published again: nothing to restore and nothing to warn about.
    rc, result = run({'path': str(checkpoint), 'state': 'present'})
    assert rc == 0
    assert (result['changed'], result['files'], warning_texts(result)) == (False, [], [])
    assert snapshot(checkpoint) == before


def test_a_strip_whose_record_is_gone_warns_on_present(run, checkpoint):
    assert run({'path': str(checkpoint)})[0] == 0
    (checkpoint / RECORD).unlink()
    stripped = snapshot(checkpoint)
    rc, result = run({'path': str(checkpoint), 'state': 'present'})
    assert (rc, result['changed'], result['files']) == (0, False, [])
    assert warning_texts(result) == [
        '%s in %s: no record of stripped KV-cache quantization, so hf_quant_config.json in %s: '
        'quantization.kv_cache_quant_algo (null) cannot be restored' % (RECORD, checkpoint, checkpoint)
    ]
    assert snapshot(checkpoint) == stripped


def test_backup(run, checkpoint):
    rc, result = run({'path': str(checkpoint), 'backup': True})
    assert rc == 0, result
    backup = result['files'][0]['backup_file']
    assert os.path.dirname(backup) == str(checkpoint)
    assert os.path.basename(backup).startswith('hf_quant_config.json.')
    with open(backup) as handle:
        assert handle.read() == HF_NESTED


def test_no_kv_cache_quantization(run, tmp_path):
    (tmp_path / 'config.json').write_text(CONFIG)
    rc, result = run({'path': str(tmp_path)})
    assert rc == 0
    assert (result['changed'], result['files'], result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == (
        False,
        [],
        'auto',
        'auto',
    )
    assert warning_texts(result) == []
    assert sorted(os.listdir(str(tmp_path))) == ['config.json', 'module-run']


def test_other_kv_cache_quantization_warns(run, tmp_path):
    (tmp_path / 'hf_quant_config.json').write_text(HF_NESTED.replace('"FP8"', '"NVFP4"'))
    rc, result = run({'path': str(tmp_path)})
    assert rc == 0
    assert result['changed'] is False
    assert warning_texts(result) == [
        'hf_quant_config.json in %s: quantization.kv_cache_quant_algo is "NVFP4", '
        'not an FP8 KV cache; left unchanged' % tmp_path
    ]


@pytest.mark.parametrize(
    'config, message',
    [
        ('', 'config.json in {path} is empty'),
        ('{"quantization_config": []}', 'config.json in {path}: quantization_config must be a JSON object, not array'),
    ],
)
def test_bad_second_file_modifies_nothing(run, checkpoint, config, message):
    (checkpoint / 'config.json').write_text(config)
    before = snapshot(checkpoint)
    rc, result = run({'path': str(checkpoint)})
    assert rc == 1
    assert result['failed'] is True
    assert result['msg'] == message.replace('{path}', str(checkpoint))
    assert snapshot(checkpoint) == before


def test_missing_directory_fails(run, tmp_path):
    rc, result = run({'path': str(tmp_path / 'missing')})
    assert (rc, result['msg']) == (1, 'checkpoint directory %s does not exist' % (tmp_path / 'missing'))


@pytest.mark.parametrize(
    'code, cause',
    [
        (errno.EROFS, 'Read-only file system'),
        (errno.ENOSPC, 'No space left on device'),
        (errno.EDQUOT, 'Disk quota exceeded'),
    ],
)
def test_unwritable_directory_modifies_nothing(checkpoint, capsys, monkeypatch, code, cause):
    # Staging syncs each temporary file: where a full disk or a quota shows on NFS.
    def refuse(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, 'fsync', refuse)
    before = snapshot(checkpoint)
    rc, result = run_in_process({'path': str(checkpoint)}, capsys)
    assert rc == 1
    assert result['msg'] == 'cannot write hf_quant_config.json in %s: %s (a temporary file in %s)' % (
        checkpoint,
        cause,
        checkpoint,
    )
    assert snapshot(checkpoint) == before


@pytest.mark.parametrize('check_mode', [False, True], ids=['real', 'check'])
def test_temporary_files_of_an_interrupted_run_are_removed(run, checkpoint, check_mode):
    stale = checkpoint / '.llmserve-tmp-0123456789abcdef'
    stale.write_text('half')
    rc, result = run({'path': str(checkpoint)}, check_mode=check_mode)
    assert (rc, result['changed']) == (0, True)
    # Only a run that holds the lock may judge a temporary file stale.
    assert stale.exists() is check_mode
    assert warning_texts(result) == ([] if check_mode else ['removed %s, left by an interrupted run' % stale])
    assert not (checkpoint / '.llmserve-kv-cache-quant.lock').exists()


def test_record_is_not_written_through_a_link(run, checkpoint, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp('elsewhere') / 'record.json'
    elsewhere.write_text('{"entries": []}')
    os.symlink(str(elsewhere), str(checkpoint / RECORD))
    rc, result = run({'path': str(checkpoint)})
    assert (rc, result['changed']) == (0, True)
    assert elsewhere.read_text() == '{"entries": []}'
    assert not os.path.islink(str(checkpoint / RECORD))
    assert [e['key'] for e in json.loads((checkpoint / RECORD).read_text())['entries']] == [
        'quantization.kv_cache_quant_algo'
    ]


def test_hugging_face_cache_layout(run, tmp_path):
    blob = tmp_path / 'blobs' / '1234abcd'
    blob.parent.mkdir()
    blob.write_text(HF_NESTED)
    revisions = [tmp_path / 'snapshots' / rev for rev in ('rev1', 'rev2')]
    for revision in revisions:
        revision.mkdir(parents=True)
        os.symlink('../../blobs/1234abcd', str(revision / 'hf_quant_config.json'))
    rc, result = run({'path': str(revisions[0])})
    assert (rc, result['changed']) == (0, True)
    assert blob.read_text() == HF_NESTED
    assert not os.path.islink(str(revisions[0] / 'hf_quant_config.json'))
    assert (revisions[0] / 'hf_quant_config.json').read_text() == HF_STRIPPED
    assert os.readlink(str(revisions[1] / 'hf_quant_config.json')) == '../../blobs/1234abcd'

    rc, result = run({'path': str(revisions[0]), 'state': 'present'})
    assert (rc, result['changed']) == (0, True)
    assert os.readlink(str(revisions[0] / 'hf_quant_config.json')) == '../../blobs/1234abcd'
    assert sorted(os.listdir(str(revisions[0]))) == ['hf_quant_config.json']
    assert blob.read_text() == HF_NESTED
