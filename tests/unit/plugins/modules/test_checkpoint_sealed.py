# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.checkpoint_sealed as Ansible runs it: what it returns of a checkpoint root alone can change, of one
another user could, of one that is not there, and its refusal of what is no directory."""

import os
import pwd

import pytest

NOBODY = pwd.getpwnam('nobody')


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / 'kimi'
    path.mkdir()
    os.chmod(str(path), 0o755)
    (path / 'config.json').write_text('{}')
    os.chmod(str(path / 'config.json'), 0o644)
    os.symlink('kimi', str(tmp_path / 'current'))
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason='makes files of another user (chown): needs root')
@pytest.mark.parametrize('check_mode', [False, True], ids=['run', 'check mode'])
def test_the_writers_of_a_checkpoint_are_named_under_the_path_given(tmp_path, checkpoint, module_result, check_mode):
    args = {'path': str(tmp_path / 'current'), '_ansible_check_mode': check_mode}
    rc, result = module_result('checkpoint_sealed', args)
    assert rc == 0, result
    assert (result['changed'], result['exists'], result['directory'], result['writers']) == (
        False, True, str(checkpoint), []
    )  # fmt: skip
    os.chown(str(checkpoint / 'config.json'), NOBODY.pw_uid, 0)
    rc, result = module_result('checkpoint_sealed', args)
    assert rc == 0, result
    assert result['writers'] == ['%s/config.json is owned by nobody' % (tmp_path / 'current')]


def test_a_checkpoint_that_is_not_there_is_reported_absent(tmp_path, module_result):
    os.symlink('nowhere', str(tmp_path / 'dangling'))
    for path in (tmp_path / 'missing', tmp_path / 'dangling'):
        rc, result = module_result('checkpoint_sealed', {'path': str(path)})
        assert rc == 0, result
        assert (result['changed'], result['exists'], result['writers']) == (False, False, [])


def test_what_is_no_directory_is_refused_naming_it(tmp_path, checkpoint, module_result):
    rc, result = module_result('checkpoint_sealed', {'path': str(checkpoint / 'config.json')})
    assert rc == 1, result
    assert result['msg'] == 'checkpoint {0} is not a directory ({0})'.format(checkpoint / 'config.json')
