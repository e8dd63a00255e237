# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What serves is what was planned, judged of the converged sandbox host's running vLLM by the role's gate module.

A deploy's coherence gate (llmserve.vllm.chat_check with the plan's max_model_len) finds the context in /v1/models
before it asks anything: the context served passes and is returned, and another one planned fails naming both, as a
deploy's gate fails where a start did not take the planned flags. (A deploy's gate finding its planned context served
is test_changes.py's good change, whose record keeps it.)
"""


def test_the_context_served_is_found_as_planned(sandbox):
    served = int(sandbox.vars['vllm_kimi_max_model_len'])
    gate = sandbox.gate(max_model_len=served)
    assert not gate['failed'], gate.get('msg')
    assert (gate['model'], gate['max_model_len']) == (sandbox.vars['vllm_kimi_served_model_name'], served), gate


def test_a_context_served_other_than_planned_fails_the_gate_naming_both(sandbox):
    served = int(sandbox.vars['vllm_kimi_max_model_len'])
    gate = sandbox.gate(max_model_len=2 * served)
    assert gate['failed']
    assert gate['msg'] == (
        "/v1/models at %s reports %d for '%s', where %d was planned: what serves was started with other settings "
        'than the plan' % (gate['url'], served, sandbox.vars['vllm_kimi_served_model_name'], 2 * served)
    ), gate['msg']
    # Failed before it asked: no answer was judged.
    assert 'answer' not in gate, gate
