# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A systemd unit's state and journal, read with bounded commands (chat_check, progress).

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

from typing import Any, Callable, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils import _command as command
from ansible_collections.llmserve.vllm.plugins.module_utils._chat_check import (
    JOURNAL_SECONDS,
    MAX_JOURNAL_BYTES,
    UNIT_PROPERTIES,
    CheckFailed,
    parse_unit_show,
)
from ansible_collections.llmserve.vllm.plugins.module_utils._http import format_seconds, mask


def unit_probe(module: Any, unit: str, api_key: Optional[str]) -> Callable[[float], dict[str, str]]:
    """probe(seconds): `systemctl show` of unit's UNIT_PROPERTIES within seconds, or CheckFailed."""
    systemctl = module.get_bin_path('systemctl', required=True)

    def probe(seconds: float) -> dict[str, str]:
        argv = [systemctl, 'show', '--property', ','.join(UNIT_PROPERTIES), '--', unit]
        try:
            rc, out, err = command.run(argv, seconds)
        except command.CommandTimeout:
            raise CheckFailed(
                'systemctl show %s did not finish within %s s' % (unit, format_seconds(seconds))
            ) from None
        except (command.CommandError, OSError) as exc:
            raise CheckFailed('systemctl show %s failed: %s' % (unit, exc)) from exc
        if rc != 0:
            raise CheckFailed('systemctl show %s failed (rc=%d): %s' % (unit, rc, mask((err or out).strip(), api_key)))
        return parse_unit_show(out)

    return probe


def journal_reader(module: Any, unit: str, api_key: Optional[str]) -> Optional[Callable[..., str]]:
    """read(since=None, lines=None, invocation=None): the unit's journal text, or None without journalctl."""
    journalctl = module.get_bin_path('journalctl')
    if journalctl is None:
        return None

    def read(since: Optional[int] = None, lines: Optional[int] = None, invocation: Optional[str] = None) -> str:
        cmd = [journalctl, '--output', 'cat', '--no-pager', '--quiet']
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
