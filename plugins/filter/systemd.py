# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.text.converters import to_text


def _quote_word(word):
    text = to_text(word)
    if '\n' in text or '\r' in text:
        raise AnsibleFilterError(
            'systemd_exec_quote: an argument contains a line break, which systemd cannot carry: %r' % text
        )
    text = text.replace('\\', '\\\\').replace('"', '\\"').replace('$', '$$').replace('%', '%%')
    return '"%s"' % text


def systemd_exec_quote(argv):
    if not isinstance(argv, (list, tuple)):
        raise AnsibleFilterError('systemd_exec_quote expects a list of arguments, got %s' % type(argv).__name__)
    return ' '.join(_quote_word(word) for word in argv)


def systemd_env_quote(value):
    text = to_text(value)
    if '\n' in text or '\r' in text:
        raise AnsibleFilterError(
            'systemd_env_quote: a value contains a line break, which an environment file cannot carry'
        )
    # systemd expands ${VAR} and $VAR in EnvironmentFile= values; a backslash keeps "$" literal.
    return '"%s"' % text.replace('\\', '\\\\').replace('"', '\\"').replace('$', '\\$').replace('`', '\\`')


class FilterModule:
    def filters(self):
        return {
            'systemd_exec_quote': systemd_exec_quote,
            'systemd_env_quote': systemd_env_quote,
        }
