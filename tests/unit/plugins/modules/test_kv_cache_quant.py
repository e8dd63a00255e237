# -*- coding: utf-8 -*-
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import errno
import json
import os

import pytest

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.testing import patch_module_args

from ansible_collections.llmserve.vllm.plugins.modules import kv_cache_quant

HF_NESTED = '''{
  "producer": {"name": "modelopt", "version": "0.29.0"},
  "quantization": {
    "quant_algo": "NVFP4",
    "group_size": 16,
    "kv_cache_quant_algo": "FP8",
    "exclude_modules": ["lm_head"]
  }
}
'''
HF_STRIPPED = HF_NESTED.replace('"kv_cache_quant_algo": "FP8"', '"kv_cache_quant_algo": null')
CONFIG = '{\n  "model_type": "kimi_k25",\n  "text_config": {"model_type": "kimi_k2"}\n}\n'
RECORD = '.llmserve-kv-cache-quant.json'


WARNINGS = []


@pytest.fixture(autouse=True)
def record_warnings(monkeypatch):
    # Where module.warn() ends up depends on whether controller code was imported in this
    # process (ansible-core 2.19), so the test records the calls themselves.
    del WARNINGS[:]
    monkeypatch.setattr(AnsibleModule, 'warn', lambda self, warning: WARNINGS.append(warning))


def warning_messages(result):
    return list(WARNINGS)


def run(args, check_mode=False, diff=False):
    del WARNINGS[:]
    args = dict(args)
    args['_ansible_check_mode'] = check_mode
    args['_ansible_diff'] = diff
    with patch_module_args(args):
        with pytest.raises(SystemExit) as caught:
            kv_cache_quant.main()
    return caught.value.code


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / 'config.json').write_text(CONFIG)
    (tmp_path / 'hf_quant_config.json').write_text(HF_NESTED)
    return tmp_path


def snapshot(directory):
    return dict((p.name, p.read_bytes()) for p in sorted(directory.iterdir()))


def result_of(capsys):
    return json.loads(capsys.readouterr().out)


EXPECTED_FILES = [{'path': None, 'changes': [{'key': 'quantization.kv_cache_quant_algo', 'before': 'FP8', 'after': None}]}]


def expected_files(path):
    return [dict(EXPECTED_FILES[0], path=str(path / 'hf_quant_config.json'))]


@pytest.mark.parametrize('check_mode, diff', [(True, False), (True, True), (False, False), (False, True)],
                         ids=['check', 'check+diff', 'real', 'real+diff'])
def test_strip(checkpoint, capsys, check_mode, diff):
    before = snapshot(checkpoint)
    assert run({'path': str(checkpoint)}, check_mode=check_mode, diff=diff) == 0
    result = result_of(capsys)
    assert result['changed'] is True
    assert result['path'] == str(checkpoint)
    assert result['record'] == str(checkpoint / RECORD)
    assert result['files'] == expected_files(checkpoint)
    assert (result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == ('fp8', 'auto')
    if diff:
        assert result['diff'] == [{'before': HF_NESTED, 'after': HF_STRIPPED,
                                   'before_header': str(checkpoint / 'hf_quant_config.json'),
                                   'after_header': str(checkpoint / 'hf_quant_config.json')}]
    else:
        assert 'diff' not in result
    if check_mode:
        assert snapshot(checkpoint) == before
    else:
        assert (checkpoint / 'hf_quant_config.json').read_text() == HF_STRIPPED
        assert (checkpoint / 'config.json').read_text() == CONFIG
        record = json.loads((checkpoint / RECORD).read_text())
        assert [(e['file'], e['key'], e['before'], e['before_text'], e['after'], e['symlink'])
                for e in record['entries']] == [
            ('hf_quant_config.json', 'quantization.kv_cache_quant_algo', 'FP8', '"FP8"', None, None)]
        assert sorted(os.listdir(str(checkpoint))) == [RECORD, 'config.json', 'hf_quant_config.json']


def test_strip_twice_then_restore(checkpoint, capsys):
    before = snapshot(checkpoint)
    run({'path': str(checkpoint)})
    capsys.readouterr()
    stripped = snapshot(checkpoint)
    assert run({'path': str(checkpoint)}) == 0
    result = result_of(capsys)
    assert (result['changed'], result['files'], result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == (
        False, [], 'auto', 'auto')
    assert snapshot(checkpoint) == stripped

    assert run({'path': str(checkpoint), 'state': 'present'}, check_mode=True) == 0
    result = result_of(capsys)
    assert result['changed'] is True
    assert result['files'] == [{'path': str(checkpoint / 'hf_quant_config.json'),
                                'changes': [{'key': 'quantization.kv_cache_quant_algo', 'before': None, 'after': 'FP8'}]}]
    assert (result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == ('auto', 'fp8')
    assert snapshot(checkpoint) == stripped

    assert run({'path': str(checkpoint), 'state': 'present'}) == 0
    assert result_of(capsys)['changed'] is True
    assert snapshot(checkpoint) == before

    assert run({'path': str(checkpoint), 'state': 'present'}) == 0
    result = result_of(capsys)
    assert (result['changed'], result['files']) == (False, [])
    assert warning_messages(result) == [
        '%s in %s: no record of stripped KV-cache quantization, nothing to restore' % (RECORD, checkpoint)]


def test_backup(checkpoint, capsys):
    run({'path': str(checkpoint), 'backup': True})
    result = result_of(capsys)
    backup = result['files'][0]['backup_file']
    assert os.path.dirname(backup) == str(checkpoint)
    assert os.path.basename(backup).startswith('hf_quant_config.json.')
    with open(backup) as handle:
        assert handle.read() == HF_NESTED


def test_no_kv_cache_quantization(tmp_path, capsys):
    (tmp_path / 'config.json').write_text(CONFIG)
    assert run({'path': str(tmp_path)}) == 0
    result = result_of(capsys)
    assert (result['changed'], result['files'], result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == (
        False, [], 'auto', 'auto')
    assert warning_messages(result) == []
    assert os.listdir(str(tmp_path)) == ['config.json']


def test_other_kv_cache_quantization_warns(tmp_path, capsys):
    (tmp_path / 'hf_quant_config.json').write_text(HF_NESTED.replace('"FP8"', '"NVFP4"'))
    assert run({'path': str(tmp_path)}) == 0
    result = result_of(capsys)
    assert result['changed'] is False
    assert warning_messages(result) == [
        'hf_quant_config.json in %s: quantization.kv_cache_quant_algo is "NVFP4", '
        'not an FP8 KV cache; left unchanged' % tmp_path]


@pytest.mark.parametrize('config, message', [
    ('', 'config.json in {path} is empty'),
    ('{"quantization_config": []}', 'config.json in {path}: quantization_config must be a JSON object, not array'),
])
def test_bad_second_file_modifies_nothing(tmp_path, capsys, config, message):
    (tmp_path / 'hf_quant_config.json').write_text(HF_NESTED)
    (tmp_path / 'config.json').write_text(config)
    before = snapshot(tmp_path)
    assert run({'path': str(tmp_path)}) == 1
    result = result_of(capsys)
    assert result['failed'] is True
    assert result['msg'] == message.replace('{path}', str(tmp_path))
    assert snapshot(tmp_path) == before


def test_missing_directory_fails(tmp_path, capsys):
    assert run({'path': str(tmp_path / 'missing')}) == 1
    assert result_of(capsys)['msg'] == 'checkpoint directory %s does not exist' % (tmp_path / 'missing')


@pytest.mark.parametrize('code, cause', [(errno.EROFS, 'Read-only file system'), (errno.ENOSPC, 'No space left on device'),
                                         (errno.EDQUOT, 'Disk quota exceeded')])
def test_unwritable_directory_modifies_nothing(checkpoint, capsys, monkeypatch, code, cause):
    # Staging syncs each temporary file: where a full disk or a quota shows on NFS.
    def refuse(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, 'fsync', refuse)
    before = snapshot(checkpoint)
    assert run({'path': str(checkpoint)}) == 1
    assert result_of(capsys)['msg'] == 'cannot write hf_quant_config.json in %s: %s (a temporary file in %s)' % (
        checkpoint, cause, checkpoint)
    assert snapshot(checkpoint) == before


@pytest.mark.parametrize('check_mode', [False, True], ids=['real', 'check'])
def test_temporary_files_of_an_interrupted_run_are_removed(checkpoint, capsys, check_mode):
    stale = checkpoint / '.llmserve-kvq-0123456789abcdef'
    stale.write_text('half')
    assert run({'path': str(checkpoint)}, check_mode=check_mode) == 0
    assert result_of(capsys)['changed'] is True
    # Only a run that holds the lock may judge a temporary file stale.
    assert stale.exists() is check_mode
    assert warning_messages(None) == ([] if check_mode else ['removed %s, left by an interrupted run' % stale])
    assert not (checkpoint / '.llmserve-kv-cache-quant.lock').exists()


def test_record_is_not_written_through_a_link(checkpoint, capsys, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp('elsewhere') / 'record.json'
    elsewhere.write_text('{"entries": []}')
    os.symlink(str(elsewhere), str(checkpoint / RECORD))
    run({'path': str(checkpoint)})
    assert result_of(capsys)['changed'] is True
    assert elsewhere.read_text() == '{"entries": []}'
    assert not os.path.islink(str(checkpoint / RECORD))
    assert [e['key'] for e in json.loads((checkpoint / RECORD).read_text())['entries']] == [
        'quantization.kv_cache_quant_algo']


def test_hugging_face_cache_layout(tmp_path, capsys):
    blob = tmp_path / 'blobs' / '1234abcd'
    blob.parent.mkdir()
    blob.write_text(HF_NESTED)
    revisions = [tmp_path / 'snapshots' / rev for rev in ('rev1', 'rev2')]
    for revision in revisions:
        revision.mkdir(parents=True)
        os.symlink('../../blobs/1234abcd', str(revision / 'hf_quant_config.json'))
    run({'path': str(revisions[0])})
    assert result_of(capsys)['changed'] is True
    assert blob.read_text() == HF_NESTED
    assert not os.path.islink(str(revisions[0] / 'hf_quant_config.json'))
    assert (revisions[0] / 'hf_quant_config.json').read_text() == HF_STRIPPED
    assert os.readlink(str(revisions[1] / 'hf_quant_config.json')) == '../../blobs/1234abcd'

    run({'path': str(revisions[0]), 'state': 'present'})
    assert result_of(capsys)['changed'] is True
    assert os.readlink(str(revisions[0] / 'hf_quant_config.json')) == '../../blobs/1234abcd'
    assert sorted(os.listdir(str(revisions[0]))) == ['hf_quant_config.json']
    assert blob.read_text() == HF_NESTED
