# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Record every task result of a run as JSON, for the sandbox tests to judge.

ansible-core 2.19 has no json callback of its own (it moved to ansible.posix).
Enabled with ANSIBLE_CALLBACK_PLUGINS=<this dir>, ANSIBLE_CALLBACKS_ENABLED=llmserve_record
and LLMSERVE_RECORD=<file>; the normal output stays as it is.
"""

DOCUMENTATION = r"""
name: llmserve_record
type: aggregate
short_description: Write each task's result per host to the JSON file named by E(LLMSERVE_RECORD)
description:
  - Test helper of the sandbox fault scenarios.
  - Writes a JSON object with C(tasks), a list of task name, host, status, result and C(seconds) (since the run began,
    when the result came in), and C(stats), the recap per host.
requirements:
  - E(LLMSERVE_RECORD) names the output file.
"""

import json
import os
import time

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = 'aggregate'
    CALLBACK_NAME = 'llmserve_record'
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self.tasks = []
        self.began = time.monotonic()

    def _record(self, result, status):
        self.tasks.append(
            {
                'task': result._task.name,
                'host': result._host.get_name(),
                'status': status,
                'result': self._clean_result(result._result),
                'seconds': round(time.monotonic() - self.began, 3),
                # When the task ended, on this machine's clock (the sandboxes share it): what a test watching the
                # host from outside lines up with the play's steps.
                'ended_at': time.time(),
            }
        )

    @staticmethod
    def _clean_result(res):
        return json.loads(json.dumps(res, default=str))

    def v2_runner_on_ok(self, result):
        self._record(result, 'changed' if result._result.get('changed') else 'ok')

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._record(result, 'ignored' if ignore_errors else 'failed')

    def v2_runner_on_skipped(self, result):
        self._record(result, 'skipped')

    def v2_runner_on_unreachable(self, result):
        self._record(result, 'unreachable')

    def v2_playbook_on_stats(self, stats):
        self._write({h: stats.summarize(h) for h in sorted(stats.processed)})

    def _write(self, stats):
        path = os.environ.get('LLMSERVE_RECORD')
        if path:
            with open(path, 'w') as f:
                json.dump({'tasks': self.tasks, 'stats': stats}, f, indent=2, sort_keys=True)
