# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The pip_source_credentials filter: its input checked, the message of _pip_sources passed through."""

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.pip import pip_source_credentials


def test_the_message_names_the_setting_and_masks_the_credential():
    message = pip_source_credentials({'args': ('-i', 'https://me:hunter2@h.example/simple'), 'spec': 'vllm==0.33.0'})
    assert 'args[1] has https://****@h.example/simple' in message
    assert 'hunter2' not in message


def test_clean_sources_give_an_empty_string():
    assert pip_source_credentials({'args': [], 'spec': 'vllm==0.33.0', 'lock': ''}) == ''


@pytest.mark.parametrize(
    'sources, message',
    [
        (
            ['https://me:hunter2@h.example'],
            'pip_source_credentials expects a mapping of setting names to texts or lists, got list',
        ),
        ({'lock': None}, 'pip_source_credentials: lock must be a text or a list, got NoneType'),
        ({'port': 8000}, 'pip_source_credentials: port must be a text or a list, got int'),
    ],
    ids=['a list', 'none', 'a number'],
)
def test_wrong_input_is_refused_without_echoing_it(sources, message):
    with pytest.raises(AnsibleFilterError) as raised:
        pip_source_credentials(sources)
    assert str(raised.value) == message
