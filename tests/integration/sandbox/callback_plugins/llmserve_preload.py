# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Load the Jinja plugins a run's tasks use once, before Ansible forks its workers.

Each task runs in a worker that ansible-playbook forks, and what a worker loads is lost with it: each task would
import Ansible's filters and tests and the collection's filters anew, about half of a task's CPU time in
tests/support.py's run_local_plays (measured there). Loaded in ansible-playbook before the forks, every worker finds
them loaded; the tasks run the same plugins as before.
"""

DOCUMENTATION = r"""
name: llmserve_preload
type: aggregate
short_description: Load Ansible's filters, tests and the vars lookup, and the collection's filters, before the first task
description:
  - Test helper of tests/support.py's run_local_plays.
  - The collection's filters are those whose documentation lies in its plugins/filter/NAME.yml.
"""

import os

from ansible.plugins.callback import CallbackBase
from ansible.plugins.loader import filter_loader, lookup_loader, test_loader

FILTER_DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..', '..', 'plugins', 'filter')


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = 'aggregate'
    CALLBACK_NAME = 'llmserve_preload'
    CALLBACK_NEEDS_ENABLED = True

    def v2_playbook_on_start(self, playbook):
        # Asking for one builtin filter (test) loads them all.
        filter_loader.get_with_context('ansible.builtin.bool')
        test_loader.get_with_context('ansible.builtin.match')
        lookup_loader.get('ansible.builtin.vars', class_only=True)
        for name in sorted(os.listdir(FILTER_DOCS)):
            if name.endswith('.yml'):
                filter_loader.get_with_context('llmserve.vllm.' + name[: -len('.yml')])
