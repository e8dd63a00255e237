# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Properties of kv_cache_quant's JSON readers and planners over generated input.

Whatever the text: the readers and planners raise nothing but KvCacheQuantError; a
strip changes exactly the FP8 KV-cache values to null and nothing else; the record
it writes restores the original text byte for byte; the KV-cache dtype is fp8 or auto.
"""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint import _kv_cache_quant as kvq
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import auto_kv_cache_dtype, is_mla

PATH = '/models/generated'
SETTINGS = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)
fp8_forms = st.sampled_from(
    [
        'FP8',
        'fp8',
        ' Fp8 ',
        {'num_bits': 8, 'type': 'float'},
        {'num_bits': 8.0, 'type': 'float'},
        {'num_bits': 8, 'type': 'float', 'dynamic': False, 'strategy': 'tensor', 'note': '\ud800 \u00e9'},
    ]
)
other_forms: st.SearchStrategy[object] = st.sampled_from(
    [
        'NVFP4',
        'INT8',
        None,
        8,
        True,
        [],
        {},
        {'num_bits': True, 'type': 'float'},
        {'num_bits': 4, 'type': 'float'},
        {'num_bits': 8, 'type': 'int'},
        {'num_bits': '8', 'type': 'float'},
    ]
)


def mostly(strategy, other):
    """``strategy`` four times in five, else ``other``: malformed input often, but not so often that it hides the rest."""
    return st.integers(0, 4).flatmap(lambda n: strategy if n else other)


kv_values = mostly(fp8_forms, other_forms | json_values)
nested_sections = st.fixed_dictionaries(
    {},
    optional={
        'quant_algo': st.sampled_from(['NVFP4', 'FP8']) | scalars,
        'kv_cache_quant_algo': kv_values,
        'kv_cache_scheme': kv_values,
    },
)
quant_sections = st.fixed_dictionaries(
    {},
    optional={
        'quant_method': st.sampled_from(['modelopt', 'modelopt_fp4', 'compressed-tensors', 'compressed_tensors', 'fp8'])
        | scalars,
        'producer': st.just({'name': 'modelopt'}) | json_values,
        'kv_cache_scheme': kv_values,
        'kv_cache_quant_algo': kv_values,
        'quantization': mostly(nested_sections, scalars),
    },
)
model_fields = st.fixed_dictionaries(
    {},
    optional={
        'model_type': st.sampled_from(['llama', 'deepseek_v3', 'kimi_k2', 'kimi_k25']) | scalars,
        'kv_lora_rank': st.sampled_from([None, 0, 512, -1, '512']),
        'torch_dtype': st.sampled_from(['bfloat16', 'float16', 'float32']) | scalars,
    },
)
configs = st.builds(
    lambda base, model, quant, text: dict(
        base,
        **dict(
            model,
            **dict(
                ({'quantization_config': quant} if quant is not None else {}),
                **({'text_config': text} if text is not None else {}),
            ),
        ),
    ),
    st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    model_fields,
    mostly(quant_sections, st.none() | scalars),
    mostly(
        st.none()
        | st.builds(lambda model, quant: dict(model, quantization_config=quant), model_fields, quant_sections),
        scalars,
    ),
)
hf_quant_configs = quant_sections
layouts = st.sampled_from([None, 2, 4, '\t'])


def render(doc, indent):
    return json.dumps(doc, indent=indent)


def config_files(texts):
    """ConfigFiles as read_checkpoint makes them, from texts; None when a text is refused (with the module's error)."""
    files = {}
    for name, text in texts.items():
        where = kvq.label(name, PATH)
        files[name] = kvq.ConfigFile(name, '%s/%s' % (PATH, name), text, kvq.parse_document(text, where), None)
    return files


@SETTINGS
@given(st.text(max_size=200) | json_values.map(json.dumps) | st.integers(1, 3000).map(lambda n: '[' * n + ']' * n))
def test_reading_any_text_gives_an_object_or_the_modules_error(text):
    try:
        doc = kvq.parse_document(text, 'config.json in ' + PATH)
    except kvq.KvCacheQuantError as exc:
        assert str(exc).startswith('config.json in %s ' % PATH)
    else:
        assert isinstance(doc, dict)


@SETTINGS
@given(st.none() | configs, st.none() | hf_quant_configs, layouts)
def test_strip_changes_only_fp8_values_and_the_record_restores_the_bytes(config, hf_quant, indent):
    texts = {}
    if config is not None:
        texts[kvq.CONFIG_JSON] = render(config, indent)
    if hf_quant is not None:
        texts[kvq.HF_QUANT_CONFIG_JSON] = render(hf_quant, indent)
    if not texts:
        return
    try:
        files = config_files(texts)
        plans, record, warnings = kvq.plan_strip(PATH, files, None)
    except kvq.KvCacheQuantError as exc:
        assert ' in %s' % PATH in str(exc)
        return
    assert kvq.checkpoint_kv_cache_dtype(files) in ('fp8', 'auto')
    assert kvq.checkpoint_kv_cache_dtype(files, plans) in ('fp8', 'auto')
    for plan in plans:
        expected = json.loads(plan.file.text)
        for change in plan.changes:
            assert kvq.classify(change['before']) == 'fp8'
            kvq.set_path(expected, change['keys'], None)
        assert kvq.canonical(json.loads(plan.new_text)) == kvq.canonical(expected)
    stripped = dict(texts, **dict((plan.file.name, plan.new_text) for plan in plans))
    if record is None:
        assert plans == []
        return
    # Through the record's own text, as state=present reads it.
    record = json.loads(kvq.render_record(record))
    assert all(kvq._entry_problem(entry) is None for entry in record['entries'])
    restored, restore_warnings = kvq.plan_restore(PATH, config_files(stripped), record)
    assert restore_warnings == []
    assert dict(texts, **dict((plan.file.name, plan.new_text) for plan in restored)) == texts


@SETTINGS
@given(
    st.none() | json_values.filter(lambda v: isinstance(v, dict)) | configs,
    st.none() | json_values.filter(lambda v: isinstance(v, dict)) | hf_quant_configs,
)
def test_kv_cache_dtype_is_fp8_or_auto(config, hf_quant):
    assert kvq.kv_cache_dtype(config or {}, hf_quant) in ('fp8', 'auto')
    # The one resolver behind it answers a cache dtype vLLM knows, or None for the model's.
    dtype, source = auto_kv_cache_dtype(config or {}, hf_quant)
    assert dtype in (None, 'fp8', 'fp8_e4m3', 'nvfp4')
    assert (source is None) <= (dtype is None)
    assert is_mla(config or {}) in (False, True)


record_entries = st.fixed_dictionaries(
    {
        'file': st.sampled_from(list(kvq.CONFIG_FILES)) | scalars,
        'path': st.sampled_from(
            [['quantization', 'kv_cache_quant_algo'], ['quantization_config', 'kv_cache_scheme'], ['model_type'], []]
        )
        | json_values,
        'before': kv_values,
    },
    optional={
        'key': st.sampled_from(['quantization.kv_cache_quant_algo', 'quantization_config.kv_cache_scheme']) | scalars,
        'before_text': st.sampled_from(['"FP8"', 'null', '{', '[' * 100]) | scalars,
        'symlink': st.none() | scalars,
    },
)


@SETTINGS
@given(
    st.fixed_dictionaries(
        {},
        optional={'entries': st.lists(record_entries, max_size=3) | json_values, 'checkpoint': st.just(PATH) | scalars},
    )
)
def test_reading_a_record_gives_valid_entries_or_the_modules_error(tmp_path_factory, record):
    directory = tmp_path_factory.mktemp('record')
    if 'checkpoint' in record and record['checkpoint'] == PATH:
        record['checkpoint'] = str(directory)
    (directory / kvq.RECORD_NAME).write_text(json.dumps(record))
    try:
        read = kvq.read_record(str(directory))
    except kvq.KvCacheQuantError as exc:
        assert str(exc).startswith(kvq.label(kvq.RECORD_NAME, str(directory)))
        return
    for entry in read['entries']:
        assert tuple(entry['path']) in kvq.kv_key_paths(entry['file'])
        assert entry['key'] == kvq.dotted(entry['path'])
