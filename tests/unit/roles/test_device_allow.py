# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The unit's default DeviceAllow= names open every NVIDIA device node of a real GPU host.

tests/fixtures/h200 holds /proc/devices and `ls -l /dev/nvidia* /dev/infiniband` captured on an
NVIDIA H200 host (driver and CUDA as lent to this project).
"""

import os
import re

import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO, fixture_path

DEFAULTS = os.path.join(REPO, 'roles', 'vllm_kimi', 'defaults', 'main.yml')


def char_majors():
    """name -> major of the character devices in the captured /proc/devices."""
    majors = {}
    with open(fixture_path('h200', 'proc-devices.txt')) as handle:
        for line in handle:
            if line.startswith('Block devices'):
                break
            match = re.match(r'^\s*(\d+) (\S+)$', line)
            if match:
                majors.setdefault(match.group(2), set()).add(int(match.group(1)))
    return majors


def device_nodes():
    """(path, major) of the captured NVIDIA and InfiniBand nodes."""
    nodes = []
    directory = None
    with open(fixture_path('h200', 'dev-nvidia.txt')) as handle:
        for line in handle:
            if line.endswith(':\n'):
                directory = line[:-2]
                continue
            match = re.match(r'^c\S+ +\d+ \S+ +\S+ +(\d+), +\d+ .* (\S+)$', line.rstrip('\n'))
            if match:
                name = match.group(2)
                path = name if name.startswith('/') else os.path.join(directory, name)
                nodes.append((path, int(match.group(1))))
    return nodes


def allowed():
    with open(DEFAULTS) as handle:
        return yaml.safe_load(handle)['vllm_kimi_device_allow']


def test_every_char_name_exists_on_a_real_host():
    majors = char_majors()
    missing = [entry for entry in allowed() if entry.startswith('char-') and entry[len('char-') :] not in majors]
    assert missing == []


def test_every_real_device_node_is_allowed():
    majors = char_majors()
    allowed_majors = set()
    allowed_paths = set()
    for entry in allowed():
        if entry.startswith('char-'):
            allowed_majors |= majors[entry[len('char-') :]]
        else:
            allowed_paths.add(entry)
    nodes = device_nodes()
    assert sorted(path for path, _major in nodes) == [
        '/dev/infiniband/rdma_cm',
        '/dev/nvidia-caps/nvidia-cap1',
        '/dev/nvidia-caps/nvidia-cap2',
        '/dev/nvidia-uvm',
        '/dev/nvidia-uvm-tools',
        '/dev/nvidia0',
        '/dev/nvidiactl',
    ]
    closed = [path for path, major in nodes if major not in allowed_majors and path not in allowed_paths]
    assert closed == []
