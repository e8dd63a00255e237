# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


from collections.abc import Mapping

from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.text.converters import to_text

from ansible_collections.llmserve.vllm.plugins.module_utils._shown import is_word, shown
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._systemd import (
    ENVIRONMENT_NAME_PATTERN,
    environment_name_problem,
    environment_value_problem,
    systemd_environment_value,
)

# systemd reads these at the start of an ExecStart= program, after removing its quotes (systemd.service(5), Command
# lines): - ignores its failure, @ takes argv[0] from the next word, : stops variable expansion, + runs it with full
# privileges, ! without the unit's user, | through a shell. None belongs to a program's path.
_EXEC_PREFIXES = ('-', '@', ':', '+', '!', '|')


def _quote_word(position, word):
    if not is_word(word):
        raise AnsibleFilterError(
            'systemd_exec_quote expects arguments that are texts or numbers, got %s at position %d'
            % (type(word).__name__, position)
        )
    text = to_text(word)
    # An argument may hold a secret (the value after --api-key): a refusal names its position and the cause, never
    # the argument.
    problem = environment_value_problem(text)
    if problem:
        # A unit file's line ends at a line break or a NUL: the arguments after it would be lost or misread.
        raise AnsibleFilterError(
            'systemd_exec_quote: the argument at position %d contains %s, which systemd cannot carry'
            % (position, problem)
        )
    text = text.replace('\\', '\\\\').replace('"', '\\"').replace('$', '$$').replace('%', '%%')
    return '"%s"' % text


def systemd_exec_quote(argv):
    if not isinstance(argv, (list, tuple)):
        raise AnsibleFilterError(
            # A command line given as one text may hold a key: named by its type alone.
            'systemd_exec_quote expects a list of arguments, got %s' % type(argv).__name__
        )
    # An empty ExecStart= resets the commands the unit had: the service would start nothing, or fail to load.
    if not argv:
        raise AnsibleFilterError('systemd_exec_quote expects a program and its arguments, got an empty list')
    program = argv[0]
    if is_word(program) and (to_text(program) == '' or to_text(program).startswith(_EXEC_PREFIXES)):
        raise AnsibleFilterError(
            'systemd_exec_quote expects a program that is not empty and does not start with one of %s, which '
            'systemd reads as a prefix even within quotes, got %s' % (' '.join(_EXEC_PREFIXES), shown(program))
        )
    return ' '.join(_quote_word(position, word) for position, word in enumerate(argv))


def systemd_env_quote(value):
    # The value is often a secret (an API key, a token): a refusal names its type, never the value.
    if not is_word(value):
        raise AnsibleFilterError('systemd_env_quote expects a text or a number, got %s' % type(value).__name__)
    text = to_text(value)
    problem = environment_value_problem(text)
    if problem:
        raise AnsibleFilterError(
            'systemd_env_quote: a value contains %s, which an environment file cannot carry' % problem
        )
    # systemd expands ${VAR} and $VAR in EnvironmentFile= values; a backslash keeps "$" literal.
    return systemd_environment_value(text)


def systemd_env_name(name):
    # Names are no secrets, but a refusal shows the name's faulty character only: the line it would start is the
    # operator's input, which may run on into a value.
    problem = environment_name_problem(name) if isinstance(name, str) else 'it is no text (%s)' % type(name).__name__
    if problem:
        raise AnsibleFilterError(
            'systemd_env_name: an environment variable name must match %s, and %s' % (ENVIRONMENT_NAME_PATTERN, problem)
        )
    return name


def systemd_env_name_problems(environment):
    if not isinstance(environment, Mapping):
        raise AnsibleFilterError(
            'systemd_env_name_problems expects a mapping of names to values, got %s' % type(environment).__name__
        )
    problems = []
    for position, name in enumerate(environment, start=1):
        problem = (
            environment_name_problem(name) if isinstance(name, str) else 'it is no text (%s)' % type(name).__name__
        )
        if problem:
            problems.append('name %d (counted from 1 as given): %s' % (position, problem))
    return problems


class FilterModule:
    def filters(self):
        return {
            'systemd_exec_quote': systemd_exec_quote,
            'systemd_env_quote': systemd_env_quote,
            'systemd_env_name': systemd_env_name,
            'systemd_env_name_problems': systemd_env_name_problems,
        }
