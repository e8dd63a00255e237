# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.kv_cache_quant through ansible-playbook, on a plain checkpoint and a Hugging Face cache.

Each checkpoint goes four ways (check, check + diff, real, repeat), then state=present
must give back the original bytes (and the cache's links); bad input must change nothing.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from ansible_collections.llmserve.vllm.tests.support import REPO, recorded

# Each case runs its playbook four ways (check, check and diff, real, repeat): make test's, not make check's
pytestmark = pytest.mark.slow

PLAYBOOK = os.path.join(REPO, 'tests', 'integration', 'targets', 'kv_cache_quant', 'playbook.yml')
# The ansible-core beside this interpreter: make matrix runs this file on each release it tests.
ANSIBLE_PLAYBOOK = os.path.join(os.path.dirname(sys.executable), 'ansible-playbook')
# The controller's own interpreter: discovery on this host may find a broken pyenv shim.
LOCAL_PYTHON = sys.executable
RECORD = '.llmserve-kv-cache-quant.json'

KIMI_CONFIG = recorded('checkpoints', 'kimi-k2.5-nvfp4', 'config.json')
HF_NESTED = recorded('checkpoints', 'kimi-k2.5-nvfp4', 'hf_quant_config.json')
# ModelOpt >= 0.31 writes quantization_config into config.json; 4-space indent, no trailing newline.
FLAT_CONFIG = """{
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "quantization_config": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "kv_cache_scheme": {
            "dynamic": false,
            "num_bits": 8,
            "type": "float"
        },
        "ignore": ["lm_head"]
    },
    "rms_norm_eps": 1e-06
}"""

SHA_CONFIG = '6c1b0e4f4f1e4e2d8c0c8a3e0ad5cf1e8d2b9a10'
SHA_HF_QUANT = '9e2f3c1d7b6a5e4f3d2c1b0a99887766554433aa'


def plain_checkpoint(root):
    path = root / 'Kimi-K2.5-NVFP4'
    path.mkdir()
    (path / 'config.json').write_text(KIMI_CONFIG)
    (path / 'hf_quant_config.json').write_text(HF_NESTED)
    return path


def hf_cache_checkpoint(root):
    """models--nvidia--X with two revisions whose config files are links to the same blobs."""
    repo = root / 'hub' / 'models--nvidia--Kimi-K2.5-NVFP4'
    (repo / 'blobs').mkdir(parents=True)
    (repo / 'refs').mkdir()
    (repo / 'blobs' / SHA_CONFIG).write_text(FLAT_CONFIG)
    (repo / 'blobs' / SHA_HF_QUANT).write_text(HF_NESTED)
    for rev in ('1111111111111111111111111111111111111111', '2222222222222222222222222222222222222222'):
        snapshot = repo / 'snapshots' / rev
        snapshot.mkdir(parents=True)
        os.symlink('../../blobs/' + SHA_CONFIG, str(snapshot / 'config.json'))
        os.symlink('../../blobs/' + SHA_HF_QUANT, str(snapshot / 'hf_quant_config.json'))
    (repo / 'refs' / 'main').write_text('1111111111111111111111111111111111111111')
    return repo / 'snapshots' / '1111111111111111111111111111111111111111'


def tree(root):
    """Every file's bytes and every link's target under root."""
    state = {}
    for directory, dirs, files in os.walk(str(root)):
        for name in dirs + files:
            full = os.path.join(directory, name)
            key = os.path.relpath(full, str(root))
            if os.path.islink(full):
                state[key] = ('link', os.readlink(full))
            elif os.path.isfile(full):
                with open(full, 'rb') as handle:
                    state[key] = ('file', handle.read())
    return state


def playbook(tmp_path, path, check=False, diff=False, env=None, wrap=None, **extra):
    result_file = tmp_path / 'result.json'
    if result_file.exists():
        result_file.unlink()
    extra_vars = {
        'kvq_path': str(path),
        'kvq_result_file': str(result_file),
        'ansible_python_interpreter': LOCAL_PYTHON,
    }
    extra_vars.update(extra)
    command = [ANSIBLE_PLAYBOOK, '-i', 'localhost,', '-c', 'local', PLAYBOOK, '-e', json.dumps(extra_vars)]
    if check:
        command.append('--check')
    if diff:
        command.append('--diff')
    environ = dict(
        os.environ,
        ANSIBLE_NOCOLOR='1',
        ANSIBLE_FORCE_COLOR='0',
        ANSIBLE_COLLECTIONS_PATH=os.path.join(REPO, '.build', 'collections'),
    )
    environ.update(env or {})
    proc = subprocess.run((wrap or []) + command, cwd=REPO, env=environ, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(result_file.read_text()), proc.stdout + proc.stderr


def diff_lines(output):
    return [line for line in output.splitlines() if line[:1] in ('+', '-') and not line.startswith(('+++', '---'))]


# The layout, how the checkpoint is built, the stripped texts (file -> text) and the diff lines.
LAYOUTS = {
    'plain': (
        plain_checkpoint,
        {'hf_quant_config.json': HF_NESTED.replace('"kv_cache_quant_algo": "FP8"', '"kv_cache_quant_algo": null')},
        ['-    "kv_cache_quant_algo": "FP8",', '+    "kv_cache_quant_algo": null,'],
    ),
    'hf-cache': (
        hf_cache_checkpoint,
        {
            'config.json': FLAT_CONFIG.replace(
                '{\n            "dynamic": false,\n            "num_bits": 8,\n            "type": "float"\n        }',
                'null',
            ),
            'hf_quant_config.json': HF_NESTED.replace('"kv_cache_quant_algo": "FP8"', '"kv_cache_quant_algo": null'),
        },
        [
            '-        "kv_cache_scheme": {',
            '-            "dynamic": false,',
            '-            "num_bits": 8,',
            '-            "type": "float"',
            '-        },',
            '+        "kv_cache_scheme": null,',
            '-    "kv_cache_quant_algo": "FP8",',
            '+    "kv_cache_quant_algo": null,',
        ],
    ),
}
CHANGES = {
    'config.json': [
        {
            'key': 'quantization_config.kv_cache_scheme',
            'before': {'dynamic': False, 'num_bits': 8, 'type': 'float'},
            'after': None,
        }
    ],
    'hf_quant_config.json': [{'key': 'quantization.kv_cache_quant_algo', 'before': 'FP8', 'after': None}],
}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_four_ways_then_restore(tmp_path, layout):
    build, stripped, expected_diff = LAYOUTS[layout]
    path = build(tmp_path)
    root = tmp_path / ('hub' if layout == 'hf-cache' else 'Kimi-K2.5-NVFP4')
    original = tree(root)
    expected_files = [
        {'path': str(path / name), 'changes': CHANGES[name]}
        for name in ('config.json', 'hf_quant_config.json')
        if name in stripped
    ]

    # 1. check mode: the plan, nothing written.
    result, output = playbook(tmp_path, path, check=True)
    assert (result['changed'], result['files'], result['record']) == (True, expected_files, str(path / RECORD))
    assert (result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == ('fp8', 'auto')
    assert diff_lines(output) == []
    assert tree(root) == original

    # 2. check + diff: just the changed lines.
    result, output = playbook(tmp_path, path, check=True, diff=True)
    assert (result['changed'], result['files']) == (True, expected_files)
    assert diff_lines(output) == expected_diff
    assert tree(root) == original

    # 3. the real run.
    result, output = playbook(tmp_path, path)
    assert (result['changed'], result['files']) == (True, expected_files)
    assert (result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == ('fp8', 'auto')
    for name, text in stripped.items():
        assert not os.path.islink(str(path / name))
        assert (path / name).read_text() == text
    record = json.loads((path / RECORD).read_text())
    assert [(e['file'], e['key'], e['before'], e['after']) for e in record['entries']] == [
        (name, change['key'], change['before'], None) for name in sorted(stripped) for change in CHANGES[name]
    ]
    after = tree(root)
    # Only the stripped files and the record changed; blobs and the other revision are untouched.
    changed = sorted(k for k in set(original) | set(after) if original.get(k) != after.get(k))
    rel = os.path.relpath(str(path), str(root))
    assert changed == sorted(os.path.normpath(os.path.join(rel, n)) for n in list(stripped) + [RECORD])

    # 4. the same again: nothing to do.
    result, output = playbook(tmp_path, path)
    assert (result['changed'], result['files']) == (False, [])
    assert (result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == ('auto', 'auto')
    assert tree(root) == after

    # state=present: check mode first, then for real: byte-identical originals, links back.
    result, output = playbook(tmp_path, path, check=True, diff=True, kvq_state='present')
    assert result['changed'] is True
    assert sorted(diff_lines(output)) == sorted(('+' if line[0] == '-' else '-') + line[1:] for line in expected_diff)
    assert tree(root) == after
    result, output = playbook(tmp_path, path, kvq_state='present')
    assert result['changed'] is True
    assert (result['kv_cache_dtype_before'], result['kv_cache_dtype_after']) == ('auto', 'fp8')
    assert tree(root) == original

    result, output = playbook(tmp_path, path, kvq_state='present')
    assert (result['changed'], result['files']) == (False, [])
    assert 'warnings' not in result
    assert tree(root) == original


def test_backup_keeps_the_original(tmp_path):
    path = plain_checkpoint(tmp_path)
    result, output = playbook(tmp_path, path, kvq_backup=True)
    backup = result['files'][0]['backup_file']
    assert os.path.dirname(backup) == str(path)
    with open(backup) as handle:
        assert handle.read() == HF_NESTED


def test_bad_second_file_changes_nothing(tmp_path):
    path = plain_checkpoint(tmp_path)
    (path / 'hf_quant_config.json').write_text('{"quantization": ["FP8"]}')
    (path / 'config.json').write_text(FLAT_CONFIG)
    original = tree(path)
    result, output = playbook(tmp_path, path)
    assert result['failed'] is True
    assert result['msg'] == 'hf_quant_config.json in %s: quantization must be a JSON object, not array' % path
    assert tree(path) == original


def test_missing_directory_fails(tmp_path):
    result, output = playbook(tmp_path, tmp_path / 'missing')
    assert result['failed'] is True
    assert result['msg'] == 'checkpoint directory %s does not exist' % (tmp_path / 'missing')


def _can_remount_read_only():
    if os.geteuid() != 0 or shutil.which('unshare') is None:
        return False
    probe = subprocess.run(
        ['unshare', '-m', 'sh', '-c', 'mount --bind / /mnt && mount -o remount,ro,bind /mnt'],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_remount_read_only(), reason='needs root and a private mount namespace (unshare -m)')
def test_read_only_filesystem_fails_and_changes_nothing(tmp_path):
    path = plain_checkpoint(tmp_path)
    original = tree(path)
    # The checkpoint is read-only only inside the playbook's own mount namespace.
    wrap = [
        'unshare',
        '-m',
        'sh',
        '-c',
        'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"',
        str(path),
    ]
    result, output = playbook(tmp_path, path, wrap=wrap)
    assert result['failed'] is True
    assert result['msg'] == (
        'cannot write hf_quant_config.json in %s: Read-only file system (a temporary file in %s)' % (path, path)
    )
    assert tree(path) == original
