# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import json
import os

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint import _kv_cache_quant as kvq
from ansible_collections.llmserve.vllm.tests.support import TRAILING_COMMA_ERROR, recorded

FP8_SCHEME = '{"dynamic": false, "num_bits": 8, "type": "float"}'
CT_SCHEME = '{"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false, "symmetric": true}'

HF_NESTED = recorded('checkpoints', 'kimi-k2.5-nvfp4', 'hf_quant_config.json')
KIMI_CONFIG = recorded('checkpoints', 'kimi-k2.5-nvfp4', 'config.json')


def write(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return str(tmp_path)


# (case id, files, expected new texts (only the files that change), keys changed, dtype before, dtype after)
STRIP_CASES = [
    (
        'hf_quant_config nested modelopt (Kimi-K2.5 layout)',
        {'config.json': KIMI_CONFIG, 'hf_quant_config.json': HF_NESTED},
        {'hf_quant_config.json': HF_NESTED.replace('"kv_cache_quant_algo": "FP8"', '"kv_cache_quant_algo": null')},
        {'hf_quant_config.json': [('quantization.kv_cache_quant_algo', 'FP8')]},
        'fp8',
        'auto',
    ),
    (
        'config.json modelopt flat kv_cache_scheme object, 4-space indent, no trailing newline',
        {
            'config.json': '{\n    "quantization_config": {\n        "quant_method": "modelopt",\n        "quant_algo": "NVFP4",\n'
            '        "kv_cache_scheme": {\n            "dynamic": false,\n            "num_bits": 8,\n'
            '            "type": "float"\n        },\n        "ignore": ["lm_head"]\n    },\n    "rms_norm_eps": 1e-6\n}'
        },
        {
            'config.json': '{\n    "quantization_config": {\n        "quant_method": "modelopt",\n        "quant_algo": "NVFP4",\n'
            '        "kv_cache_scheme": null,\n        "ignore": ["lm_head"]\n    },\n    "rms_norm_eps": 1e-6\n}'
        },
        {'config.json': [('quantization_config.kv_cache_scheme', {'dynamic': False, 'num_bits': 8, 'type': 'float'})]},
        'fp8',
        'auto',
    ),
    (
        'config.json modelopt kv_cache_scheme string form',
        {
            'config.json': '{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": "FP8"}}'
        },
        {
            'config.json': '{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": null}}'
        },
        {'config.json': [('quantization_config.kv_cache_scheme', 'FP8')]},
        'fp8',
        'auto',
    ),
    (
        'config.json modelopt flat kv_cache_quant_algo, lower case',
        {
            'config.json': '{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "fp8"}}\n'
        },
        {
            'config.json': '{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": null}}\n'
        },
        {'config.json': [('quantization_config.kv_cache_quant_algo', 'fp8')]},
        'fp8',
        'auto',
    ),
    (
        'config.json quantization_config embedding the nested ModelOpt form',
        {
            'config.json': '{"quantization_config": {"producer": {"name": "modelopt"}, '
            '"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}}}'
        },
        {
            'config.json': '{"quantization_config": {"producer": {"name": "modelopt"}, '
            '"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null}}}'
        },
        {'config.json': [('quantization_config.quantization.kv_cache_quant_algo', 'FP8')]},
        'fp8',
        'auto',
    ),
    (
        'compressed-tensors kv_cache_scheme, standard attention',
        {
            'config.json': '{\n  "num_key_value_heads": 8,\n  "quantization_config": {\n    "config_groups": {},\n'
            '    "kv_cache_scheme": ' + CT_SCHEME + ',\n    "quant_method": "compressed-tensors"\n  }\n}\n'
        },
        {
            'config.json': '{\n  "num_key_value_heads": 8,\n  "quantization_config": {\n    "config_groups": {},\n'
            '    "kv_cache_scheme": null,\n    "quant_method": "compressed-tensors"\n  }\n}\n'
        },
        {'config.json': [('quantization_config.kv_cache_scheme', json.loads(CT_SCHEME))]},
        'fp8',
        'auto',
    ),
    (
        'compressed-tensors kv_cache_scheme on an MLA model: vLLM keeps auto',
        {
            'config.json': '{"model_type": "deepseek_v3", "kv_lora_rank": 512, "quantization_config": '
            '{"quant_method": "compressed-tensors", "kv_cache_scheme": ' + CT_SCHEME + '}}'
        },
        {
            'config.json': '{"model_type": "deepseek_v3", "kv_lora_rank": 512, "quantization_config": '
            '{"quant_method": "compressed-tensors", "kv_cache_scheme": null}}'
        },
        {'config.json': [('quantization_config.kv_cache_scheme', json.loads(CT_SCHEME))]},
        'auto',
        'auto',
    ),
    (
        'text_config quantization_config (multimodal), modelopt: vLLM 0.32.0 resolves auto from the top level only',
        {
            'config.json': '{"model_type": "kimi_k25", "text_config": {"quantization_config": '
            '{"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": ' + FP8_SCHEME + '}}}'
        },
        {
            'config.json': '{"model_type": "kimi_k25", "text_config": {"quantization_config": '
            '{"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": null}}}'
        },
        {'config.json': [('text_config.quantization_config.kv_cache_scheme', json.loads(FP8_SCHEME))]},
        'auto',
        'auto',
    ),
    (
        'text_config compressed-tensors: the layer loader falls back to it',
        {
            'config.json': '{"text_config": {"quantization_config": '
            '{"quant_method": "compressed-tensors", "kv_cache_scheme": ' + CT_SCHEME + '}}}'
        },
        {
            'config.json': '{"text_config": {"quantization_config": '
            '{"quant_method": "compressed-tensors", "kv_cache_scheme": null}}}'
        },
        {'config.json': [('text_config.quantization_config.kv_cache_scheme', json.loads(CT_SCHEME))]},
        'fp8',
        'auto',
    ),
    (
        'both files: config.json quantization_config wins in vLLM, both stripped',
        {
            'config.json': '{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", '
            '"kv_cache_scheme": ' + FP8_SCHEME + '}}\n',
            'hf_quant_config.json': HF_NESTED,
        },
        {
            'config.json': '{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", '
            '"kv_cache_scheme": null}}\n',
            'hf_quant_config.json': HF_NESTED.replace('"kv_cache_quant_algo": "FP8"', '"kv_cache_quant_algo": null'),
        },
        {
            'config.json': [('quantization_config.kv_cache_scheme', json.loads(FP8_SCHEME))],
            'hf_quant_config.json': [('quantization.kv_cache_quant_algo', 'FP8')],
        },
        'fp8',
        'auto',
    ),
    (
        'top level and text_config both, tab indent',
        {
            'config.json': '{\n\t"quantization_config": {\n\t\t"quant_method": "modelopt",\n\t\t"quant_algo": "NVFP4",\n'
            '\t\t"kv_cache_quant_algo": "FP8"\n\t},\n\t"text_config": {\n\t\t"quantization_config": '
            '{\n\t\t\t"quant_method": "modelopt",\n\t\t\t"kv_cache_scheme": "FP8"\n\t\t}\n\t}\n}\n'
        },
        {
            'config.json': '{\n\t"quantization_config": {\n\t\t"quant_method": "modelopt",\n\t\t"quant_algo": "NVFP4",\n'
            '\t\t"kv_cache_quant_algo": null\n\t},\n\t"text_config": {\n\t\t"quantization_config": '
            '{\n\t\t\t"quant_method": "modelopt",\n\t\t\t"kv_cache_scheme": null\n\t\t}\n\t}\n}\n'
        },
        {
            'config.json': [
                ('quantization_config.kv_cache_quant_algo', 'FP8'),
                ('text_config.quantization_config.kv_cache_scheme', 'FP8'),
            ]
        },
        'fp8',
        'auto',
    ),
]


@pytest.mark.parametrize(
    'files, expected_texts, expected_changes, before, after',
    [case[1:] for case in STRIP_CASES],
    ids=[case[0] for case in STRIP_CASES],
)
def test_plan_strip(tmp_path, files, expected_texts, expected_changes, before, after):
    path = write(tmp_path, files)
    config_files = kvq.read_checkpoint(path)
    plans, record, warnings = kvq.plan_strip(path, config_files, None, now='2026-11-30T04:00:00Z')
    assert warnings == []
    assert dict((p.file.name, p.new_text) for p in plans) == expected_texts
    assert (
        dict((p.file.name, [(c['key'], c['before']) for c in p.result()['changes']]) for p in plans) == expected_changes
    )
    assert all(c['after'] is None for p in plans for c in p.result()['changes'])
    assert kvq.checkpoint_kv_cache_dtype(config_files) == before
    assert kvq.checkpoint_kv_cache_dtype(config_files, plans) == after
    assert [(e['file'], e['key'], e['before'], e['after'], e['symlink'], e['time']) for e in record['entries']] == [
        (name, key, value, None, None, '2026-11-30T04:00:00Z')
        for name in kvq.CONFIG_FILES
        for key, value in expected_changes.get(name, [])
    ]


# A record without before_text (one written by hand, or trimmed) restores each value rendered anew in
# its file's indent style: the same bytes, but for a value written on one line inside a pretty-printed file.
RERENDERED = {
    'compressed-tensors kv_cache_scheme, standard attention': {
        'config.json': '{\n  "num_key_value_heads": 8,\n  "quantization_config": {\n    "config_groups": {},\n'
        '    "kv_cache_scheme": {\n      "num_bits": 8,\n      "type": "float",\n      "strategy": "tensor",\n'
        '      "dynamic": false,\n      "symmetric": true\n    },\n'
        '    "quant_method": "compressed-tensors"\n  }\n}\n'
    },
}


@pytest.mark.parametrize(
    'case_id, files, expected_texts', [case[:3] for case in STRIP_CASES], ids=[case[0] for case in STRIP_CASES]
)
@pytest.mark.parametrize('keep_text', [True, False], ids=['record with before_text', 'record without before_text'])
def test_restore_gives_back_the_original_bytes(tmp_path, case_id, files, expected_texts, keep_text):
    path = write(tmp_path, files)
    plans, record, dummy = kvq.plan_strip(path, kvq.read_checkpoint(path), None)
    write(tmp_path, dict((p.file.name, p.new_text) for p in plans))
    if not keep_text:
        for entry in record['entries']:
            del entry['before_text']
    (tmp_path / kvq.RECORD_NAME).write_text(kvq.render_record(record))
    restored, warnings = kvq.plan_restore(path, kvq.read_checkpoint(path), kvq.read_record(path))
    assert warnings == []
    rerendered = {} if keep_text else RERENDERED.get(case_id, {})
    assert dict((p.file.name, p.new_text) for p in restored) == dict(
        (name, rerendered.get(name, files[name])) for name in expected_texts
    )


@pytest.mark.parametrize(
    'text, warning',
    [
        (
            '{"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "NVFP4"}}',
            'config.json in {path}: quantization_config.kv_cache_quant_algo is "NVFP4", not an FP8 KV cache; left unchanged',
        ),
        (
            '{"quantization_config": {"quant_method": "modelopt", "kv_cache_scheme": {"num_bits": 4, "type": "float"}}}',
            'config.json in {path}: quantization_config.kv_cache_scheme is {"num_bits": 4, "type": "float"}, '
            'not an FP8 KV cache; left unchanged',
        ),
        (
            '{"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "int"}}}',
            'config.json in {path}: quantization_config.kv_cache_scheme is {"num_bits": 8, "type": "int"}, '
            'not an FP8 KV cache; left unchanged',
        ),
        (
            '{"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "INT8"}}',
            'config.json in {path}: quantization_config.kv_cache_quant_algo is "INT8", not an FP8 KV cache; left unchanged',
        ),
        (
            '{"text_config": {"quantization_config": {"kv_cache_scheme": {"num_bits": true, "type": "float"}}}}',
            'config.json in {path}: text_config.quantization_config.kv_cache_scheme is {"num_bits": true, "type": "float"}, '
            'not an FP8 KV cache; left unchanged',
        ),
        (
            '{"quantization_config": {"kv_cache_quant_algo": 8}}',
            'config.json in {path}: quantization_config.kv_cache_quant_algo is 8, not an FP8 KV cache; left unchanged',
        ),
    ],
)
def test_other_kv_cache_quantization_is_left_with_a_warning(tmp_path, text, warning):
    path = write(tmp_path, {'config.json': text})
    plans, record, warnings = kvq.plan_strip(path, kvq.read_checkpoint(path), None)
    assert (plans, record, warnings) == ([], None, [warning.replace('{path}', path)])


@pytest.mark.parametrize(
    'files',
    [
        {'config.json': '{"model_type": "llama"}'},
        {'config.json': '{"quantization_config": null}'},
        {'config.json': '{"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": null}}'},
        {'config.json': '{"text_config": null, "quantization_config": {"quant_method": "fp8"}}'},
        {'hf_quant_config.json': HF_NESTED.replace('"FP8"', 'null')},
        {'hf_quant_config.json': '{"producer": {"name": "modelopt"}, "quantization": null}'},
    ],
)
def test_no_kv_cache_quantization_plans_nothing(tmp_path, files):
    path = write(tmp_path, files)
    config_files = kvq.read_checkpoint(path)
    assert kvq.plan_strip(path, config_files, None) == ([], None, [])
    assert kvq.checkpoint_kv_cache_dtype(config_files) == 'auto'


def make_unreadable(tmp_path):
    (tmp_path / 'config.json').mkdir()


def make_broken_link(tmp_path):
    os.symlink('../../blobs/gone', str(tmp_path / 'config.json'))


def make_not_utf8(tmp_path):
    (tmp_path / 'config.json').write_bytes(b'{"a": "\xff"}')


@pytest.mark.parametrize(
    'files, prepare, message',
    [
        ({}, None, 'no config.json or hf_quant_config.json in {path}'),
        ({'config.json': ''}, None, 'config.json in {path} is empty'),
        ({'config.json': ' \n'}, None, 'config.json in {path} is empty'),
        (
            {'config.json': '{"a": 1,}'},
            None,
            'config.json in {path} is not valid JSON: ' + TRAILING_COMMA_ERROR,
        ),
        (
            {'config.json': '{"a": 1'},
            None,
            "config.json in {path} is not valid JSON: Expecting ',' delimiter: line 1 column 8 (char 7)",
        ),
        ({'config.json': '[1, 2]'}, None, 'config.json in {path} must hold a JSON object, not array'),
        (
            {'config.json': '{"quantization_config": []}'},
            None,
            'config.json in {path}: quantization_config must be a JSON object, not array',
        ),
        (
            {'config.json': '{"quantization_config": "modelopt"}'},
            None,
            'config.json in {path}: quantization_config must be a JSON object, not string',
        ),
        (
            {'config.json': '{"text_config": "x"}'},
            None,
            'config.json in {path}: text_config must be a JSON object, not string',
        ),
        (
            {'config.json': '{"text_config": {"quantization_config": 3}}'},
            None,
            'config.json in {path}: text_config.quantization_config must be a JSON object, not number',
        ),
        (
            {'config.json': '{"quantization_config": {"quantization": [1]}}'},
            None,
            'config.json in {path}: quantization_config.quantization must be a JSON object, not array',
        ),
        (
            {'hf_quant_config.json': '{"quantization": true}'},
            None,
            'hf_quant_config.json in {path}: quantization must be a JSON object, not boolean',
        ),
        ({'hf_quant_config.json': '"FP8"'}, None, 'hf_quant_config.json in {path} must hold a JSON object, not string'),
        # Only the second file is bad: planning fails before anything is written.
        (
            {'config.json': KIMI_CONFIG, 'hf_quant_config.json': '{"quantization": {"kv_cache_quant_algo": "FP8"'},
            None,
            "hf_quant_config.json in {path} is not valid JSON: Expecting ',' delimiter: line 1 column 47 (char 46)",
        ),
        (
            {
                'config.json': '{"quantization_config": {"kv_cache_scheme": "FP8"}}',
                'hf_quant_config.json': '{"quantization": []}',
            },
            None,
            'hf_quant_config.json in {path}: quantization must be a JSON object, not array',
        ),
        ({}, make_unreadable, 'config.json in {path} is not a regular file (a directory)'),
        ({}, make_broken_link, 'config.json in {path} is a broken symbolic link to ../../blobs/gone'),
        (
            {},
            make_not_utf8,
            "config.json in {path} is not UTF-8 text: 'utf-8' codec can't decode byte 0xff "
            'in position 7: invalid start byte',
        ),
    ],
)
def test_bad_checkpoints_fail_with_the_file_and_the_cause(tmp_path, files, prepare, message):
    path = write(tmp_path, files)
    if prepare:
        prepare(tmp_path)
    before = dict((p.name, p.read_bytes()) for p in tmp_path.iterdir() if p.is_file())
    with pytest.raises(kvq.KvCacheQuantError) as caught:
        kvq.plan_strip(path, kvq.read_checkpoint(path), None)
    assert str(caught.value) == message.replace('{path}', path)
    assert dict((p.name, p.read_bytes()) for p in tmp_path.iterdir() if p.is_file()) == before


def test_missing_directory(tmp_path):
    with pytest.raises(kvq.KvCacheQuantError) as caught:
        kvq.read_checkpoint(str(tmp_path / 'nope'))
    assert str(caught.value) == 'checkpoint directory %s does not exist' % (tmp_path / 'nope')


def test_path_is_a_file(tmp_path):
    (tmp_path / 'config.json').write_text('{}')
    with pytest.raises(kvq.KvCacheQuantError) as caught:
        kvq.read_checkpoint(str(tmp_path / 'config.json'))
    assert str(caught.value) == 'checkpoint path %s is a regular file, not a directory' % (tmp_path / 'config.json')


GOOD_ENTRY = {
    'file': 'config.json',
    'key': 'quantization_config.kv_cache_scheme',
    'path': ['quantization_config', 'kv_cache_scheme'],
    'before': 'FP8',
    'before_text': '"FP8"',
    'after': None,
    'symlink': None,
    'time': '2026-11-30T04:00:00Z',
}


def entry(**changes):
    result = dict(GOOD_ENTRY)
    result.update(changes)
    return result


@pytest.mark.parametrize(
    'text, message',
    [
        ('', '.llmserve-kv-cache-quant.json in {path} is empty'),
        (
            '{',
            '.llmserve-kv-cache-quant.json in {path} is not valid JSON: '
            'Expecting property name enclosed in double quotes: line 1 column 2 (char 1)',
        ),
        ('{"entries": {}}', '.llmserve-kv-cache-quant.json in {path}: entries must be a JSON array, not object'),
        ('{}', '.llmserve-kv-cache-quant.json in {path}: entries must be a JSON array, not null'),
        (
            json.dumps({'entries': [1]}),
            '.llmserve-kv-cache-quant.json in {path}: entry 1 must be a JSON object, not number',
        ),
        (
            json.dumps({'entries': [GOOD_ENTRY, entry(file='../etc/passwd')]}),
            '.llmserve-kv-cache-quant.json in {path}: entry 2 names file "../etc/passwd"; '
            'expected one of config.json, hf_quant_config.json',
        ),
        (
            json.dumps({'entries': [entry(path=[])]}),
            '.llmserve-kv-cache-quant.json in {path}: entry 1 has no path (a non-empty array of key names)',
        ),
        (
            json.dumps({'entries': [entry(key='x')]}),
            '.llmserve-kv-cache-quant.json in {path}: entry 1 has key "x", which does not match its path '
            '["quantization_config", "kv_cache_scheme"]',
        ),
        (
            json.dumps({'entries': [dict((k, v) for k, v in GOOD_ENTRY.items() if k != 'before')]}),
            '.llmserve-kv-cache-quant.json in {path}: entry 1 has no before value',
        ),
        (
            json.dumps({'entries': [entry(before_text='"INT8"')]}),
            '.llmserve-kv-cache-quant.json in {path}: entry 1 has a before_text that is not the JSON text of its before value',
        ),
        (
            json.dumps({'entries': [entry(symlink=5)]}),
            '.llmserve-kv-cache-quant.json in {path}: entry 1 has a symlink that is not a string',
        ),
    ],
)
def test_bad_record_fails(tmp_path, text, message):
    (tmp_path / kvq.RECORD_NAME).write_text(text)
    with pytest.raises(kvq.KvCacheQuantError) as caught:
        kvq.read_record(str(tmp_path))
    assert str(caught.value) == message.replace('{path}', str(tmp_path))


def test_no_record_is_none(tmp_path):
    assert kvq.read_record(str(tmp_path)) is None


@pytest.mark.parametrize(
    'config, warnings, restored',
    [
        (
            '{"quantization_config": {"kv_cache_scheme": null}}',
            [],
            '{"quantization_config": {"kv_cache_scheme": "FP8"}}',
        ),
        ('{"quantization_config": {"kv_cache_scheme": "FP8"}}', [], None),
        (
            '{"quantization_config": {"kv_cache_scheme": "NVFP4"}}',
            [
                'config.json in {path}: quantization_config.kv_cache_scheme is now "NVFP4", not null as stripped; left unchanged'
            ],
            None,
        ),
        (
            '{"quantization_config": {}}',
            ['config.json in {path}: quantization_config.kv_cache_scheme no longer exists; "FP8" not restored'],
            None,
        ),
    ],
)
def test_plan_restore(tmp_path, config, warnings, restored):
    path = write(tmp_path, {'config.json': config})
    plans, got_warnings = kvq.plan_restore(path, kvq.read_checkpoint(path), kvq.new_record(path, [GOOD_ENTRY]))
    assert got_warnings == [w.replace('{path}', path) for w in warnings]
    assert [p.new_text for p in plans] == ([restored] if restored else [])


def test_restore_of_a_missing_file_fails(tmp_path):
    path = write(tmp_path, {'hf_quant_config.json': HF_NESTED})
    with pytest.raises(kvq.KvCacheQuantError) as caught:
        kvq.plan_restore(path, kvq.read_checkpoint(path), kvq.new_record(path, [GOOD_ENTRY]))
    assert str(caught.value) == '.llmserve-kv-cache-quant.json in %s lists config.json in %s, which is missing' % (
        path,
        path,
    )


@pytest.mark.parametrize(
    'blob, relink',
    [
        ('{"quantization_config": {"kv_cache_scheme": "FP8"}}', '../../blobs/abc'),
        ('{"quantization_config": {"kv_cache_scheme": "FP8"}}\n', None),
    ],
)
def test_restore_relinks_only_to_an_identical_blob(tmp_path, blob, relink):
    (tmp_path / 'blobs').mkdir()
    (tmp_path / 'blobs' / 'abc').write_text(blob)
    snapshot = tmp_path / 'snapshots' / 'rev'
    snapshot.mkdir(parents=True)
    path = write(snapshot, {'config.json': '{"quantization_config": {"kv_cache_scheme": null}}'})
    record = kvq.new_record(path, [entry(symlink='../../blobs/abc')])
    plans, dummy = kvq.plan_restore(path, kvq.read_checkpoint(path), record)
    assert [p.relink for p in plans] == [relink]


def test_strip_records_the_link_a_file_was(tmp_path):
    (tmp_path / 'blobs').mkdir()
    (tmp_path / 'blobs' / 'abc').write_text(HF_NESTED)
    snapshot = tmp_path / 'snapshots' / 'rev'
    snapshot.mkdir(parents=True)
    os.symlink('../../blobs/abc', str(snapshot / 'hf_quant_config.json'))
    path = str(snapshot)
    plans, record, dummy = kvq.plan_strip(path, kvq.read_checkpoint(path), None)
    assert [(e['file'], e['symlink']) for e in record['entries']] == [('hf_quant_config.json', '../../blobs/abc')]
    # A later strip of the same file, now a real file, keeps the link the earlier entry remembered.
    os.unlink(str(snapshot / 'hf_quant_config.json'))
    (snapshot / 'hf_quant_config.json').write_text(HF_NESTED)
    plans, record, dummy = kvq.plan_strip(path, kvq.read_checkpoint(path), record)
    assert [(e['file'], e['symlink']) for e in record['entries']] == [('hf_quant_config.json', '../../blobs/abc')]


@pytest.mark.parametrize(
    'text, keys, span',
    [
        ('{"a": {"b": 1}}', ('a', 'b'), '1'),
        ('{"a": 1, "a": [1, 2]}', ('a',), '[1, 2]'),
        ('{ "x\\"}": "{\\"a\\": 1}" , "a" : { "b" : {"c": null} } }', ('a', 'b'), '{"c": null}'),
        ('\n{\n  "a": "\\u00e9",\n  "b": true\n}\n', ('b',), 'true'),
    ],
)
def test_value_span(text, keys, span):
    start, end = kvq.value_span(text, keys)
    assert text[start:end] == span


@pytest.mark.parametrize(
    'text, keys',
    [
        ('{"a": 1}', ('b',)),
        ('{"a": 1}', ('a', 'b')),
        ('{}', ('a',)),
    ],
)
def test_value_span_missing(text, keys):
    with pytest.raises(KeyError):
        kvq.value_span(text, keys)


@pytest.mark.parametrize(
    'text, indent',
    [
        ('{"a": 1}', None),
        ('{\n  "a": 1\n}', '  '),
        ('{\n    "a": 1\n}', '    '),
        ('{\n\t"a": 1\n}', '\t'),
    ],
)
def test_detect_indent(text, indent):
    assert kvq.detect_indent(text) == indent


# What vLLM makes of --kv-cache-dtype auto is _checkpoint.auto_kv_cache_dtype's answer, checked form by
# form in test__checkpoint_kv_cache_dtype.py; here only a checkpoint without config.json, which it never sees.
@pytest.mark.parametrize(
    'hf_quant, dtype', [(json.loads(HF_NESTED), 'fp8'), (None, 'auto')], ids=['hf_quant_config', 'none']
)
def test_kv_cache_dtype_without_config_json(hf_quant, dtype):
    assert kvq.kv_cache_dtype(None, hf_quant) == dtype
