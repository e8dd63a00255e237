# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_kimi_limit_mm_per_prompt under the names vLLM's processor takes (vars/main.yml, _vllm_kimi_media_limits), as
Ansible renders it after the preflight: Kimi-K2.5's images and videos are one modality, vision_chunk."""

import json

import pytest

from ansible_collections.llmserve.vllm.tests.support import LOAD_VLLM_KIMI_VARS, run_local_play


def media_limits(tmp_path, preflight, limits=None):
    out = tmp_path / 'limits.json'
    task = {
        'ansible.builtin.copy': {'content': '{{ _vllm_kimi_media_limits | to_json }}', 'dest': str(out), 'mode': '0644'}
    }
    extra = {'__vllm_kimi_preflight': preflight}
    if limits is not None:
        extra['vllm_kimi_limit_mm_per_prompt'] = limits
    rc, output = run_local_play(tmp_path, LOAD_VLLM_KIMI_VARS + [task], extra)
    assert rc == 0, output
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    'preflight, limits, expected',
    [
        pytest.param({'unified_vision_chunk': True}, None, {'vision_chunk': 8}, id='kimi-the-defaults'),
        pytest.param({'unified_vision_chunk': True}, {'image': 4, 'video': 2}, {'vision_chunk': 6}, id='kimi-sum'),
        pytest.param(
            {'unified_vision_chunk': True},
            {'image': 8, 'audio': 1},
            {'vision_chunk': 8, 'audio': 1},
            id='kimi-others-kept',
        ),
        pytest.param(
            {'unified_vision_chunk': True},
            {'vision_chunk': 3, 'image': 8},
            {'vision_chunk': 3, 'image': 8},
            id='kimi-named-by-the-operator',
        ),
        pytest.param({'unified_vision_chunk': True}, {}, {}, id='kimi-vllms-default'),
        pytest.param({'unified_vision_chunk': False}, None, {'image': 8, 'video': 0}, id='images-and-videos-apart'),
        pytest.param({}, None, {'image': 8, 'video': 0}, id='before-the-preflight'),
    ],
)
def test_media_limits_name_the_modalities_vllm_takes(tmp_path, preflight, limits, expected):
    assert media_limits(tmp_path, preflight, limits) == expected
