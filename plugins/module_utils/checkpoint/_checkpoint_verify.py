# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A checkpoint directory checked file by file against the Hub's manifest of its revision.

PRIVATE to the collection: this is not a public API; it may change without notice.

Every file of the manifest must be there with its size and digest; safetensors
headers must parse and their data end the file; the safetensors index must name
only shards that are there; nothing else may be there. The config files that
llmserve.vllm.kv_cache_quant rewrote pass when putting back the values its record
keeps gives the manifest's bytes. Digests are computed by a pool of threads and
kept in a cache (_digest.DigestCache), so a rerun on an unchanged checkpoint reads
no shard.
"""

import fnmatch
import gc
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Union, cast, overload

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import CheckpointError, read_json
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._digest import (
    DigestCache,
    DigestError,
    describe_mode,
    digest_of_bytes,
    hash_file,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._kv_cache_quant import (
    RECORD_NAME,
    KvCacheQuantError,
    Record,
    apply_changes,
    compact,
    get_path,
    read_checkpoint,
    read_record,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._kv_cache_quant import (
    check_directory as check_checkpoint_directory,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import INDEX_NAME, read_header
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import mask
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_manifest import (
    Manifest,
    ManifestFile,
    name_problem,
)

MISSING = 'missing'
TRUNCATED = 'truncated'
OVERSIZED = 'oversized'
DIGEST_MISMATCH = 'digest_mismatch'
EXTRA_FILE = 'extra_file'
BAD_SAFETENSORS_HEADER = 'bad_safetensors_header'
BAD_SAFETENSORS_INDEX = 'bad_safetensors_index'
INDEX_NAMES_MISSING_SHARD = 'index_names_missing_shard'
UNREADABLE = 'unreadable'
LINK_OUTSIDE = 'link_outside'

# What huggingface_hub's local_dir mode writes beside the files (download metadata, locks, tree listings).
DEFAULT_IGNORE = ('.cache/huggingface/**',)
# Names of cached facts other than digests.
HEADER_FACT = 'safetensors_header_problem'
INDEX_FACT = 'index_shards'


class VerifyError(Exception):
    """The check cannot run at all (no checkpoint directory); the message says why."""


def printable(text: str) -> str:
    """Text as the controller can take it: a file name's bytes that are not UTF-8 (surrogate escapes) as \\xNN."""
    try:
        return text.encode('utf-8', 'surrogateescape').decode('utf-8', 'backslashreplace')
    except UnicodeEncodeError:
        return text.encode('utf-8', 'backslashreplace').decode('utf-8')


def problem(name: str, kind: str, detail: str) -> dict[str, str]:
    return {'file': printable(name), 'kind': kind, 'detail': printable(detail)}


def masked_result(result: dict[str, Any], secrets: Sequence[Optional[str]]) -> dict[str, Any]:
    """The module's result with the secrets masked (see _http.mask) in every text that the Hub's answer may have
    put there: the message, and the file names of the manifest in the problems and the rewritten files."""
    masked = dict(result)
    if 'msg' in masked:
        masked['msg'] = mask(masked['msg'], *secrets)
    masked['problems'] = [
        dict(found, file=mask(found['file'], *secrets), detail=mask(found['detail'], *secrets))
        for found in result['problems']
    ]
    if 'rewritten_by_kv_cache_quant' in masked:
        masked['rewritten_by_kv_cache_quant'] = [mask(name, *secrets) for name in result['rewritten_by_kv_cache_quant']]
    return masked


def ignored(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` (relative, '/'-separated) matches one of the shell patterns; '*' also matches '/'."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def check_directory(path: str) -> None:
    """The checkpoint path must be a directory (kv_cache_quant's check, with this module's error)."""
    check_checkpoint_directory(path, VerifyError)


def inside(real: str, real_root: str) -> bool:
    """Whether the resolved path ``real`` is ``real_root`` or under it."""
    return os.path.commonpath([real, real_root]) == real_root


class Listing:
    """What list_files found under a checkpoint: {relative name: os.lstat_result} of everything but directories,
    and {relative name: resolved target} of the links that leave it."""

    def __init__(self) -> None:
        self.files: dict[str, os.stat_result] = {}
        self.outside: dict[str, str] = {}


def list_files(root: str, patterns: Sequence[str], links_outside: bool = False) -> Listing:
    """Everything but directories under ``root``, ignored names left out.

    Links to directories are followed once (a directory reached twice is a loop). A link that resolves outside
    ``root`` is listed in ``outside``; unless ``links_outside``, a directory it leads to is not walked (a link to
    ``/`` would walk the whole host).
    """
    listing = Listing()
    real_root = os.path.realpath(root)
    visited = set()
    for top, dirs, files in os.walk(root, followlinks=True):
        info = os.stat(top)
        if (info.st_dev, info.st_ino) in visited:
            dirs[:] = []
            continue
        visited.add((info.st_dev, info.st_ino))
        rel_top = os.path.relpath(top, root)
        prefix = '' if rel_top == '.' else rel_top.replace(os.sep, '/') + '/'
        dirs[:] = [d for d in dirs if not ignored(prefix + d + '/', patterns)]
        for name in list(dirs):
            real = os.path.realpath(os.path.join(top, name))
            if not inside(real, real_root):
                listing.outside[prefix + name] = real
                if not links_outside:
                    dirs.remove(name)
        for name in files:
            rel = prefix + name
            if ignored(rel, patterns):
                continue
            full = os.path.join(top, name)
            try:
                listing.files[rel] = os.lstat(full)
            except FileNotFoundError:
                continue  # removed since the listing (a temporary file of a running download)
            real = os.path.realpath(full)
            if not inside(real, real_root) and not any(rel.startswith(link + '/') for link in listing.outside):
                listing.outside[rel] = real
    return listing


class FileCheck:
    """What checking one file found: problems, the digest of its content, bytes read, whether the cache answered."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.problems: list[dict[str, str]] = []
        self.digest: Optional[str] = None
        self.hashed_bytes = 0
        self.cache_hit = False


def _stat_problem(full: str, name: str) -> Union[tuple[os.stat_result, None], tuple[None, dict[str, str]]]:
    """(os.stat_result, None) for a regular file, else (None, problem)."""
    try:
        info = os.stat(full)
    except OSError as exc:
        if os.path.islink(full):
            return None, problem(name, MISSING, 'a broken symbolic link to %s' % os.readlink(full))
        if not os.path.lexists(full):
            return None, problem(name, MISSING, 'not in the checkpoint')
        return None, problem(name, UNREADABLE, 'cannot read it: %s' % (exc.strerror or exc))
    if not stat.S_ISREG(info.st_mode):
        return None, problem(name, UNREADABLE, '%s, not a regular file' % describe_mode(info.st_mode))
    return info, None


def _size_problem(name: str, size: int, expected: int) -> Optional[dict[str, str]]:
    if size < expected:
        return problem(
            name,
            TRUNCATED,
            '%d bytes, the manifest says %d (%d missing: an interrupted download?)' % (size, expected, expected - size),
        )
    if size > expected:
        return problem(name, OVERSIZED, '%d bytes, the manifest says %d (%d more)' % (size, expected, size - expected))
    return None


def header_problem(full: str) -> Optional[str]:
    """Why a safetensors file is not one safetensors can load, or None.

    safetensors requires the tensors' data to follow the header without gaps or
    overlaps and to end exactly at the end of the file.
    """
    try:
        shard = read_header(full)
    except CheckpointError as exc:
        return str(exc)
    extra = shard.file_bytes - shard.header_bytes - shard.data_bytes
    if extra:
        return (
            '%s has %d bytes after the tensor data its header describes; safetensors requires the data to end the file'
            % (full, extra)
        )
    covered = sum(shard.tensors.values())
    if covered != shard.data_bytes:
        return (
            '%s: its tensors take %d bytes but their offsets span %d; safetensors requires them to follow one another'
            % (full, covered, shard.data_bytes)
        )
    return None


def check_file(
    root: str, entry: ManifestFile, cache: Optional[DigestCache], size_may_differ: bool = False
) -> FileCheck:
    """Check one manifest file: present, regular, size, digest and, for safetensors, the header.

    ``size_may_differ``: a config file kv_cache_quant rewrote, judged after the pool.
    """
    check = FileCheck(entry.name)
    full = os.path.join(root, entry.name)
    found: Union[dict[str, str], str, None]  # a problem, then the header's verdict
    info, found = _stat_problem(full, entry.name)
    if found:
        check.problems.append(found)
        return check
    # _stat_problem gives the stat_result or a problem.
    info = cast(os.stat_result, info)
    found = _size_problem(entry.name, info.st_size, entry.size)
    if found and not size_may_differ:
        check.problems.append(found)
        return check
    check.digest = cache.get(full, info, entry.algorithm) if cache else None
    if check.digest is not None:
        check.cache_hit = True
    else:
        try:
            digests, info = hash_file(full, [entry.algorithm])
        except DigestError as exc:
            check.problems.append(problem(entry.name, UNREADABLE, str(exc)))
            return check
        check.digest = digests[entry.algorithm]
        check.hashed_bytes = info.st_size
        if cache:
            cache.put(full, info, {entry.algorithm: check.digest})
    if check.digest != entry.digest and not size_may_differ:
        check.problems.append(
            problem(
                entry.name,
                DIGEST_MISMATCH,
                '%s %s, the manifest says %s' % (entry.algorithm, check.digest, entry.digest),
            )
        )
    if entry.name.endswith('.safetensors'):
        found = _cached_fact(cache, full, info, HEADER_FACT, header_problem)
        if found:
            check.problems.append(problem(entry.name, BAD_SAFETENSORS_HEADER, found))
    return check


@overload
def _cached_fact(
    cache: Optional[DigestCache],
    full: str,
    info: os.stat_result,
    fact: str,
    compute: Callable[[str], Optional[str]],
    kind: type[str] = ...,
) -> Optional[str]:
    """A string fact (a verdict), or None."""


@overload
def _cached_fact(
    cache: Optional[DigestCache],
    full: str,
    info: os.stat_result,
    fact: str,
    compute: Callable[[str], Union[str, list[str], None]],
    kind: type[list[Any]],
) -> Union[str, list[str], None]:
    """A list of strings, or the string compute gave instead (a problem), or None."""


def _cached_fact(
    cache: Optional[DigestCache],
    full: str,
    info: os.stat_result,
    fact: str,
    compute: Callable[[str], Union[str, list[str], None]],
    kind: Union[type[str], type[list[Any]]] = str,
) -> Union[str, list[str], None]:
    """compute(full), remembered in the cache for these very bytes ('' stands for None)."""
    value = cache.get(full, info, fact, kind) if cache else None
    if value is None:
        value = compute(full)
        if cache:
            cache.put(full, info, {fact: value if value is not None else ''})
    return value or None


def original_config_bytes(path: str, name: str, record: Record) -> bytes:
    """The bytes of config file ``name`` as they were before kv_cache_quant stripped it, rebuilt from its record.

    Raises KvCacheQuantError when the file is not what the record says it left.
    """
    config = read_checkpoint(path).get(name)
    if config is None:
        raise KvCacheQuantError('%s is missing' % name)
    changes = []
    for entry in record['entries']:
        if entry['file'] != name:
            continue
        keys = tuple(entry['path'])
        try:
            current = get_path(config.doc, keys)
        except KeyError:
            raise KvCacheQuantError(
                '%s, which its record says it set to null, is no longer there' % entry['key']
            ) from None
        if current is not None:
            raise KvCacheQuantError('%s is %s, where its record says it set null' % (entry['key'], compact(current)))
        changes.append({'keys': keys, 'after': entry['before'], 'after_text': entry.get('before_text')})
    text = apply_changes(config.text, config.doc, changes, name)[0]
    return text.encode('utf-8')


class Report:
    """The outcome of one check."""

    def __init__(self) -> None:
        self.problems: list[dict[str, str]] = []
        self.rewritten: list[str] = []
        self.files = 0
        self.bytes = 0
        self.cache_hits = 0
        self.hashed_bytes = 0
        self.fingerprint: Optional[str] = None

    @property
    def ok(self) -> bool:
        return not self.problems


def fingerprint(digests: list[tuple[str, str, Optional[str]]]) -> str:
    """SHA-256 of the sorted (name, algorithm, digest) triples as JSON: equal on every node that holds the same bytes."""
    return hashlib.sha256(json.dumps(sorted(digests), separators=(',', ':')).encode('utf-8')).hexdigest()


class _Record:
    """kv_cache_quant's record beside the checkpoint: the files it rewrote, or the problem reading it."""

    def __init__(self, path: str) -> None:
        self.doc: Optional[Record] = None
        self.problem: Optional[dict[str, str]] = None
        try:
            self.doc = read_record(path)
        except KvCacheQuantError as exc:
            self.problem = problem(RECORD_NAME, UNREADABLE, str(exc))
        self.files = set(entry['file'] for entry in self.doc['entries']) if self.doc else set()


def _judge_rewritten(
    path: str, entry: ManifestFile, check: FileCheck, record: _Record, report: Report
) -> Optional[str]:
    """A config file that differs from the manifest and that kv_cache_quant's record lists: the digest to fingerprint, or None."""
    if check.problems or check.digest == entry.digest:
        report.problems.extend(check.problems)
        return entry.digest if not check.problems else None
    try:
        # record.files, which names entry.name, is empty without a record.
        original = original_config_bytes(path, entry.name, cast(Record, record.doc))
    except KvCacheQuantError as exc:
        report.problems.append(
            problem(
                entry.name,
                DIGEST_MISMATCH,
                '%s %s, the manifest says %s; %s lists it as rewritten, '
                'but %s' % (entry.algorithm, check.digest, entry.digest, RECORD_NAME, exc),
            )
        )
        return None
    restored = digest_of_bytes(original, entry.algorithm)
    if len(original) != entry.size or restored != entry.digest:
        detail = (
            'with the values %s recorded put back: %d bytes, %s %s; the manifest says %d bytes, %s '
            '(changed after kv_cache_quant rewrote it)'
            % (RECORD_NAME, len(original), entry.algorithm, restored, entry.size, entry.digest)
        )
        report.problems.append(problem(entry.name, DIGEST_MISMATCH, detail))
        return None
    report.rewritten.append(entry.name)
    return check.digest


def _check_index(
    path: str,
    expected: dict[str, ManifestFile],
    checks: dict[str, FileCheck],
    cache: Optional[DigestCache],
    report: Report,
) -> None:
    """The safetensors index may only name shards that are there."""
    if INDEX_NAME not in expected or checks[INDEX_NAME].problems:
        return
    full = os.path.join(path, INDEX_NAME)

    def shard_names(index_path: str) -> Union[str, list[str]]:
        try:
            weight_map = read_json(index_path).get('weight_map')
        except CheckpointError as exc:
            return str(exc)
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            return '%s has no weight_map of tensor names to shard files' % index_path
        return sorted(set(weight_map.values()))

    try:
        shards = _cached_fact(cache, full, os.stat(full), INDEX_FACT, shard_names, list)
    except FileNotFoundError:
        return  # removed since its own check: the next run names it missing
    if isinstance(shards, str):
        report.problems.append(problem(INDEX_NAME, BAD_SAFETENSORS_INDEX, shards))
        return
    reported_missing = set(p['file'] for p in report.problems if p['kind'] == MISSING)
    for shard in shards or ():
        unsafe = name_problem(shard)
        if unsafe:
            report.problems.append(
                problem(
                    INDEX_NAME,
                    BAD_SAFETENSORS_INDEX,
                    'its weight_map names shard %s, which %s' % (compact(shard), unsafe),
                )
            )
        elif shard not in reported_missing and not os.path.isfile(os.path.join(path, shard)):
            report.problems.append(
                problem(
                    shard,
                    INDEX_NAMES_MISSING_SHARD,
                    '%s maps tensors to it, but it is not in the checkpoint' % INDEX_NAME,
                )
            )


def manifest_totals(manifest: Manifest, patterns: Sequence[str] = DEFAULT_IGNORE) -> tuple[int, int]:
    """(files, bytes) of the manifest's files a check covers (those the ignore patterns leave in)."""
    sizes = [entry.size for name, entry in manifest.files.items() if not ignored(name, patterns)]
    return len(sizes), sum(sizes)


def verify(
    path: str,
    manifest: Manifest,
    patterns: Sequence[str] = DEFAULT_IGNORE,
    threads: int = 1,
    cache: Optional[DigestCache] = None,
    links_outside: bool = False,
) -> Report:
    """Check the checkpoint at ``path`` against ``manifest``; a Report. A link that leaves the checkpoint is a
    problem unless ``links_outside``."""
    check_directory(path)
    # Parsing the safetensors headers of a big checkpoint makes millions of short-lived
    # objects and no cycles: the cyclic collector would only rescan them (see _safetensors.scan).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _verify(path, manifest, patterns, threads, cache, links_outside)
    finally:
        if enabled:
            gc.enable()


def _verify(
    path: str,
    manifest: Manifest,
    patterns: Sequence[str],
    threads: int,
    cache: Optional[DigestCache],
    links_outside: bool,
) -> Report:
    report = Report()
    listing = list_files(path, patterns, links_outside)
    on_disk = listing.files
    if not links_outside:
        # What --trust-remote-code would run, or a weight read from elsewhere, must be the checkpoint's own.
        for name, target in sorted(listing.outside.items()):
            report.problems.append(
                problem(name, LINK_OUTSIDE, 'a link that leads outside the checkpoint, to %s' % printable(target))
            )
    expected = dict((name, entry) for name, entry in manifest.files.items() if not ignored(name, patterns))
    # Read even when an ignore pattern hides it: it is what makes a rewritten config pass.
    record = _Record(path) if os.path.lexists(os.path.join(path, RECORD_NAME)) else None
    if record is not None and record.problem:
        report.problems.append(record.problem)
    rewritable = record.files if record is not None else set()
    # Largest first, so that no big file starts last while the other threads idle.
    order = sorted(expected.values(), key=lambda e: (-e.size, e.name))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        checks = dict(
            zip([e.name for e in order], pool.map(lambda e: check_file(path, e, cache, e.name in rewritable), order))
        )
    digests = []
    for name, entry in sorted(expected.items()):
        check = checks[name]
        report.files += 1
        report.bytes += entry.size
        report.hashed_bytes += check.hashed_bytes
        report.cache_hits += check.cache_hit
        if name in rewritable:
            # rewritable is empty without a record.
            digest = _judge_rewritten(path, entry, check, cast(_Record, record), report)
        else:
            report.problems.extend(check.problems)
            digest = entry.digest
        digests.append((name, entry.algorithm, digest))
    _check_index(path, expected, checks, cache, report)
    for name in sorted(set(on_disk) - set(manifest.files) - set([RECORD_NAME])):
        mode = on_disk[name].st_mode
        what = '' if stat.S_ISREG(mode) else ' (%s)' % describe_mode(mode)
        report.problems.append(
            problem(
                name,
                EXTRA_FILE,
                'in the checkpoint%s but not in the manifest of revision %s' % (what, manifest.revision),
            )
        )
    report.problems.sort(key=lambda p: (p['file'], p['kind']))
    if report.ok:
        report.fingerprint = fingerprint(digests)
    return report
