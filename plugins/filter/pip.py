# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


from typing import Union

from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.text.converters import to_text

from ansible_collections.llmserve.vllm.plugins.module_utils._pip_sources import credential_message


def pip_source_credentials(sources):
    if not isinstance(sources, dict):
        raise AnsibleFilterError(
            'pip_source_credentials expects a mapping of setting names to texts or lists, got %s'
            % type(sources).__name__
        )
    texts: dict[str, Union[str, list[str]]] = {}
    for name, value in sources.items():
        if isinstance(value, (list, tuple)):
            texts[to_text(name)] = [to_text(item) for item in value]
        elif isinstance(value, str):
            texts[to_text(name)] = to_text(value)
        else:
            raise AnsibleFilterError(
                'pip_source_credentials: %s must be a text or a list, got %s' % (name, type(value).__name__)
            )
    return credential_message(texts)


class FilterModule:
    def filters(self):
        return {'pip_source_credentials': pip_source_credentials}
