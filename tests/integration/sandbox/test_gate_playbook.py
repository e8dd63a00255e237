# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""playbooks/gate.yml on the converged sandbox host: the role's gates asked again, nothing changed.

What serves is what was planned: asked for another context than the one the host serves, the coherence gate fails
naming both before any question, as a deploy's gate fails where a start did not take the planned flags (a deploy's
gate finding the planned context served is test_changes.py's good change).
"""

import os

from sandbox_helpers import BIN, REPO, first_failure

GATE_PLAYBOOK = os.path.join(REPO, 'playbooks', 'gate.yml')
GATE_TASK = 'Wait until vLLM answers the coherence prompt correctly'


def gate_playbook(sandbox, *extra):
    return sandbox._ansible(
        [os.path.join(BIN, 'ansible-playbook'), '-i', sandbox.inventory, '--limit', sandbox.name, GATE_PLAYBOOK]
        + list(extra)
    )


def test_a_context_served_other_than_planned_fails_the_gate_naming_both(sandbox):
    served = int(sandbox.vars['vllm_kimi_max_model_len'])
    rc, output, report = gate_playbook(sandbox, '-e', 'vllm_kimi_max_model_len=%d' % (2 * served))
    assert rc == 2, output[-3000:]
    name, result = first_failure(report, sandbox.name)
    assert name == GATE_TASK, (name, result)
    assert result['msg'] == (
        "/v1/models at http://localhost reports %d for '%s', where %d was planned: what serves was started with other "
        'settings than the plan' % (served, sandbox.vars['vllm_kimi_served_model_name'], 2 * served)
    ), result['msg']
    # Failed before it asked: no answer was judged.
    assert 'answer' not in result, result
