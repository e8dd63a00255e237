# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The preflight's messages in its caller's words: the options a caller maps are renamed where they stand alone, and
nowhere else."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._setting_names import (
    callers_texts,
    in_callers_words,
    unknown_setting_names,
)

ROLE = {
    'max_model_len': 'vllm_kimi_max_model_len',
    'gpu_memory_utilization': 'vllm_kimi_gpu_memory_utilization',
    'gpus': 'vllm_kimi_preflight_gpus',
    'nvidia_smi_path': 'vllm_kimi_nvidia_smi_path',
    'model_path': 'vllm_kimi_model_path',
}


@pytest.mark.parametrize(
    'text, expected',
    [
        (
            'set max_model_len to 160960 (fits at gpu_memory_utilization 0.9)',
            'set vllm_kimi_max_model_len to 160960 (fits at vllm_kimi_gpu_memory_utilization 0.9)',
        ),
        (
            'nvidia-smi not found on PATH: is the NVIDIA driver installed? (set nvidia_smi_path, or gpus to plan '
            'without GPUs)',
            'nvidia-smi not found on PATH: is the NVIDIA driver installed? (set vllm_kimi_nvidia_smi_path, or '
            'vllm_kimi_preflight_gpus to plan without GPUs)',
        ),
        (
            "max_model_len auto: 2048 tokens fit, below the model's 8192",
            "vllm_kimi_max_model_len auto: 2048 tokens fit, below the model's 8192",
        ),
        # A flag, a longer name, a dotted key and a path that hold an option's name are not the option.
        ('--max_model_len and max_model_len_fit', '--max_model_len and max_model_len_fit'),
        (
            'text_config.max_model_len and /srv/max_model_len/config.json',
            'text_config.max_model_len and /srv/max_model_len/config.json',
        ),
        (
            'gpus[0].memory_total_mib must be at least 1',
            'vllm_kimi_preflight_gpus[0].memory_total_mib must be at least 1',
        ),
        ('model_path /srv/x does not exist', 'vllm_kimi_model_path /srv/x does not exist'),
    ],
)
def test_the_options_a_caller_maps_are_named_as_it_names_them(text, expected):
    assert in_callers_words(text, ROLE) == expected


def test_without_names_the_text_is_the_modules_own():
    assert in_callers_words('set max_model_len to 1024', {}) == 'set max_model_len to 1024'


def test_an_option_whose_name_begins_another_is_not_taken_for_it():
    names = {'port': 'vllm_kimi_port', 'port_range': 'my_range'}
    assert in_callers_words('port 8000 and port_range 1-2', names) == 'vllm_kimi_port 8000 and my_range 1-2'


@pytest.mark.parametrize(
    'names, message',
    [
        ({'max_model_len': 'x', 'no_such': 'y'}, 'setting_names maps no_such, which is no option of this module'),
        ({'a': 'x', 'b': 'y'}, 'setting_names maps a, b, which are no option of this module'),
        ({'max_model_len': ' '}, 'setting_names gives max_model_len no name'),
        ({'max_model_len': 3}, 'setting_names gives max_model_len no name'),
    ],
)
def test_a_name_for_no_option_or_no_name_is_refused(names, message):
    assert unknown_setting_names(names, {'max_model_len': {}}) == message


def test_names_for_options_the_module_has_are_accepted():
    assert unknown_setting_names({'max_model_len': 'vllm_kimi_max_model_len'}, {'max_model_len': {}}) is None


@pytest.mark.parametrize(
    'text, words, expected',
    [
        (
            '/srv/kimi for max_model_len tests/config.json is not valid JSON; set max_model_len',
            ['/srv/kimi for max_model_len tests'],
            '/srv/kimi for max_model_len tests/config.json is not valid JSON; set vllm_kimi_max_model_len',
        ),
        # As repr() quotes a path with a quote and a line break in it.
        (
            '%r has gpus' % "/srv/the gpus' x\ny",
            ["/srv/the gpus' x\ny"],
            '%r has vllm_kimi_preflight_gpus' % "/srv/the gpus' x\ny",
        ),
        # A short word of the caller's inside an option's name protects nothing.
        ('set max_model_len', ['a', 'max'], 'set vllm_kimi_max_model_len'),
    ],
    ids=['a path with spaces', 'a quoted path', 'short words'],
)
def test_the_callers_own_words_are_never_renamed(text, words, expected):
    assert in_callers_words(text, ROLE, words) == expected


def test_callers_texts_are_every_text_of_the_options_but_the_names():
    params = {
        'model_path': '/srv/m',
        'setting_names': ROLE,
        'hub': {'repo': 'org/name', 'endpoint': None},
        'measurements': [{'host': 'gpu-01', 'startup': {'backends': ['CPU_MLA']}}],
        'max_model_len': 4096,
    }
    assert sorted(callers_texts(params)) == sorted(
        ['/srv/m', 'repo', 'endpoint', 'org/name', 'host', 'gpu-01', 'startup', 'backends', 'CPU_MLA']
    )
