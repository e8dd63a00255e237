# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Strip and restore a checkpoint's FP8 KV-cache quantization.

This is PRIVATE to the collection. It can change at any time, without notice.

Pure logic for the llmserve.vllm.kv_cache_quant module: find the KV-cache
quantization keys, plan the edits in memory, render them into the original
text (only the value changes, every other byte stays), keep the record that
undoes them, and predict what vLLM 0.32.0 makes of ``--kv-cache-dtype auto``.
"""

import copy
import json
import os
import re
import stat
import time
from collections.abc import Iterator, Sequence
from json.decoder import scanstring  # type: ignore[attr-defined]  # in the stdlib, not in typeshed
from typing import Any, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils._file_transaction import file_kind
from ansible_collections.llmserve.vllm.plugins.module_utils._json_text import decode_json
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import Config, auto_kv_cache_dtype
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._digest import describe_mode

CONFIG_JSON = 'config.json'
HF_QUANT_CONFIG_JSON = 'hf_quant_config.json'
CONFIG_FILES = (CONFIG_JSON, HF_QUANT_CONFIG_JSON)
RECORD_NAME = '.llmserve-kv-cache-quant.json'
LOCK_NAME = '.llmserve-kv-cache-quant.lock'
RECORD_FORMAT = 1
MODULE_NAME = 'llmserve.vllm.kv_cache_quant'
KV_KEYS = ('kv_cache_scheme', 'kv_cache_quant_algo')
# Where the KV-cache keys live: each section may also hold them in a nested ModelOpt 'quantization' object.
KV_SECTIONS = {
    CONFIG_JSON: (('quantization_config',), ('text_config', 'quantization_config')),
    HF_QUANT_CONFIG_JSON: ((),),
}
# Real configs are kilobytes and a few levels deep; anything far beyond is not a config.
MAX_FILE_BYTES = 16 << 20
MAX_DEPTH = 64

_WS = re.compile(r'[ \t\n\r]*')


# A planned change of one value: keys (tuple), before, after, and before_text / after_text, its exact JSON text.
Change = dict[str, Any]
# The record beside the checkpoint of what state=absent replaced (see new_record).
Record = dict[str, Any]


class KvCacheQuantError(Exception):
    """Bad input: the message names the file and the cause."""


def json_type(value: Any) -> str:
    """The JSON name of a Python value's type, for messages."""
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return 'boolean'
    if isinstance(value, dict):
        return 'object'
    if isinstance(value, list):
        return 'array'
    if isinstance(value, str):
        return 'string'
    return 'number'


def compact(value: Any) -> str:
    """A value as one line of JSON, for messages and warnings."""
    return json.dumps(value, sort_keys=False, separators=(', ', ': '))


def label(name: str, path: str) -> str:
    """How messages name a file: 'config.json in /models/x'."""
    return '%s in %s' % (name, path)


def parse_json(text: str, where: str) -> Any:
    """Any JSON value, with the file named in every failure; nesting deeper than MAX_DEPTH is refused."""
    return decode_json(text, where, KvCacheQuantError, MAX_DEPTH)


def parse_document(text: str, where: str) -> Config:
    """Parse a config file's text; it must hold a JSON object."""
    if not text.strip():
        raise KvCacheQuantError('%s is empty' % where)
    doc = parse_json(text, where)
    if not isinstance(doc, dict):
        raise KvCacheQuantError('%s must hold a JSON object, not %s' % (where, json_type(doc)))
    return doc


def canonical(value: Any) -> str:
    """One text per JSON value, so that values compare equal even when they hold NaN."""
    return json.dumps(value, sort_keys=True)


def read_bytes(full: str, where: str) -> bytes:
    """The bytes of a regular file of at most MAX_FILE_BYTES; a FIFO or device is refused, never waited on."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise KvCacheQuantError('cannot read %s: %s' % (where, exc.strerror or exc)) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KvCacheQuantError('%s is not a regular file (%s)' % (where, file_kind(info.st_mode)))
        data = b''
        # The size of a file that grows while it is read counts too.
        size = info.st_size
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - len(data))
            if not chunk:
                return data
            data += chunk
            size = max(size, len(data))
        raise KvCacheQuantError(
            '%s has %d bytes, more than a config file may have (%d)' % (where, size, MAX_FILE_BYTES)
        )
    except OSError as exc:
        raise KvCacheQuantError('cannot read %s: %s' % (where, exc.strerror or exc)) from exc
    finally:
        os.close(fd)


def read_text(full: str, where: str) -> str:
    """Read a file as UTF-8 text, with a message that says why it failed."""
    data = read_bytes(full, where)
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as exc:
        raise KvCacheQuantError('%s is not UTF-8 text: %s' % (where, exc)) from exc


class ConfigFile:
    """One config file of the checkpoint as read from disk."""

    def __init__(self, name: str, full: str, text: str, doc: Config, link: Optional[str]) -> None:
        self.name = name
        self.full = full
        self.text = text
        self.doc = doc
        # The link's target when the file is a symbolic link (Hugging Face cache), else None.
        self.link = link


def read_checkpoint(path: str) -> dict[str, ConfigFile]:
    """Read config.json and hf_quant_config.json of a checkpoint directory.

    Returns a dict file name -> ConfigFile for the files that exist.
    """
    check_directory(path)
    files = {}
    for name in CONFIG_FILES:
        full = os.path.join(path, name)
        where = label(name, path)
        if not os.path.lexists(full):
            continue
        link = os.readlink(full) if os.path.islink(full) else None
        if link is not None and not os.path.lexists(os.path.join(path, link)):
            raise KvCacheQuantError('%s is a broken symbolic link to %s' % (where, link))
        text = read_text(full, where)
        files[name] = ConfigFile(name, full, text, parse_document(text, where), link)
    if not files:
        raise KvCacheQuantError('no %s or %s in %s' % (CONFIG_JSON, HF_QUANT_CONFIG_JSON, path))
    return files


def check_directory(path: str, error: type[Exception] = KvCacheQuantError) -> None:
    """The checkpoint path must be a directory; error's message says what it is instead (kv_cache_quant's and
    checkpoint_verify's alike)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        if not os.path.lexists(path):
            raise error('checkpoint directory %s does not exist' % path) from exc
        raise error('cannot open checkpoint directory %s: %s' % (path, exc.strerror or exc)) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise error('checkpoint path %s is %s, not a directory' % (path, describe_mode(info.st_mode)))


def _section(doc: Config, keys: tuple[str, ...], where: str) -> Optional[Config]:
    """The object at ``keys`` in ``doc``; None when absent or null; an error for another type."""
    node: Any = doc
    for depth, key in enumerate(keys):
        node = node.get(key)
        if node is None:
            return None
        if not isinstance(node, dict):
            raise KvCacheQuantError(
                '%s: %s must be a JSON object, not %s' % (where, '.'.join(keys[: depth + 1]), json_type(node))
            )
    return node


def find_kv_entries(name: str, doc: Config, where: str) -> list[tuple[tuple[str, ...], Any]]:
    """Every KV-cache quantization key of one config file, as (key path tuple, value).

    config.json: quantization_config and text_config.quantization_config (multimodal
    checkpoints such as Kimi-K2.5); hf_quant_config.json: the document itself. In each,
    kv_cache_scheme / kv_cache_quant_algo at its top and under its ``quantization`` object
    (the nested ModelOpt form).
    """
    entries = []
    for prefix in KV_SECTIONS[name]:
        section = _section(doc, prefix, where) if prefix else doc
        if section is None:
            continue
        for key in KV_KEYS:
            if key in section:
                entries.append((prefix + (key,), section[key]))
        inner = _section(doc, prefix + ('quantization',), where)
        if inner is not None:
            for key in KV_KEYS:
                if key in inner:
                    entries.append((prefix + ('quantization', key), inner[key]))
    return entries


def present_configs(path: str, files: dict[str, ConfigFile]) -> Iterator[tuple[str, ConfigFile, str]]:
    """(name, config file, its label) of each config file the checkpoint has, in CONFIG_FILES' order."""
    for name in CONFIG_FILES:
        config_file = files.get(name)
        if config_file is not None:
            yield name, config_file, label(name, path)


def nulled_kv_keys(path: str, files: dict[str, ConfigFile]) -> list[str]:
    """The KV-cache quantization keys that are null, as a strip leaves them: 'config.json in PATH: key.path'."""
    nulled = []
    for name, config_file, where in present_configs(path, files):
        nulled += [
            '%s: %s' % (where, dotted(keys))
            for keys, value in find_kv_entries(name, config_file.doc, where)
            if value is None
        ]
    return nulled


def kv_key_paths(name: str) -> set[tuple[str, ...]]:
    """Every key path find_kv_entries() looks at in the config file ``name``."""
    return set(
        section + inner + (key,)
        for section in KV_SECTIONS[name]
        for inner in ((), ('quantization',))
        for key in KV_KEYS
    )


def classify(value: Any) -> str:
    """'none' (no KV-cache quantization), 'fp8' (to strip) or 'other' (left alone)."""
    if value is None:
        return 'none'
    if isinstance(value, str):
        return 'fp8' if value.strip().lower() == 'fp8' else 'other'
    if isinstance(value, dict):
        bits = value.get('num_bits')
        if bits == 8 and not isinstance(bits, bool) and value.get('type') == 'float':
            return 'fp8'
    return 'other'


def dotted(keys: Sequence[str]) -> str:
    return '.'.join(keys)


def get_path(doc: Config, keys: Sequence[str]) -> Any:
    """The value at ``keys``; raises KeyError when a key is missing on the way."""
    node = doc
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise KeyError(key)
        node = node[key]
    return node


def set_path(doc: Config, keys: Sequence[str], value: Any) -> None:
    node = doc
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value


def _skip_ws(text: str, pos: int) -> int:
    match = _WS.match(text, pos)  # always, if only the empty string
    return match.end() if match else pos


def value_span(text: str, keys: Sequence[str]) -> tuple[int, int]:
    """(start, end) of the JSON text of the value at ``keys``, the last of duplicate keys as json.loads does."""
    decoder = json.JSONDecoder()
    start = _skip_ws(text, 0)
    end = len(text)
    for key in keys:
        if text[start : start + 1] != '{':
            raise KeyError(key)
        pos = _skip_ws(text, start + 1)
        found = None
        if text[pos : pos + 1] != '}':
            while True:
                name, pos = scanstring(text, pos + 1)
                pos = _skip_ws(text, pos)
                pos = _skip_ws(text, pos + 1)  # the colon
                dummy, value_end = decoder.raw_decode(text, pos)
                if name == key:
                    found = (pos, value_end)
                pos = _skip_ws(text, value_end)
                if text[pos] == ',':
                    pos = _skip_ws(text, pos + 1)
                    continue
                break
        if found is None:
            raise KeyError(key)
        start, end = found
    return start, end


def detect_indent(text: str) -> Optional[str]:
    """The indent unit of a pretty-printed JSON text (spaces or a tab), None when on one line."""
    match = re.search(r'\n([ \t]+)\S', text)
    if match is None:
        return None
    unit = match.group(1)
    return '\t' if unit.startswith('\t') else ' ' * len(unit)


def dumps(value: Any, **options: Any) -> str:
    """json.dumps with non-ASCII text as it is, unless that text cannot be UTF-8 (a lone surrogate from a \\ud800 escape)."""
    rendered = json.dumps(value, ensure_ascii=False, **options)
    try:
        rendered.encode('utf-8')
    except UnicodeEncodeError:
        rendered = json.dumps(value, **options)
    return rendered


def render_value(value: Any, text: str, start: int) -> str:
    """JSON text for ``value`` placed at ``start`` of ``text``, in the document's style."""
    indent = detect_indent(text)
    if indent is None or not isinstance(value, (dict, list)) or not value:
        return dumps(value)
    line_start = text.rfind('\n', 0, start) + 1
    before = text[line_start:start]
    lead = before[: len(before) - len(before.lstrip(' \t'))]
    rendered = dumps(value, indent=indent, separators=(',', ': '))
    return rendered.replace('\n', '\n' + lead)


def apply_changes(text: str, doc: Config, changes: list[Change], where: str) -> tuple[str, Config]:
    """Render ``changes`` into ``text``; every byte outside the changed values stays.

    Each change is a dict with ``keys`` (tuple), ``after`` (the new value) and
    optionally ``after_text`` (its exact JSON text, from the record).
    Returns (new text, new document).
    """
    new_doc = copy.deepcopy(doc)
    spans = []
    for change in changes:
        start, end = value_span(text, change['keys'])
        replacement = change.get('after_text')
        if replacement is None:
            replacement = render_value(change['after'], text, start)
        spans.append((start, end, replacement))
        set_path(new_doc, change['keys'], change['after'])
    new_text = text
    for start, end, replacement in sorted(spans, reverse=True):
        new_text = new_text[:start] + replacement + new_text[end:]
    if canonical(json.loads(new_text)) != canonical(new_doc):
        raise KvCacheQuantError('%s: the edited text does not parse to the planned values; nothing was changed' % where)
    return new_text, new_doc


def utc_now() -> str:
    return time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())


class FilePlan:
    """The planned edit of one config file."""

    def __init__(
        self,
        config_file: ConfigFile,
        changes: list[Change],
        new_text: str,
        new_doc: Config,
        relink: Optional[str] = None,
    ) -> None:
        self.file = config_file
        self.changes = changes
        self.new_text = new_text
        self.new_doc = new_doc
        # state=present: the symbolic link target to put back instead of a real file.
        self.relink = relink

    def result(self) -> dict[str, Any]:
        return {
            'path': self.file.full,
            'changes': [{'key': dotted(c['keys']), 'before': c['before'], 'after': c['after']} for c in self.changes],
        }


def plan_strip(
    path: str, files: dict[str, ConfigFile], record: Optional[Record], now: Optional[str] = None
) -> tuple[list[FilePlan], Optional[Record], list[str]]:
    """Plan state=absent: every FP8 KV-cache key becomes null.

    Returns (list of FilePlan, new record dict or None when nothing changes, warnings).
    """
    now = now or utc_now()
    plans = []
    warnings = []
    new_entries = []
    for name, config_file, where in present_configs(path, files):
        changes = []
        for keys, value in find_kv_entries(name, config_file.doc, where):
            kind = classify(value)
            if kind == 'other':
                warnings.append(
                    '%s: %s is %s, not an FP8 KV cache; left unchanged' % (where, dotted(keys), compact(value))
                )
            elif kind == 'fp8':
                start, end = value_span(config_file.text, keys)
                changes.append(
                    {'keys': keys, 'before': value, 'after': None, 'before_text': config_file.text[start:end]}
                )
        if not changes:
            continue
        new_text, new_doc = apply_changes(config_file.text, config_file.doc, changes, where)
        plans.append(FilePlan(config_file, changes, new_text, new_doc))
        link = config_file.link
        if link is None and record is not None:
            # A file stripped before kept the link it had then in the record.
            link = next((e.get('symlink') for e in record['entries'] if e['file'] == name and e.get('symlink')), None)
        for change in changes:
            new_entries.append(
                {
                    'file': name,
                    'key': dotted(change['keys']),
                    'path': list(change['keys']),
                    'before': change['before'],
                    'before_text': change['before_text'],
                    'after': None,
                    'symlink': link,
                    'time': now,
                }
            )
    if not plans:
        return plans, None, warnings
    kept = []
    if record is not None:
        replaced = set((e['file'], e['key']) for e in new_entries)
        kept = [e for e in record['entries'] if (e['file'], e['key']) not in replaced]
    return plans, new_record(path, kept + new_entries), warnings


def new_record(path: str, entries: list[dict[str, Any]]) -> Record:
    return {
        'format': RECORD_FORMAT,
        'module': MODULE_NAME,
        'note': (
            'KV-cache quantization values that %s state=absent replaced with null; '
            'state=present puts them back and removes this file.' % MODULE_NAME
        ),
        'checkpoint': path,
        'entries': entries,
    }


def render_record(record: Record) -> str:
    return dumps(record, indent=2) + '\n'


def read_record(path: str) -> Optional[Record]:
    """The record beside the checkpoint, or None when there is none."""
    full = os.path.join(path, RECORD_NAME)
    where = label(RECORD_NAME, path)
    try:
        text = read_text(full, where)
    except KvCacheQuantError:
        # Also when a concurrent check-mode run saw it just before a restore removed it.
        if not os.path.lexists(full):
            return None
        raise
    record = parse_document(text, where)
    _check_record_checkpoint(record.get('checkpoint', path), path, where)
    entries = record.get('entries')
    if not isinstance(entries, list):
        raise KvCacheQuantError('%s: entries must be a JSON array, not %s' % (where, json_type(entries)))
    for index, entry in enumerate(entries):
        problem = _entry_problem(entry)
        if problem:
            raise KvCacheQuantError('%s: entry %d %s' % (where, index + 1, problem))
    return record


def _check_record_checkpoint(recorded: Any, path: str, where: str) -> None:
    """A record copied from another checkpoint would restore that one's values here; records of earlier versions name none."""
    if not isinstance(recorded, str):
        raise KvCacheQuantError('%s: checkpoint must be a string, not %s' % (where, json_type(recorded)))
    if recorded == path:
        return
    try:
        if os.path.samefile(recorded, path):
            return
    except (OSError, ValueError):
        pass
    raise KvCacheQuantError('%s was written for %s, not for this checkpoint' % (where, recorded))


def _entry_problem(entry: Any) -> Optional[str]:
    if not isinstance(entry, dict):
        return 'must be a JSON object, not %s' % json_type(entry)
    name = entry.get('file')
    if name not in CONFIG_FILES:
        return 'names file %s; expected one of %s' % (compact(name), ', '.join(CONFIG_FILES))
    keys = entry.get('path')
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        return 'has no path (a non-empty array of key names)'
    if tuple(keys) not in kv_key_paths(name):
        return 'has path %s, which is not a KV-cache quantization key this module strips' % compact(keys)
    if entry.get('key') != dotted(keys):
        return 'has key %s, which does not match its path %s' % (compact(entry.get('key')), compact(keys))
    if 'before' not in entry:
        return 'has no before value'
    before_text = entry.get('before_text')
    if before_text is not None:
        try:
            same = isinstance(before_text, str) and canonical(parse_json(before_text, '')) == canonical(entry['before'])
        except KvCacheQuantError:
            same = False
        if not same:
            return 'has a before_text that is not the JSON text of its before value'
    link = entry.get('symlink')
    if link is not None and not isinstance(link, str):
        return 'has a symlink that is not a string'
    return None


def plan_restore(path: str, files: dict[str, ConfigFile], record: Record) -> tuple[list[FilePlan], list[str]]:
    """Plan state=present: put back every value the record holds.

    Returns (list of FilePlan, warnings). The caller removes the record afterwards.
    """
    warnings = []
    by_file: dict[str, list[Change]] = {}
    for entry in record['entries']:
        name = entry['file']
        where = label(name, path)
        config_file = files.get(name)
        if config_file is None:
            raise KvCacheQuantError('%s lists %s, which is missing' % (label(RECORD_NAME, path), where))
        keys = tuple(entry['path'])
        try:
            current = get_path(config_file.doc, keys)
        except KeyError:
            warnings.append(
                '%s: %s no longer exists; %s not restored' % (where, entry['key'], compact(entry['before']))
            )
            continue
        if canonical(current) == canonical(entry['before']):
            continue
        if current is not None:
            warnings.append(
                '%s: %s is now %s, not null as stripped; left unchanged' % (where, entry['key'], compact(current))
            )
            continue
        by_file.setdefault(name, []).append(
            {
                'keys': keys,
                'before': None,
                'after': entry['before'],
                'after_text': entry.get('before_text'),
                'symlink': entry.get('symlink'),
            }
        )
    plans = []
    for name in CONFIG_FILES:
        changes = by_file.get(name)
        if not changes:
            continue
        config_file = files[name]
        where = label(name, path)
        new_text, new_doc = apply_changes(config_file.text, config_file.doc, changes, where)
        relink = None
        link = next((c['symlink'] for c in changes if c['symlink']), None)
        if link is not None and config_file.link is None:
            # The record says where the link pointed; a link goes back only to the very bytes restored.
            target = os.path.join(os.path.dirname(config_file.full), link)
            try:
                if read_bytes(target, link) == new_text.encode('utf-8'):
                    relink = link
            except KvCacheQuantError:
                relink = None
        plans.append(FilePlan(config_file, changes, new_text, new_doc, relink))
    return plans, warnings


def kv_cache_dtype(config_doc: Optional[Config], hf_quant_doc: Optional[Config]) -> str:
    """'fp8' when vLLM 0.32.0 resolves --kv-cache-dtype auto to an FP8 cache for this checkpoint, else 'auto'.

    The answer is _checkpoint.auto_kv_cache_dtype's, the one the GPU preflight gives too.
    """
    dtype = auto_kv_cache_dtype(config_doc or {}, hf_quant_doc)[0]
    return 'fp8' if dtype is not None and dtype.startswith('fp8') else 'auto'


def checkpoint_kv_cache_dtype(files: dict[str, ConfigFile], plans: Optional[list[FilePlan]] = None) -> str:
    """kv_cache_dtype() of the files as they are, or as they will be after ``plans``."""
    docs = dict((name, f.doc) for name, f in files.items())
    for plan in plans or []:
        docs[plan.file.name] = plan.new_doc
    return kv_cache_dtype(docs.get(CONFIG_JSON), docs.get(HF_QUANT_CONFIG_JSON))


def shipped_with_fp8_kv_cache(path: str) -> bool:
    """Whether the checkpoint as shipped asks for an FP8 KV cache that this module stripped.

    Planners (the GPU preflight) must judge the checkpoint as shipped: judged from the
    stripped files, the next run would decide to restore what the last one removed.
    """
    record = read_record(path)
    if record is None:
        return False
    files = read_checkpoint(path)
    plans = plan_restore(path, files, record)[0]
    return checkpoint_kv_cache_dtype(files, plans) == 'fp8'
