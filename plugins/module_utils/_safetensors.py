# -*- coding: utf-8 -*-
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Sizes of a safetensors checkpoint's tensors, read from the headers alone.

PRIVATE to the collection: this is not a public API; it may change without notice.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}), then the
tensor data. Only the header is read, so a 540 GB checkpoint is sized in milliseconds.
"""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import gc
import json
import os
import re
import struct

from ansible_collections.llmserve.vllm.plugins.module_utils._checkpoint import CheckpointError, read_json

INDEX_NAME = 'model.safetensors.index.json'
SINGLE_NAME = 'model.safetensors'
# safetensors refuses headers above 100 MB; anything larger is a corrupt length.
MAX_HEADER_BYTES = 100 * 1024 * 1024


def _bad_entry(path, header):
    """The message for the first header entry that does not describe a tensor."""
    for name, info in header.items():
        if name == '__metadata__':
            continue
        try:
            begin, end = info['data_offsets']
            if int(end) - int(begin) < 0:
                return '%s has an invalid header entry for tensor %s: data_offsets end before they begin' % (path, name)
            end - begin
        except (KeyError, TypeError, ValueError, AttributeError):
            return '%s has an invalid header entry for tensor %s: %s' % (path, name, json.dumps(info)[:200])
    return '%s has an invalid header' % path


class Shard(object):
    """One safetensors file's header: tensors {name: nbytes} and sizes."""

    def __init__(self, path, tensors, header_bytes, data_bytes, file_bytes):
        self.path = path
        self.tensors = tensors
        self.header_bytes = header_bytes
        self.data_bytes = data_bytes
        self.file_bytes = file_bytes


def read_header(path):
    """Parse one safetensors file's header without touching tensor data.

    Raises CheckpointError naming the file and what is wrong with it.
    """
    try:
        file_bytes = os.path.getsize(path)
        with open(path, 'rb') as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError('%s is truncated: %d bytes, shorter than the 8-byte header length' % (path, len(head)))
            (n,) = struct.unpack('<Q', head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError('%s has a header length of %d bytes, above the 100 MB safetensors limit: not a safetensors file or corrupt' % (path, n))
            if 8 + n > file_bytes:
                raise CheckpointError('%s is truncated: its header length %d reaches beyond the end of the file (%d bytes)' % (path, n, file_bytes))
            raw = f.read(n)
    except (IOError, OSError) as exc:
        raise CheckpointError('cannot read %s: %s' % (path, exc.strerror or exc))
    try:
        header = json.loads(raw.decode('utf-8'))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError('%s has an invalid header (not JSON): %s' % (path, exc))
    if not isinstance(header, dict):
        raise CheckpointError('%s has an invalid header: a JSON object was expected' % path)
    tensors = {}
    data_end = 0
    try:
        # The hot loop of a 280,000-tensor checkpoint: keep it lean.
        for name, info in header.items():
            if name == '__metadata__':
                continue
            begin, end = info['data_offsets']
            nbytes = end - begin
            if nbytes < 0:
                raise ValueError(name)
            tensors[name] = nbytes
            if end > data_end:
                data_end = end
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointError(_bad_entry(path, header))
    expected = 8 + n + data_end
    if file_bytes < expected:
        raise CheckpointError('%s is truncated: %d bytes on disk, its header describes %d (an unfinished download?)' % (path, file_bytes, expected))
    return Shard(path, tensors, 8 + n, data_end, file_bytes)


class Checkpoint(object):
    """What the preflight knows of a checkpoint's weights.

    ``tensors``: {name: bytes} when sizes are known (from headers), else {name: None}
    (from the index only). ``total_bytes``: sum of tensor bytes (headers) or the
    index's metadata.total_size. ``source``: ``headers`` or ``index``. ``problems``:
    shards the index names that are missing or truncated.
    """

    def __init__(self):
        self.tensors = {}
        self.total_bytes = 0
        self.source = 'headers'
        self.shards = []
        self.missing = []
        self.problems = []
        self.index_total_size = None


def scan(model_path):
    """Read a checkpoint's safetensors headers (or, without shards, its index)."""
    # Parsing 280,000 header entries creates millions of short-lived objects; the cyclic
    # garbage collector would rescan them again and again (2-3x the parse time). None
    # of them form cycles, so it is paused for the scan.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _scan(model_path)
    finally:
        if enabled:
            gc.enable()


_NUMBERED = re.compile(r'^(.+)-(\d+)-of-(\d+)\.safetensors$')


def complete_numbered_set(model_path):
    """The shard files if the directory holds every one of a numbered set (model-00001-of-00119 ...), else None.

    Then nothing the index could name is missing, and its weight_map (30 MB of JSON for
    Kimi-K2.5, as long to parse as all the headers) need not be read.
    """
    sets = {}
    for f in os.listdir(model_path):
        m = _NUMBERED.match(f)
        if m:
            sets.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    if len(sets) != 1:
        return None
    (prefix, total), numbers = sets.popitem()
    if numbers != set(range(1, int(total) + 1)):
        return None
    return ['%s-%s-of-%s.safetensors' % (prefix, str(i).zfill(len(total)), total) for i in range(1, int(total) + 1)]


def _add_shard(ckpt, path):
    """Add one shard's tensors to ckpt, or its problem when its header is broken."""
    try:
        shard = read_header(path)
    except CheckpointError as exc:
        ckpt.problems.append(str(exc))
        return
    ckpt.shards.append(shard)
    ckpt.tensors.update(shard.tensors)


def _scan(model_path):
    ckpt = Checkpoint()
    index_path = os.path.join(model_path, INDEX_NAME)
    complete = complete_numbered_set(model_path)
    if complete is not None:
        for name in complete:
            _add_shard(ckpt, os.path.join(model_path, name))
        ckpt.total_bytes = sum(ckpt.tensors.values())
        if ckpt.problems and os.path.exists(index_path):
            return _scan_with_index(model_path, index_path)
        return ckpt
    if os.path.exists(index_path):
        return _scan_with_index(model_path, index_path)
    return _scan_files(model_path)


def _scan_with_index(model_path, index_path):
    """The index says which shards make the model: report those missing or broken."""
    ckpt = Checkpoint()
    index = read_json(index_path)
    weight_map = index.get('weight_map')
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError('%s has no weight_map: not a safetensors index' % index_path)
    meta = index.get('metadata') if isinstance(index.get('metadata'), dict) else {}
    if meta.get('total_size') is not None:
        try:
            ckpt.index_total_size = int(meta['total_size'])
        except (TypeError, ValueError):
            raise CheckpointError('%s has a metadata.total_size that is not a number: %r' % (index_path, meta['total_size']))
    shard_names = sorted(set(weight_map.values()))
    present = [s for s in shard_names if os.path.exists(os.path.join(model_path, s))]
    if not present:
        # Planning before the download: the index alone.
        if ckpt.index_total_size is None:
            raise CheckpointError('%s names %d shards, none present, and has no metadata.total_size' % (index_path, len(shard_names)))
        ckpt.source = 'index'
        ckpt.tensors = dict((name, None) for name in weight_map)
        ckpt.total_bytes = ckpt.index_total_size
        ckpt.missing = shard_names
        return ckpt
    for name in shard_names:
        path = os.path.join(model_path, name)
        if name not in present:
            ckpt.missing.append(name)
            ckpt.problems.append('%s is named in %s but missing' % (path, INDEX_NAME))
            continue
        _add_shard(ckpt, path)
    if ckpt.missing or ckpt.problems:
        # Count what the index promises so the plan is for the whole model.
        for tname, shard_name in weight_map.items():
            ckpt.tensors.setdefault(tname, None)
    ckpt.total_bytes = sum(b for b in ckpt.tensors.values() if b)
    if (ckpt.missing or ckpt.problems) and ckpt.index_total_size:
        ckpt.total_bytes = max(ckpt.total_bytes, ckpt.index_total_size)
    return ckpt


def _scan_files(model_path):
    """No index: every *.safetensors file in the directory."""
    ckpt = Checkpoint()
    files = sorted(f for f in os.listdir(model_path) if f.endswith('.safetensors'))
    if not files:
        raise CheckpointError('%s holds neither %s nor any *.safetensors file' % (model_path, INDEX_NAME))
    for name in files:
        shard = read_header(os.path.join(model_path, name))
        ckpt.shards.append(shard)
        ckpt.tensors.update(shard.tensors)
    ckpt.total_bytes = sum(ckpt.tensors.values())
    return ckpt
