# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the pre-load smoke (roles/vllm_kimi/files/llmserve-preload-smoke) found, as the play shows it.

PRIVATE to the collection. The smoke prints one JSON object (its report) into the journal of the unit it ran in;
report_from_journal() finds it among the journal's lines, summarize() turns it into the figures the play prints and,
where a check failed, the message the play stops with.
"""

import json
from typing import Any, Optional

CHECK_STATUSES = ('passed', 'failed', 'skipped')
# The journal's last lines quoted when the smoke printed no report (its interpreter did not start, it was killed).
JOURNAL_TAIL_LINES = 15


class SmokeReportError(ValueError):
    """The smoke's output holds no report, or one of the wrong shape."""


def report_from_journal(text: str) -> dict[str, Any]:
    """The last line of the journal's text that is a JSON object with a list of checks."""
    if not isinstance(text, str):
        raise SmokeReportError("the smoke's journal must be text, got %s" % type(text).__name__)
    lines = text.splitlines()
    for line in reversed(lines):
        line = line.strip()
        if not line.startswith('{'):
            continue
        try:
            report = json.loads(line)
        # A line nested deeper than the parser recurses is no report either.
        except (ValueError, RecursionError):
            continue
        if isinstance(report, dict) and isinstance(report.get('checks'), list):
            return report
    tail = '\n'.join(lines[-JOURNAL_TAIL_LINES:]) or '(the journal is empty)'
    raise SmokeReportError('the pre-load smoke printed no report; its journal ends:\n%s' % tail)


def _timing(seconds: Any) -> str:
    """' in N.N s' for a check's seconds; '' for anything that is no number of seconds."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return ''
    try:
        return ' in %.1f s' % seconds
    except OverflowError:
        # JSON's integers have no bound; beyond a float's range they are no time.
        return ''


def _check_line(check: dict[str, Any]) -> str:
    detail = check.get('detail') or ''
    return '%s: %s%s%s' % (
        check['name'],
        check['status'],
        _timing(check.get('seconds')),
        ' (%s)' % detail if detail else '',
    )


def _validated_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    checks = []
    for index, check in enumerate(report['checks']):
        if not isinstance(check, dict) or not isinstance(check.get('name'), str):
            raise SmokeReportError("check %d of the smoke's report has no name: %r" % (index, check))
        if check.get('status') not in CHECK_STATUSES:
            raise SmokeReportError(
                "check %s of the smoke's report has status %r, not one of %s"
                % (check['name'], check.get('status'), ', '.join(CHECK_STATUSES))
            )
        checks.append(check)
    return checks


def _device_line(report: dict[str, Any]) -> Optional[str]:
    devices = report.get('devices')
    if not isinstance(devices, list) or not devices:
        return None
    names = []
    for device in devices:
        if not isinstance(device, dict):
            continue
        if device.get('name'):
            names.append('%s %s (sm %s)' % (device.get('index', '?'), device['name'], device.get('capability', '?')))
        else:
            names.append('%s cpus %s' % (device.get('index', '?'), device.get('cpus', '?')))
    return 'devices: %s' % '; '.join(names)


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """passed (every check passed or was skipped), figures (lines for the play) and failure (the message, or '')."""
    if not isinstance(report, dict) or not isinstance(report.get('checks'), list):
        raise SmokeReportError("the smoke's report must be an object with a list of checks, got %r" % (report,))
    checks = _validated_checks(report)
    versions = report.get('versions')
    if not isinstance(versions, dict):
        versions = {}
    known = ', '.join('%s %s' % (name, versions[name]) for name in sorted(versions) if versions[name])
    figures = [
        'backend %s, %s rank(s)%s'
        % (report.get('backend', '?'), report.get('ranks', '?'), '; ' + known if known else '')
    ]
    device_line = _device_line(report)
    if device_line:
        figures.append(device_line)
    figures.extend(_check_line(check) for check in checks)
    failed = [check for check in checks if check['status'] == 'failed']
    failure = ' '.join(
        '%s failed: %s%s'
        % (
            check['name'],
            # A cause or remedy of another JSON type is shown as text.
            str(check.get('cause') or check.get('detail') or 'no cause given').rstrip('.'),
            '. Remedy: %s' % str(check['remedy']).rstrip('.') if check.get('remedy') else '',
        )
        + '.'
        for check in failed
    )
    if not failed and report.get('passed', True) is False:
        failure = 'the smoke reported a failure without naming the check that failed.'
    return {'passed': not failure, 'figures': figures, 'failure': failure}
