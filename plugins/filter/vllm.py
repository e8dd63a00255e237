# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import re

from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.text.converters import to_text

# A pip requirement that pins one release: vllm==0.33.0 (spaces allowed around the operator; ===, the arbitrary
# equality, pins as well).
_PINNED = re.compile(r'^\s*[A-Za-z0-9][A-Za-z0-9._-]*(?:\[[^\]]*\])?\s*===?\s*([0-9][^,;\s]*)\s*(?:;.*)?$')


def vllm_flag_value(argv, flag):
    if not isinstance(argv, (list, tuple)):
        raise AnsibleFilterError('vllm_flag_value expects a list of arguments, got %s' % type(argv).__name__)
    flag = to_text(flag)
    if not flag.startswith('--'):
        raise AnsibleFilterError('vllm_flag_value expects a long option such as --max-num-seqs, got %r' % flag)
    words = [to_text(word) for word in argv]
    value = ''
    # As vLLM's argparse parser reads them: "--flag N" or "--flag=N", the last one wins.
    for position, word in enumerate(words):
        if word == flag and position + 1 < len(words):
            value = words[position + 1]
        elif word.startswith(flag + '='):
            value = word[len(flag) + 1 :]
    return value


def pinned_version(spec):
    match = _PINNED.match(to_text(spec))
    return match.group(1) if match else ''


class FilterModule:
    def filters(self):
        return {
            'vllm_flag_value': vllm_flag_value,
            'pinned_version': pinned_version,
        }
