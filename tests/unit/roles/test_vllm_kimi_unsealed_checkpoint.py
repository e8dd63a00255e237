# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The preflight's refusal of a checkpoint served as it is (not staged) that a user other than root could change
(tasks/preflight.yml, llmserve.vllm.checkpoint_sealed): its entries, the directories above it and their ACLs, run by
Ansible on the role's defaults against a directory each case makes."""

import grp
import os
import pwd
import struct

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import LOAD_VLLM_KIMI_VARS, VLLM_KIMI, run_local_play

REFUSAL_BLOCK = 'Refuse a checkpoint served as it is that a user other than root could change'
REFUSAL_TASK = 'Refuse the checkpoint when a user other than root could change it'

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason='makes files of another user (chown): needs root')


def refusal_block():
    with open(os.path.join(VLLM_KIMI, 'tasks', 'preflight.yml')) as handle:
        return [task for task in yaml.safe_load(handle) if task.get('name') == REFUSAL_BLOCK]


def refusal(tmp_path, model_path, extra_vars=None):
    """The preflight's message for this checkpoint, or None where it lets it through."""
    settings = dict({'vllm_kimi_model_path': str(model_path)}, **(extra_vars or {}))
    rc, output = run_local_play(tmp_path, LOAD_VLLM_KIMI_VARS + refusal_block(), settings)
    if rc == 0:
        return None
    assert 'TASK [%s]' % REFUSAL_TASK in output and 'fatal: [localhost]' in output, output
    return output


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint root alone can change: a directory 0755 with a config, a code file and a subdirectory of weights."""
    path = tmp_path / 'kimi'
    (path / 'weights').mkdir(parents=True)
    for directory in (path, path / 'weights'):
        os.chmod(str(directory), 0o755)
    for name in ('config.json', 'modeling_kimi.py', 'weights/model-00001-of-00001.safetensors'):
        (path / name).write_text('{}')
        os.chmod(str(path / name), 0o644)
    return path


NOBODY = pwd.getpwnam('nobody')


def test_a_checkpoint_other_users_could_change_is_refused_naming_each_entry_and_why(tmp_path, checkpoint):
    """One play for the five ways (its runs are what this file costs)."""
    os.chown(str(checkpoint), NOBODY.pw_uid, 0)
    os.chown(str(checkpoint / 'modeling_kimi.py'), NOBODY.pw_uid, 0)
    os.chmod(str(checkpoint / 'weights'), 0o777)
    os.chown(str(checkpoint / 'config.json'), 0, NOBODY.pw_gid)
    os.chmod(str(checkpoint / 'config.json'), 0o664)
    os.symlink('/etc/passwd', str(checkpoint / 'tokenizer.py'))
    output = refusal(tmp_path, checkpoint)
    assert output is not None
    for reason in (
        '{p} is owned by nobody',
        '{p}/modeling_kimi.py is owned by nobody',
        '{p}/weights is writable by every user',
        '{p}/config.json is writable by group %s' % grp.getgrgid(NOBODY.pw_gid).gr_name,
        '{p}/tokenizer.py is a symbolic link',
    ):
        assert reason.format(p=checkpoint) in output, output
    assert 'set vllm_kimi_model_accept_unsealed to accept it as it is' in output, output


def grant_write(path, uid):
    """A POSIX ACL on path that lets uid write it (setfacl -m u:UID:rw), its mask read-only: ls -l shows 0644."""
    entries = [
        (0x01, 6, 0xFFFFFFFF),
        (0x02, 6, uid),
        (0x04, 4, 0xFFFFFFFF),
        (0x10, 4, 0xFFFFFFFF),
        (0x20, 4, 0xFFFFFFFF),
    ]
    os.setxattr(
        path, 'system.posix_acl_access', struct.pack('<I', 2) + b''.join(struct.pack('<HHI', *e) for e in entries)
    )


def test_a_checkpoint_in_a_directory_another_user_could_change_or_with_an_acl_is_refused(tmp_path, checkpoint):
    """One play: a parent of the link's target that every user may write, and an ACL that grants write to nobody."""
    disk = tmp_path / 'disk'
    disk.mkdir()
    os.rename(str(checkpoint), str(disk / 'kimi'))
    os.symlink('disk/kimi', str(tmp_path / 'current'))
    os.chmod(str(disk), 0o777)
    grant_write(str(disk / 'kimi' / 'modeling_kimi.py'), NOBODY.pw_uid)
    assert oct(os.stat(str(disk / 'kimi' / 'modeling_kimi.py')).st_mode & 0o777) == '0o644'
    output = refusal(tmp_path, tmp_path / 'current')
    assert output is not None
    flat = ' '.join(output.split())
    for reason in (
        '%s is writable by every user' % disk,
        '%s/modeling_kimi.py is writable by user nobody through its ACL' % (tmp_path / 'current'),
    ):
        assert reason in flat, output
    assert 'set vllm_kimi_model_accept_unsealed to accept it as it is' in flat, output


def test_a_checkpoint_only_root_can_change_passes(tmp_path, checkpoint):
    # Group root may write: it is root's own group. The directory may be reached through a link (to where the disk is).
    os.chmod(str(checkpoint / 'config.json'), 0o664)
    os.symlink(str(checkpoint), str(tmp_path / 'current'))
    assert refusal(tmp_path, checkpoint) is None
    assert refusal(tmp_path, tmp_path / 'current') is None
    # Through the link, what is in the directory is still judged.
    os.chown(str(checkpoint / 'modeling_kimi.py'), NOBODY.pw_uid, 0)
    assert '%s/modeling_kimi.py is owned by nobody' % (tmp_path / 'current') in refusal(tmp_path, tmp_path / 'current')


def test_accepting_an_unsealed_checkpoint_lets_it_through(tmp_path, checkpoint):
    os.chown(str(checkpoint / 'modeling_kimi.py'), NOBODY.pw_uid, 0)
    assert refusal(tmp_path, checkpoint, {'vllm_kimi_model_accept_unsealed': True}) is None


def test_a_staged_checkpoint_is_left_to_the_verification_and_seal(tmp_path, checkpoint):
    os.chown(str(checkpoint / 'modeling_kimi.py'), NOBODY.pw_uid, 0)
    staged = {'vllm_kimi_model_repo': 'moonshotai/Kimi-K2.5', 'vllm_kimi_model_revision': 'a' * 40}
    assert refusal(tmp_path, checkpoint, staged) is None


def test_many_entries_are_named_ten_then_counted(tmp_path, checkpoint):
    for number in range(12):
        (checkpoint / ('extra-%02d.py' % number)).write_text('')
        os.chown(str(checkpoint / ('extra-%02d.py' % number)), NOBODY.pw_uid, 0)
    output = refusal(tmp_path, checkpoint)
    assert '; and 2 more.' in output, output


def test_a_checkpoint_that_is_not_there_is_left_to_the_gpu_preflight(tmp_path):
    assert refusal(tmp_path, tmp_path / 'not-there') is None
