# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _host_probes: holders of the port, the service's processes, /dev/shm's size."""

import os
import subprocess

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._host_probes import (
    belongs_to_service,
    port_conflict,
    process_name,
    shm_size,
)
from ansible_collections.llmserve.vllm.tests.support import named_listener


@pytest.mark.parametrize(
    'cgroup, service, expected',
    [
        ('0::/system.slice/vllm.service\n', 'vllm', True),
        ('0::/system.slice/vllm.service\n', 'vllm.service', True),
        ('0::/system.slice/vllm.service/worker\n', 'vllm', True),
        ('0::/system.slice/vllm-old.service\n', 'vllm', False),
        ('0::/user.slice/user-0.slice/session-3.scope\n', 'vllm', False),
        ('0::/system.slice/vllm.service\n', None, False),
    ],
)
def test_belongs_to_service(tmp_path, cgroup, service, expected):
    (tmp_path / '42').mkdir()
    (tmp_path / '42' / 'cgroup').write_text(cgroup)
    assert belongs_to_service(42, service, str(tmp_path)) is expected


def test_port_conflict_names_the_listener():
    with named_listener(b'llmserve-listen') as (pid, port):
        conflict = port_conflict('127.0.0.1', port, None)
        assert conflict == 'port %d is already in use by PID %d (llmserve-listen)' % (port, pid)
        assert port_conflict('127.0.0.1', port, 'no-such-unit') == conflict
    assert port_conflict('127.0.0.1', port, None) is None


def test_shm_size_is_the_filesystem_size_as_df_reports_it(tmp_path):
    df = subprocess.run(
        ['df', '--block-size=1', '--output=size', str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert shm_size(str(tmp_path)) == int(df.stdout.split()[-1])
    assert shm_size(str(tmp_path / 'absent')) is None
    (tmp_path / 'file').write_text('')
    assert shm_size(str(tmp_path / 'file' / 'shm')) is None


class StatVfs:
    """What statvfs says of a filesystem whose blocks are 4 KiB fragments of 1 MiB blocks, nearly full."""

    f_frsize = 4096
    f_bsize = 1 << 20
    f_blocks = 16384
    f_bfree = 256
    f_bavail = 128


def test_shm_size_counts_fragments_of_every_block_free_or_not(monkeypatch):
    monkeypatch.setattr(os, 'statvfs', lambda path: StatVfs())
    # 16384 fragments of 4 KiB: 64 MiB, Docker's default /dev/shm.
    assert shm_size('/dev/shm') == 64 * 1024 * 1024


def test_process_names_that_are_not_utf8_are_replaced(tmp_path):
    # A process names itself as it likes (prctl PR_SET_NAME): the name must still go back as JSON.
    (tmp_path / '42').mkdir()
    (tmp_path / '42' / 'comm').write_bytes(b'py\xff\xfe\n')
    (tmp_path / '42' / 'cgroup').write_bytes(b'0::/system.slice/vllm\xff.service\n')
    assert process_name(42, str(tmp_path)) == 'py\ufffd\ufffd'
    assert belongs_to_service(42, 'vllm\ufffd', str(tmp_path)) is True
