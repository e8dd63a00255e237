# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Bad input against llmserve.vllm.kv_cache_quant, run as Ansible runs it.

Every failure must name the file and the cause and leave the checkpoint as it was
(bytes and directory listing); every success must be the right one and leave no
temporary, backup or lock file behind. Write failures are real: an immutable file
(chattr +i), a full tmpfs, a lock held by another process, concurrent runs and
runs killed with SIGKILL.
"""

import errno
import fcntl
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tests.support import LOADED_OVERRUN, TRAILING_COMMA_ERROR

MODULE = 'kv_cache_quant'
RECORD = '.llmserve-kv-cache-quant.json'
LOCK = '.llmserve-kv-cache-quant.lock'
TEMP_PREFIX = '.llmserve-tmp-'

HF_NESTED = """{
  "producer": {"name": "modelopt", "version": "0.29.0"},
  "quantization": {
    "quant_algo": "NVFP4",
    "kv_cache_quant_algo": "FP8"
  }
}
"""
HF_STRIPPED = HF_NESTED.replace('"kv_cache_quant_algo": "FP8"', '"kv_cache_quant_algo": null')
KIMI = '{\n  "model_type": "kimi_k25",\n  "text_config": {"model_type": "kimi_k2", "kv_lora_rank": 512}\n}\n'
CT_SCHEME = '{"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false}'


def ct_config(scheme, extra=''):
    """A compressed-tensors config.json whose kv_cache_scheme has the JSON text ``scheme``."""
    return (
        '{\n  "model_type": "llama",%s\n  "quantization_config": {"quant_method": "compressed-tensors", '
        '"kv_cache_scheme": %s}\n}\n' % (extra, scheme)
    )


CT_FP8 = ct_config(CT_SCHEME)
CT_STRIPPED = ct_config('null')


def tree(root):
    """Every entry under root: relative name -> ('file', bytes) | ('link', target) | (kind,)."""
    found = {}
    if not os.path.lexists(root):
        return found
    if not os.path.isdir(root) or os.path.islink(root):
        return {'.': ('not a directory',)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            mode = os.lstat(full).st_mode
            rel = os.path.relpath(full, root)
            if stat.S_ISLNK(mode):
                found[rel] = ('link', os.readlink(full))
            elif stat.S_ISREG(mode):
                with open(full, 'rb') as handle:
                    found[rel] = ('file', handle.read(1 << 20))
            else:
                found[rel] = (stat.S_IFMT(mode),)
    return found


def ours(names):
    """Names that only a run of the module leaves: its temporary files and its lock."""
    return sorted(n for n in names if os.path.basename(n).startswith(TEMP_PREFIX) or os.path.basename(n) == LOCK)


def warnings_of(result):
    """Warning texts: strings before ansible-core 2.19, event summaries since."""
    return [w if isinstance(w, str) else w['event']['msg'] for w in result.get('warnings', [])]


def files(**texts):
    """A setup that writes the named files (bytes or text) into the checkpoint."""

    def setup(ck, tmp_path):
        ck.mkdir()
        for name, text in texts.items():
            name = {'config': 'config.json', 'hf': 'hf_quant_config.json', 'record': RECORD}[name]
            data = text if isinstance(text, bytes) else text.encode('utf-8')
            (ck / name).write_bytes(data)

    return setup


def then(*setups):
    def setup(ck, tmp_path):
        for one in setups:
            one(ck, tmp_path)

    return setup


def fifo(name):
    return lambda ck, tmp_path: os.mkfifo(str(ck / name))


def directory(name):
    return lambda ck, tmp_path: (ck / name).mkdir()


def link(name, target):
    return lambda ck, tmp_path: os.symlink(target, str(ck / name))


def sparse(name, size):
    def setup(ck, tmp_path):
        with open(str(ck / name), 'wb') as handle:
            handle.truncate(size)

    return setup


def record_of(*entries, **fields):
    record = {'format': 1, 'module': 'llmserve.vllm.kv_cache_quant', 'note': 'test', 'entries': list(entries)}
    record.update(fields)
    return json.dumps(record, indent=2) + '\n'


HF_ENTRY = {
    'file': 'hf_quant_config.json',
    'key': 'quantization.kv_cache_quant_algo',
    'path': ['quantization', 'kv_cache_quant_algo'],
    'before': 'FP8',
    'before_text': '"FP8"',
    'after': None,
    'symlink': None,
    'time': '2026-11-30T04:00:00Z',
}


def entry(**changes):
    return dict(HF_ENTRY, **changes)


def outside_fifo(ck, tmp_path):
    (tmp_path / 'outside').mkdir()
    os.mkfifo(str(tmp_path / 'outside' / 'blob'))


def nested(depth):
    return (
        '{"deep": ' + '[' * depth + ']' * depth + ', "quantization_config": {"quant_method": "compressed-tensors", '
        '"kv_cache_scheme": ' + CT_SCHEME + '}}'
    )


def deep_list(depth):
    value = []
    for dummy in range(depth - 1):
        value = [value]
    return value


def deep_scheme(depth):
    return '{"num_bits": 8, "type": "float", "x": ' + '[' * depth + ']' * depth + '}'


def stripped(name, text):
    """A success check: ``name`` now holds ``text`` and the record lists it."""

    def check(result, ck):
        record = json.loads((ck / RECORD).read_text())
        return (
            result['changed'] is True
            and (ck / name).read_bytes() == text.encode('utf-8')
            and [e['file'] for e in record['entries']] == [name]
        )

    return check


def unchanged_with_warning(warning):
    def check(result, ck):
        return result['changed'] is False and warnings_of(result) == [warning.replace('{ck}', str(ck))]

    return check


def restored(name, text):
    def check(result, ck):
        return (
            result['changed'] is True
            and (ck / name).read_bytes() == text.encode('utf-8')
            and not os.path.lexists(str(ck / RECORD))
        )

    return check


NOT_KV = 'entry 1 has path ["model_type"], which is not a KV-cache quantization key this module strips'

# (id, setup(ck, tmp_path), extra args, expected): expected is the exact failure message
# ({ck} is the checkpoint, {lock} its lock file) or a check(result, ck) of a success.
CASES = [
    # Malformed JSON and odd values
    (
        'config invalid JSON',
        files(config='{"a": 1,}'),
        {},
        'config.json in {ck} is not valid JSON: ' + TRAILING_COMMA_ERROR,
    ),
    (
        'hf_quant truncated',
        files(hf=HF_NESTED[:70]),
        {},
        'hf_quant_config.json in {ck} is not valid JSON: Unterminated string starting at: line 3 column 3 (char 61)',
    ),
    ('config a list', files(config='[1, 2]'), {}, 'config.json in {ck} must hold a JSON object, not array'),
    ('hf_quant a string', files(hf='"FP8"'), {}, 'hf_quant_config.json in {ck} must hold a JSON object, not string'),
    ('config null', files(config='null'), {}, 'config.json in {ck} must hold a JSON object, not null'),
    ('config empty', files(config=''), {}, 'config.json in {ck} is empty'),
    (
        'quantization_config a string',
        files(config='{"quantization_config": "modelopt"}'),
        {},
        'config.json in {ck}: quantization_config must be a JSON object, not string',
    ),
    (
        'quantization_config a number',
        files(config='{"quantization_config": 8}'),
        {},
        'config.json in {ck}: quantization_config must be a JSON object, not number',
    ),
    (
        'text_config a list',
        files(config='{"text_config": []}'),
        {},
        'config.json in {ck}: text_config must be a JSON object, not array',
    ),
    (
        'nested quantization a list',
        files(hf='{"quantization": [1]}'),
        {},
        'hf_quant_config.json in {ck}: quantization must be a JSON object, not array',
    ),
    (
        'kv_cache_scheme a number',
        files(config=ct_config('8')),
        {},
        unchanged_with_warning(
            'config.json in {ck}: quantization_config.kv_cache_scheme is 8, not an FP8 KV cache; left unchanged'
        ),
    ),
    (
        'kv_cache_scheme a list',
        files(config=ct_config('[8, "float"]')),
        {},
        unchanged_with_warning(
            'config.json in {ck}: quantization_config.kv_cache_scheme is [8, "float"], '
            'not an FP8 KV cache; left unchanged'
        ),
    ),
    (
        'kv_cache_scheme true',
        files(config=ct_config('true')),
        {},
        unchanged_with_warning(
            'config.json in {ck}: quantization_config.kv_cache_scheme is true, not an FP8 KV cache; left unchanged'
        ),
    ),
    (
        'kv_cache_scheme num_bits a string',
        files(config=ct_config('{"num_bits": "8", "type": "float"}')),
        {},
        unchanged_with_warning(
            'config.json in {ck}: quantization_config.kv_cache_scheme is {"num_bits": "8", '
            '"type": "float"}, not an FP8 KV cache; left unchanged'
        ),
    ),
    (
        'kv_cache_scheme empty object',
        files(config=ct_config('{}')),
        {},
        unchanged_with_warning(
            'config.json in {ck}: quantization_config.kv_cache_scheme is {}, not an FP8 KV cache; left unchanged'
        ),
    ),
    (
        'kv_cache_scheme num_bits 8.0 is FP8',
        files(config=ct_config('{"num_bits": 8.0, "type": "float"}')),
        {},
        stripped('config.json', CT_STRIPPED),
    ),
    (
        'deeply nested JSON (RecursionError)',
        files(config='[' * 100000 + ']' * 100000),
        {},
        'config.json in {ck} nests arrays and objects more than 64 levels deep',
    ),
    (
        '200 levels beside an FP8 scheme',
        files(config=nested(200)),
        {},
        'config.json in {ck} nests arrays and objects more than 64 levels deep',
    ),
    (
        'deep kv_cache_scheme',
        files(config=ct_config(deep_scheme(70))),
        {},
        'config.json in {ck} nests arrays and objects more than 64 levels deep',
    ),
    (
        'NaN beside an FP8 scheme',
        files(config=ct_config(CT_SCHEME, ' "rope_theta": NaN,')),
        {},
        stripped('config.json', ct_config('null', ' "rope_theta": NaN,')),
    ),
    (
        '1e400 beside an FP8 scheme',
        files(config=ct_config(CT_SCHEME, ' "rope_theta": 1e400,')),
        {},
        stripped('config.json', ct_config('null', ' "rope_theta": 1e400,')),
    ),
    (
        'an integer of 5000 digits',
        files(config='{"a": %s}' % ('9' * 5000)),
        {},
        'config.json in {ck} is not valid JSON: Exceeds the limit (4300 digits) for integer string conversion: '
        'value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit',
    ),
    (
        'duplicate keys: the last one counts, as json.loads',
        files(
            config='{"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "NVFP4", '
            '"kv_cache_quant_algo": "FP8"}}'
        ),
        {},
        stripped(
            'config.json',
            '{"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "NVFP4", '
            '"kv_cache_quant_algo": null}}',
        ),
    ),
    (
        'a lone surrogate in the scheme',
        files(config=ct_config('{"num_bits": 8, "type": "float", "n": "\\ud800"}')),
        {},
        stripped('config.json', CT_STRIPPED),
    ),
    (
        'UTF-8 BOM',
        files(config=b'\xef\xbb\xbf{}'),
        {},
        'config.json in {ck} is not valid JSON: Unexpected UTF-8 BOM (decode using utf-8-sig): line 1 column 1 (char 0)',
    ),
    (
        'config not UTF-8',
        files(config=b'{"a": "\xff"}'),
        {},
        "config.json in {ck} is not UTF-8 text: 'utf-8' codec can't decode byte 0xff in position 7: invalid start byte",
    ),
    (
        'hf_quant not UTF-8',
        files(hf=b'{"producer": "\xc3\x28"}'),
        {},
        "hf_quant_config.json in {ck} is not UTF-8 text: 'utf-8' codec can't decode byte 0xc3 in position 14: "
        'invalid continuation byte',
    ),
    (
        'config of 100 MiB',
        then(files(hf=HF_NESTED), sparse('config.json', 100 << 20)),
        {},
        'config.json in {ck} has 104857600 bytes, more than a config file may have (16777216)',
    ),
    # Not regular files, paths that are not there
    (
        'config.json a FIFO',
        then(files(hf=HF_NESTED), fifo('config.json')),
        {},
        'config.json in {ck} is not a regular file (a FIFO)',
    ),
    (
        'hf_quant_config.json a FIFO',
        then(files(config=KIMI), fifo('hf_quant_config.json')),
        {},
        'hf_quant_config.json in {ck} is not a regular file (a FIFO)',
    ),
    (
        'record a FIFO',
        then(files(hf=HF_STRIPPED), fifo(RECORD)),
        {'state': 'present'},
        RECORD + ' in {ck} is not a regular file (a FIFO)',
    ),
    (
        'config.json a directory',
        then(files(hf=HF_NESTED), directory('config.json')),
        {},
        'config.json in {ck} is not a regular file (a directory)',
    ),
    (
        'record a directory',
        then(files(hf=HF_NESTED), directory(RECORD)),
        {},
        RECORD + ' in {ck} is not a regular file (a directory)',
    ),
    (
        'config.json a link to /dev/zero',
        then(files(hf=HF_NESTED), link('config.json', '/dev/zero')),
        {},
        'config.json in {ck} is not a regular file (a character device)',
    ),
    (
        'config.json a symbolic link loop',
        then(files(hf=HF_NESTED), link('config.json', 'config.json')),
        {},
        'cannot read config.json in {ck}: Too many levels of symbolic links',
    ),
    (
        'config.json a broken link',
        then(files(hf=HF_NESTED), link('config.json', '../../blobs/gone')),
        {},
        'config.json in {ck} is a broken symbolic link to ../../blobs/gone',
    ),
    ('checkpoint missing', lambda ck, tmp_path: None, {}, 'checkpoint directory {ck} does not exist'),
    (
        'checkpoint a file',
        lambda ck, tmp_path: ck.write_text('{}'),
        {},
        'checkpoint path {ck} is a regular file, not a directory',
    ),
    (
        'checkpoint a symbolic link loop',
        lambda ck, tmp_path: os.symlink(str(ck), str(ck)),
        {},
        'cannot open checkpoint directory {ck}: Too many levels of symbolic links',
    ),
    (
        'checkpoint a FIFO',
        lambda ck, tmp_path: os.mkfifo(str(ck)),
        {},
        'checkpoint path {ck} is a FIFO, not a directory',
    ),
    ('no config files', files(), {}, 'no config.json or hf_quant_config.json in {ck}'),
    ('relative path', files(hf=HF_NESTED), {'path': 'ckpt'}, stripped('hf_quant_config.json', HF_STRIPPED)),
    # The record: corrupt, truncated, foreign, reaching outside the checkpoint
    (
        'record invalid JSON',
        files(hf=HF_STRIPPED, record='{'),
        {'state': 'present'},
        RECORD
        + ' in {ck} is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)',
    ),
    (
        'record truncated',
        files(hf=HF_STRIPPED, record=record_of(HF_ENTRY)[:100]),
        {'state': 'present'},
        RECORD
        + ' in {ck} is not valid JSON: Expecting property name enclosed in double quotes: line 7 column 1 (char 100)',
    ),
    (
        'record an array',
        files(hf=HF_STRIPPED, record='[]'),
        {'state': 'present'},
        RECORD + ' in {ck} must hold a JSON object, not array',
    ),
    (
        'record not UTF-8',
        files(hf=HF_STRIPPED, record=b'{"entries": ["\xff"]}'),
        {'state': 'present'},
        RECORD + " in {ck} is not UTF-8 text: 'utf-8' codec can't decode byte 0xff in position 14: invalid start byte",
    ),
    (
        'record names a file outside',
        files(hf=HF_STRIPPED, record=record_of(entry(file='../../etc/passwd'))),
        {'state': 'present'},
        RECORD + ' in {ck}: entry 1 names file "../../etc/passwd"; expected one of config.json, hf_quant_config.json',
    ),
    (
        'record restores a key that is no KV-cache key',
        files(
            config='{"model_type": null}',
            record=record_of(
                entry(file='config.json', key='model_type', path=['model_type'], before='x', before_text='"x"')
            ),
        ),
        {'state': 'present'},
        RECORD + ' in {ck}: ' + NOT_KV,
    ),
    (
        'record of another checkpoint',
        files(hf=HF_STRIPPED, record=record_of(HF_ENTRY, checkpoint='/models/other')),
        {'state': 'present'},
        RECORD + ' in {ck} was written for /models/other, not for this checkpoint',
    ),
    (
        'record checkpoint a number',
        files(hf=HF_STRIPPED, record=record_of(HF_ENTRY, checkpoint=5)),
        {'state': 'present'},
        RECORD + ' in {ck}: checkpoint must be a string, not number',
    ),
    (
        'record too deep',
        files(hf=HF_STRIPPED, record=record_of(entry(before=deep_list(70), before_text=None))),
        {'state': 'present'},
        RECORD + ' in {ck} nests arrays and objects more than 64 levels deep',
    ),
    (
        'record corrupt under state=absent',
        files(hf=HF_NESTED, record='{"entries": {}}'),
        {},
        RECORD + ' in {ck}: entries must be a JSON array, not object',
    ),
    (
        'record link to a FIFO outside: restored as a real file, nothing read from the FIFO',
        then(outside_fifo, files(hf=HF_STRIPPED, record=record_of(entry(symlink='../outside/blob')))),
        {'state': 'present'},
        restored('hf_quant_config.json', HF_NESTED),
    ),
    (
        'record link to /dev/zero: restored as a real file',
        files(hf=HF_STRIPPED, record=record_of(entry(symlink='/dev/zero'))),
        {'state': 'present'},
        restored('hf_quant_config.json', HF_NESTED),
    ),
    # The lock
    (
        'lock file a directory',
        then(files(hf=HF_NESTED), directory(LOCK)),
        {},
        'cannot lock {lock}: not a regular file (a directory)',
    ),
    (
        'lock file a symbolic link',
        then(files(hf=HF_NESTED), link(LOCK, '/tmp')),
        {},
        'cannot lock {lock}: not a regular file (a symbolic link)',
    ),
    ('lock file a FIFO', then(files(hf=HF_NESTED), fifo(LOCK)), {}, 'cannot lock {lock}: not a regular file (a FIFO)'),
    ('lock_timeout negative', files(hf=HF_NESTED), {'lock_timeout': -1}, 'lock_timeout must be at least 0, got -1'),
]


@pytest.mark.parametrize('setup, args, expected', [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input(tmp_path, verdict, setup, args, expected):
    ck = tmp_path / 'ckpt'
    setup(ck, tmp_path)
    outside = tree(str(tmp_path / 'outside'))
    before = tree(str(ck))
    run = harness.run_module(MODULE, tmp_path, dict({'path': str(ck)}, **args))
    after = tree(str(ck))
    if callable(expected):
        stray = ours(after)
        outcome = harness.judge(run, expect_success=True, check=lambda result: expected(result, ck), stray=stray)
    else:
        stray = sorted(set(before) ^ set(after))
        message = expected.replace('{ck}', str(ck)).replace('{lock}', str(ck / LOCK))
        outcome = harness.judge(
            run, expect_success=False, stray=stray, check=lambda result: result['msg'] == message and after == before
        )
    assert tree(str(tmp_path / 'outside')) == outside
    verdict(MODULE, outcome, run.result.get('msg') if run.result else run.stderr[-2000:])


# Real write failures ---------------------------------------------------------------


def chattr(flag, *paths):
    subprocess.run(['chattr', flag] + [str(p) for p in paths], check=True, capture_output=True)


@pytest.fixture
def immutable(tmp_path):
    """immutable(path...) makes files immutable (chattr +i) until the test ends; skips where that is not possible."""
    made = []
    probe = tmp_path / 'chattr-probe'
    probe.write_text('x')
    try:
        chattr('+i', probe)
        chattr('-i', probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip('chattr +i does not work in %s: %s' % (tmp_path, exc))
    probe.unlink()

    def make(*paths):
        chattr('+i', *paths)
        made.extend(paths)

    yield make
    if made:
        chattr('-i', *made)


# (id, files, immutable names ('.' is the checkpoint directory), extra args, expected message)
IMMUTABLE_CASES = [
    (
        'config.json immutable: the record is rolled back',
        {'config.json': CT_FP8},
        ['config.json'],
        {},
        'cannot replace config.json in {ck}: Operation not permitted; nothing was changed',
    ),
    (
        'the second of two files immutable: the first is rolled back',
        {
            'config.json': ct_config('"FP8"').replace('compressed-tensors', 'modelopt'),
            'hf_quant_config.json': HF_NESTED,
        },
        ['hf_quant_config.json'],
        {},
        'cannot replace hf_quant_config.json in {ck}: Operation not permitted; nothing was changed',
    ),
    (
        'immutable with backup: the backup is removed',
        {'config.json': KIMI, 'hf_quant_config.json': HF_NESTED},
        ['hf_quant_config.json'],
        {'backup': True},
        'cannot replace hf_quant_config.json in {ck}: Operation not permitted; nothing was changed',
    ),
    (
        'a second strip over an immutable record',
        {
            'config.json': ct_config('"FP8"').replace('compressed-tensors', 'modelopt'),
            'hf_quant_config.json': HF_STRIPPED,
            RECORD: record_of(HF_ENTRY),
        },
        [RECORD],
        {},
        'cannot replace %s in {ck}: Operation not permitted; nothing was changed' % RECORD,
    ),
    (
        'restore with an immutable record: the restored file is rolled back',
        {'hf_quant_config.json': HF_STRIPPED, RECORD: record_of(HF_ENTRY)},
        [RECORD],
        {'state': 'present'},
        'cannot remove %s in {ck}: Operation not permitted; nothing was changed' % RECORD,
    ),
    (
        'immutable directory',
        {'config.json': KIMI, 'hf_quant_config.json': HF_NESTED},
        ['.'],
        {},
        'cannot write hf_quant_config.json in {ck}: Operation not permitted (a temporary file in {ck})',
    ),
]


@pytest.mark.parametrize(
    'texts, frozen, args, message', [c[1:] for c in IMMUTABLE_CASES], ids=[c[0] for c in IMMUTABLE_CASES]
)
def test_immutable_files(tmp_path, verdict, immutable, texts, frozen, args, message):
    ck = tmp_path / 'ckpt'
    ck.mkdir()
    for name, text in texts.items():
        (ck / name).write_text(text)
    immutable(*[ck / name for name in frozen])
    before = tree(str(ck))
    run = harness.run_module(MODULE, tmp_path, dict({'path': str(ck)}, **args))
    after = tree(str(ck))
    outcome = harness.judge(
        run,
        expect_success=False,
        stray=sorted(set(before) ^ set(after)),
        check=lambda result: result['msg'] == message.format(ck=ck) and after == before,
    )
    verdict(MODULE, outcome, run.result.get('msg') if run.result else run.stderr[-2000:])


PAGE = 4096


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs, mounted for the test and unmounted after it; skips where mount is not permitted."""
    disk = tmp_path / 'disk'
    disk.mkdir()
    proc = subprocess.run(
        ['mount', '-t', 'tmpfs', '-o', 'size=64k', 'tmpfs', str(disk)], capture_output=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip('cannot mount a tmpfs: %s' % proc.stderr.decode('utf-8', 'replace').strip())
    yield disk
    subprocess.run(['umount', str(disk)], check=True)


def fill(disk, free_pages):
    """Fill the tmpfs, then free ``free_pages`` pages of it."""
    filler = disk / 'filler'
    handle = os.open(str(filler), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(handle, b'\0' * PAGE)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(handle)
    size = os.path.getsize(str(filler))
    os.truncate(str(filler), max(0, size - free_pages * PAGE))


@pytest.mark.parametrize('backup', [False, True], ids=['no backup', 'backup'])
@pytest.mark.parametrize('free_pages', range(0, 8), ids=['%d pages free' % n for n in range(0, 8)])
def test_full_disk(tmp_path, verdict, small_disk, free_pages, backup):
    ck = small_disk / 'ckpt'
    ck.mkdir()
    (ck / 'config.json').write_text(CT_FP8.replace('compressed-tensors', 'modelopt'))
    (ck / 'hf_quant_config.json').write_text(HF_NESTED)
    fill(small_disk, free_pages)
    before = tree(str(ck))
    run = harness.run_module(MODULE, tmp_path, {'path': str(ck), 'backup': backup})
    after = tree(str(ck))
    if run.result is not None and not run.result.get('failed'):
        # Enough room: the strip must be complete, with the backups asked for and nothing else.
        backups = sorted(n for n in after if n.endswith('~'))

        def check(result):
            return (
                after['hf_quant_config.json'] == ('file', HF_STRIPPED.encode('utf-8'))
                and after['config.json']
                == (
                    'file',
                    CT_FP8.replace('compressed-tensors', 'modelopt')
                    .replace('"kv_cache_scheme": ' + CT_SCHEME, '"kv_cache_scheme": null')
                    .encode('utf-8'),
                )
                and RECORD in after
                and len(backups) == (2 if backup else 0)
                and all(after[b] == before[b.split('.json.')[0] + '.json'] for b in backups)
            )

        outcome = harness.judge(run, expect_success=True, check=check, stray=ours(after))
    else:
        outcome = harness.judge(
            run,
            expect_success=False,
            stray=sorted(set(before) ^ set(after)),
            check=lambda result: (
                'No space left on device' in result['msg'] and ' in %s' % ck in result['msg'] and after == before
            ),
        )
    verdict(MODULE, outcome, run.result.get('msg') if run.result else run.stderr[-2000:])


def test_lock_held_by_another_run_fails_after_the_timeout(tmp_path, verdict):
    ck = tmp_path / 'ckpt'
    files(hf=HF_NESTED)(ck, tmp_path)
    with open(str(ck / LOCK), 'w') as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        before = tree(str(ck))
        started = time.monotonic()
        run = harness.run_module(MODULE, tmp_path, {'path': str(ck), 'lock_timeout': 1})
        elapsed = time.monotonic() - started
        after = tree(str(ck))
    message = 'cannot lock %s: another run of llmserve.vllm.kv_cache_quant has held it for more than 1 s' % (ck / LOCK)
    outcome = harness.judge(
        run,
        expect_success=False,
        stray=sorted(set(before) ^ set(after)),
        check=lambda result: result['msg'] == message and after == before and 1 <= elapsed < 5 + LOADED_OVERRUN,
    )
    verdict(MODULE, outcome, run.result.get('msg') if run.result else run.stderr[-2000:])


# Concurrency and SIGKILL -----------------------------------------------------------


def run_together(tmp_path, args, count):
    """``count`` module runs started at once; each gets its own arguments directory."""
    runs = [None] * count
    barrier = threading.Barrier(count)

    def one(index):
        workdir = tmp_path / ('run%d' % index)
        workdir.mkdir(exist_ok=True)
        barrier.wait()
        runs[index] = harness.run_module(MODULE, workdir, args)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


CONCURRENT_ROUNDS = 6


def without_times(found):
    """A tree() with the record's entries parsed and their times left out, to compare two strips."""
    if RECORD not in found:
        return found
    entries = json.loads(found[RECORD][1].decode('utf-8'))['entries']
    return dict(found, **{RECORD: [dict((k, v) for k, v in e.items() if k != 'time') for e in entries]})


@pytest.mark.parametrize('state', ['present', 'absent'])
def test_concurrent_runs_serialise(tmp_path, verdict, state):
    ck = tmp_path / 'ckpt'
    files(config=CT_FP8.replace('compressed-tensors', 'modelopt'), hf=HF_NESTED)(ck, tmp_path)
    original = tree(str(ck))
    strip = harness.run_module(MODULE, tmp_path, {'path': str(ck)})
    assert strip.result['changed'] is True, strip.result
    stripped_tree = tree(str(ck))
    for dummy in range(CONCURRENT_ROUNDS):
        # Each round starts from the state the other state left, so that every round has work to do.
        if state == 'present':
            harness.run_module(MODULE, tmp_path, {'path': str(ck)})
            assert without_times(tree(str(ck))) == without_times(stripped_tree)
            expected = original
        else:
            harness.run_module(MODULE, tmp_path, {'path': str(ck), 'state': 'present'})
            assert tree(str(ck)) == original
            expected = stripped_tree
        runs = run_together(tmp_path, {'path': str(ck), 'state': state}, 3)
        after = without_times(tree(str(ck)))
        expected = without_times(expected)
        changed = sorted(bool(r.result and r.result.get('changed')) for r in runs)
        converged = after == expected and changed == [False, False, True]
        for run in runs:
            outcome = harness.judge(
                run, expect_success=True, stray=ours(after), check=lambda result, converged=converged: converged
            )
            verdict(MODULE, outcome, run.result if run.result else run.stderr[-2000:])


KILL_ATTEMPTS = 16
# Syscalls that change the checkpoint: slowed down under strace, so that the kills land among them.
CHANGING_CALLS = 'rename,renameat,renameat2,unlink,unlinkat,symlink,symlinkat,fsync,flock'


def slowed(argv):
    """argv run under strace with every changing syscall delayed by 20 ms, where strace can trace here."""
    strace = shutil.which('strace')
    if strace is None or subprocess.run([strace, '-o', os.devnull, 'true'], check=False).returncode != 0:
        return argv
    return [
        strace,
        '-f',
        '-qq',
        '-o',
        os.devnull,
        '-e',
        'trace=' + CHANGING_CALLS,
        '-e',
        'inject=%s:delay_enter=20000' % CHANGING_CALLS,
    ] + argv


def test_sigkill_leaves_every_file_old_or_new_and_a_rerun_converges(tmp_path, verdict):
    """SIGKILL a run at a random moment; every file must be whole and the next run must finish the job."""
    ck = tmp_path / 'ckpt'
    files(config=CT_FP8.replace('compressed-tensors', 'modelopt'), hf=HF_NESTED)(ck, tmp_path)
    old = tree(str(ck))
    harness.run_module(MODULE, tmp_path, {'path': str(ck)})
    new = tree(str(ck))
    harness.run_module(MODULE, tmp_path, {'path': str(ck), 'state': 'present'})
    assert tree(str(ck)) == old
    args_file = tmp_path / 'kill-args.json'
    env = dict(os.environ, PYTHONPATH=harness.COLLECTIONS_PATH)
    argv = slowed([sys.executable, '-m', 'ansible_collections.llmserve.vllm.plugins.modules.' + MODULE, str(args_file)])

    def start(state):
        args_file.write_text(json.dumps({'ANSIBLE_MODULE_ARGS': {'path': str(ck), 'state': state}}))
        return subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    started = time.monotonic()
    start('absent').wait()
    start('present').wait()
    duration = (time.monotonic() - started) / 2
    assert tree(str(ck)) == old
    chance = random.Random(20261130)
    for attempt in range(KILL_ATTEMPTS):
        state = ('absent', 'present')[attempt % 2]
        proc = start(state)
        time.sleep(chance.uniform(0.3, 1.0) * duration)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        now = tree(str(ck))
        whole = all(now.get(name) in (old[name], new[name]) for name in ('config.json', 'hf_quant_config.json'))
        if RECORD in now:
            try:
                whole = whole and isinstance(json.loads(now[RECORD][1])['entries'], list)
            except ValueError:
                whole = False
        # The next run of the same state finishes the job, and leaves nothing of the killed one behind.
        run = harness.run_module(MODULE, tmp_path, {'path': str(ck), 'state': state})
        after = tree(str(ck))
        goal = old if state == 'present' else new
        converged = all(after[name] == goal[name] for name in ('config.json', 'hf_quant_config.json')) and (
            RECORD in after
        ) == (state == 'absent')
        good = whole and converged
        outcome = harness.judge(run, expect_success=True, stray=ours(after), check=lambda result, good=good: good)
        verdict(
            MODULE,
            outcome,
            'attempt %d (%s): whole %s, converged %s, left behind by the kill %s, after the rerun %s'
            % (attempt, state, whole, converged, ours(now), sorted(after)),
        )
