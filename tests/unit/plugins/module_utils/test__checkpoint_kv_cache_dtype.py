# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""One answer to what vLLM does with --kv-cache-dtype auto, whichever module asks.

tests/fixtures/kv_cache_dtype/forms.json holds every checkpoint form the tests know, each with
vLLM 0.32.0's own answer (the KV-cache dtype its start-up resolves, with the Attention
layer's compressed-tensors rule, and whether it runs the attention as MLA), recorded by
and checked against vLLM in tests/integration/test_kv_cache_dtype_vllm.py.
"""

import json

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint import _kv_cache_quant as kvq
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import is_mla, resolve_kv_cache_dtype
from ansible_collections.llmserve.vllm.tests.support import recorded

FORMS = json.loads(recorded('kv_cache_dtype', 'forms.json'))


@pytest.mark.parametrize('form', FORMS, ids=[form['id'] for form in FORMS])
def test_preflight_and_kv_cache_quant_give_vllms_answer(tmp_path, form):
    if form['hf_quant_config'] is not None:
        (tmp_path / 'hf_quant_config.json').write_text(json.dumps(form['hf_quant_config']))
    vllm = form['vllm']['kv_cache_dtype']
    # Every form's model dtype is bfloat16: 'auto' keeps the KV cache in it.
    assert resolve_kv_cache_dtype('auto', str(tmp_path), form['config'])[0] == ('bfloat16' if vllm == 'auto' else vllm)
    assert kvq.kv_cache_dtype(form['config'], form['hf_quant_config']) == ('fp8' if vllm.startswith('fp8') else 'auto')


@pytest.mark.parametrize('form', FORMS, ids=[form['id'] for form in FORMS])
def test_mla_as_vllm_decides_it(form):
    assert is_mla(form['config']) is form['vllm']['mla']
