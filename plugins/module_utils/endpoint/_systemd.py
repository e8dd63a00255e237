# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A systemd unit's state and journal, read with bounded commands, and the state told and judged (chat_check, progress).

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import json
import string
from typing import Any, Callable, Optional

from ansible.module_utils.common.text.converters import to_text

from ansible_collections.llmserve.vllm.plugins.module_utils import _command as command
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import format_seconds, mask

UNIT_PROPERTIES = (
    'LoadState',
    'ActiveState',
    'SubState',
    'Result',
    'NRestarts',
    'ExecMainStatus',
    'ExecMainStartTimestampMonotonic',
    'InvocationID',
)
# Seconds one `systemctl show` may take (a waiter bounds it further by what is left of its wait), and one journalctl.
UNIT_PROBE_SECONDS = 10
JOURNAL_SECONDS = 5
# _journal.JOURNAL_SCAN_LINES lines of a few hundred bytes; a journalctl that prints more is cut off.
MAX_JOURNAL_BYTES = 4 * 1024 * 1024


def environment_value_problem(text: str) -> Optional[str]:
    """What in text an environment file cannot carry ('a line break', 'a NUL'), or None."""
    if '\n' in text or '\r' in text:
        return 'a line break'
    if '\0' in text:
        return 'a NUL'
    return None


# The names an environment file carries as one variable, and every program reads as one (POSIX's portable names): a
# name with a line break would start a line of its own (LD_PRELOAD=, HOME=) in the file root's ExecStartPre=+
# commands read.
ENVIRONMENT_NAME_PATTERN = '^[A-Z_][A-Z0-9_]*$'
_NAME_START = frozenset(string.ascii_uppercase + '_')
_NAME_REST = _NAME_START | frozenset(string.digits)


def environment_name_problem(name: str) -> Optional[str]:
    """Why name is no environment variable's name ('character 4 is "\\n"', 'it is empty'), or None."""
    if not name:
        return 'it is empty'
    for position, character in enumerate(name):
        if character not in (_NAME_REST if position else _NAME_START):
            return 'character %d is %s' % (position + 1, json.dumps(character))
    return None


def systemd_environment_value(text: str) -> str:
    """text as a value of an environment file systemd reads (EnvironmentFile=): quoted, and with the characters that
    systemd would expand ($VAR, ${VAR}) or end the quote at escaped. No line break nor NUL: the caller checks."""
    return '"%s"' % text.replace('\\', '\\\\').replace('"', '\\"').replace('$', '\\$').replace('`', '\\`')


class UnitUnreadable(Exception):
    """systemctl did not tell the unit's state; msg says why."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg


def parse_unit_show(text: Any) -> dict[str, str]:
    """Parse `systemctl show -p A,B unit` output into a dict of strings."""
    state = {}
    for line in to_text(text).splitlines():
        key, sep, value = line.partition('=')
        if sep:
            state[key.strip()] = value.strip()
    return state


def unit_number(state: dict[str, str], key: str) -> int:
    """A numeric property of the unit's state (NRestarts, a timestamp); 0 where systemd gave none."""
    try:
        return int(state.get(key, ''))
    except (TypeError, ValueError):
        return 0


def describe_unit(state: dict[str, str]) -> str:
    """One parenthesis that tells the unit's state, e.g. '(ActiveState=failed, ...)'."""
    parts = []
    for key in ('ActiveState', 'SubState', 'Result', 'ExecMainStatus', 'NRestarts'):
        if state.get(key, '') != '':
            parts.append('%s=%s' % (key, state[key]))
    return '(%s)' % ', '.join(parts)


def judge_unit(unit: str, state: dict[str, str], baseline_restarts: int, max_restarts: int) -> Optional[str]:
    """Decide whether waiting on a unit still makes sense.

    Returns None while the unit may still come up, otherwise the reason to
    stop waiting at once.  The rule:
      - the unit is not loaded (no such unit) -> stop;
      - ActiveState is failed -> stop (crashed, or StartLimit reached);
      - ActiveState is inactive -> stop (stopped, or never started);
      - NRestarts grew by more than max_restarts since the wait began -> stop:
        systemd keeps restarting a crashing service (a restart loop).
    activating, deactivating, reloading and active keep the wait going, and
    so does a restart count within max_restarts: one restart after a crash or
    a deliberate kill -9 is what Restart= is for.
    """
    load = state.get('LoadState', '')
    active = state.get('ActiveState', '')
    if load and load not in ('loaded',):
        return 'The unit %s is not loaded (LoadState=%s)' % (unit, load)
    if active == 'failed':
        return 'The unit %s failed %s' % (unit, describe_unit(state))
    if active == 'inactive':
        return 'The unit %s is not running %s' % (unit, describe_unit(state))
    restarts = unit_number(state, 'NRestarts') - baseline_restarts
    if restarts > max_restarts:
        return (
            'The unit %s is in a restart loop: systemd restarted it %d times while waiting '
            '(more than max_restarts=%d) %s' % (unit, restarts, max_restarts, describe_unit(state))
        )
    return None


def unit_probe(module: Any, unit: str, api_key: Optional[str]) -> Callable[[float], dict[str, str]]:
    """probe(seconds): `systemctl show` of unit's UNIT_PROPERTIES within seconds, or UnitUnreadable."""
    systemctl = module.get_bin_path('systemctl', required=True)

    def probe(seconds: float) -> dict[str, str]:
        argv = [systemctl, 'show', '--property', ','.join(UNIT_PROPERTIES), '--', unit]
        try:
            rc, out, err = command.run(argv, seconds)
        except command.CommandTimeout:
            raise UnitUnreadable(
                'systemctl show %s did not finish within %s s' % (unit, format_seconds(seconds))
            ) from None
        except (command.CommandError, OSError) as exc:
            raise UnitUnreadable('systemctl show %s failed: %s' % (unit, exc)) from exc
        if rc != 0:
            raise UnitUnreadable(
                'systemctl show %s failed (rc=%d): %s' % (unit, rc, mask((err or out).strip(), api_key))
            )
        return parse_unit_show(out)

    return probe


def journal_reader(module: Any, unit: str, api_key: Optional[str]) -> Optional[Callable[..., str]]:
    """read(since=None, lines=None, invocation=None, timestamps=False): the unit's journal text, each line led by
    its time on CLOCK_MONOTONIC with timestamps (journalctl's short-monotonic: "[ 1234.567890] host ident[pid]: ..."),
    or None without journalctl."""
    journalctl = module.get_bin_path('journalctl')
    if journalctl is None:
        return None

    def read(
        since: Optional[int] = None,
        lines: Optional[int] = None,
        invocation: Optional[str] = None,
        timestamps: bool = False,
    ) -> str:
        cmd = [journalctl, '--output', 'short-monotonic' if timestamps else 'cat', '--no-pager', '--quiet']
        if invocation is not None:
            # One run of the unit: its processes' lines, and systemd's about it.
            cmd += ['_SYSTEMD_INVOCATION_ID=%s' % invocation, '+', 'INVOCATION_ID=%s' % invocation]
        else:
            cmd += ['--unit', unit]
        if since is not None:
            cmd += ['--since', '@%d' % since]
        if lines is not None:
            cmd += ['--lines', '%d' % lines]
        # Raises when journalctl hangs or floods; the caller then goes without the journal.
        rc, out, err = command.run(cmd, JOURNAL_SECONDS, max_output=MAX_JOURNAL_BYTES)
        # A request that failed may be logged with its Authorization header.
        return mask(out, api_key) if rc == 0 else ''

    return read
