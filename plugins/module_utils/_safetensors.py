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

import json
import os
import struct

from ansible_collections.llmserve.vllm.plugins.module_utils._checkpoint import CheckpointError, read_json

INDEX_NAME = 'model.safetensors.index.json'
SINGLE_NAME = 'model.safetensors'
# safetensors refuses headers above 100 MB; anything larger is a corrupt length.
MAX_HEADER_BYTES = 100 * 1024 * 1024


class Shard(object):
    """One safetensors file's header: tensors {name: (dtype, shape, nbytes)} and sizes."""

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
    for name, info in header.items():
        if name == '__metadata__':
            continue
        try:
            begin, end = info['data_offsets']
            begin, end = int(begin), int(end)
            shape = [int(d) for d in info['shape']]
            dtype = str(info['dtype'])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError('%s has an invalid header entry for tensor %s: %s' % (path, name, json.dumps(info)[:200]))
        if end < begin:
            raise CheckpointError('%s has an invalid header entry for tensor %s: data_offsets end before they begin' % (path, name))
        tensors[name] = (dtype, shape, end - begin)
        data_end = max(data_end, end)
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
    ckpt = Checkpoint()
    index_path = os.path.join(model_path, INDEX_NAME)
    if os.path.exists(index_path):
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
            try:
                shard = read_header(path)
            except CheckpointError as exc:
                ckpt.problems.append(str(exc))
                continue
            ckpt.shards.append(shard)
            for tname, (dtype, shape, nbytes) in shard.tensors.items():
                ckpt.tensors[tname] = nbytes
        if ckpt.missing or ckpt.problems:
            # Count what the index promises so the plan is for the whole model.
            for tname, shard_name in weight_map.items():
                ckpt.tensors.setdefault(tname, None)
        ckpt.total_bytes = sum(b for b in ckpt.tensors.values() if b)
        if (ckpt.missing or ckpt.problems) and ckpt.index_total_size:
            ckpt.total_bytes = max(ckpt.total_bytes, ckpt.index_total_size)
        return ckpt
    files = sorted(f for f in os.listdir(model_path) if f.endswith('.safetensors'))
    if not files:
        raise CheckpointError('%s holds neither %s nor any *.safetensors file' % (model_path, INDEX_NAME))
    for name in files:
        shard = read_header(os.path.join(model_path, name))
        ckpt.shards.append(shard)
        for tname, (dtype, shape, nbytes) in shard.tensors.items():
            ckpt.tensors[tname] = nbytes
    ckpt.total_bytes = sum(ckpt.tensors.values())
    return ckpt
