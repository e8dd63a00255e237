# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Sizes of a safetensors checkpoint's tensors, read from the headers alone.

PRIVATE to the collection: this is not a public API; it may change without notice.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}), then the
tensor data. Only the header is read, so a 540 GB checkpoint is sized in milliseconds.
"""

import gc
import json
import math
import os
import re
import struct
from typing import Any, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import (
    CheckpointError,
    open_regular,
    read_json,
)

INDEX_NAME = 'model.safetensors.index.json'
# safetensors refuses headers above 100 MB; anything larger is a corrupt length.
MAX_HEADER_BYTES = 100 * 1024 * 1024


# Bits per element of each safetensors dtype (safetensors/src/tensor.rs, Dtype::bitsize).
DTYPE_BITS = {
    'F4': 4,
    'F6_E2M3': 6,
    'F6_E3M2': 6,
    'BOOL': 8,
    'U8': 8,
    'I8': 8,
    'F8_E5M2': 8,
    'F8_E4M3': 8,
    'F8_E8M0': 8,
    'I16': 16,
    'U16': 16,
    'F16': 16,
    'BF16': 16,
    'I32': 32,
    'U32': 32,
    'F32': 32,
    'I64': 64,
    'U64': 64,
    'F64': 64,
    'C64': 64,
}
# Offsets are u64 in safetensors.
OFFSET_LIMIT = 2**64
# A byte count of one checkpoint, as vLLM's int64 arithmetic holds it.
MAX_TOTAL_SIZE = 2**63 - 1


def _is_int(value: Any) -> bool:
    """Whether value is a JSON integer: true and false are no offsets or dimensions, though bool is an int in Python."""
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A JSON value for a message, cut short."""
    return json.dumps(value)[:200]


def entry_problem(info: Any) -> Optional[str]:
    """Why one header entry describes no tensor, or None when it does.

    The checks safetensors makes before it loads: offsets within u64 and in order, a known
    dtype, a shape of non-negative dimensions whose elements fill the offsets exactly.
    """
    if not isinstance(info, dict) or not all(k in info for k in ('dtype', 'shape', 'data_offsets')):
        return _shown(info)
    offsets = info['data_offsets']
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] < OFFSET_LIMIT
    ):
        return 'data_offsets %s are not two integers 0 <= begin <= end < 2**64' % _shown(offsets)
    dtype = info['dtype']
    bits = DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        return 'dtype %s is not a safetensors dtype' % _shown(dtype)
    shape = info['shape']
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        return 'shape %s is not a list of non-negative integers' % _shown(shape)
    elements = 1
    for d in shape:
        elements *= d
    nbytes = offsets[1] - offsets[0]
    if elements * bits != nbytes * 8:
        takes = '%d bytes' % (elements * bits // 8) if elements * bits % 8 == 0 else '%d bits' % (elements * bits)
        return 'shape %s of %s takes %s, data_offsets %s hold %d' % (
            _shown(shape),
            dtype,
            takes,
            _shown(offsets),
            nbytes,
        )
    return None


class Shard:
    """One safetensors file's header: tensors {name: nbytes} and sizes."""

    def __init__(self, path: str, tensors: dict[str, int], header_bytes: int, data_bytes: int, file_bytes: int) -> None:
        self.path = path
        self.tensors = tensors
        self.header_bytes = header_bytes
        self.data_bytes = data_bytes
        self.file_bytes = file_bytes


def read_header(path: str) -> Shard:
    """Parse one safetensors file's header without touching tensor data.

    Raises CheckpointError naming the file and what is wrong with it.
    """
    try:
        with open_regular(path) as f:
            file_bytes = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    '%s is truncated: %d bytes, shorter than the 8-byte header length' % (path, len(head))
                )
            (n,) = struct.unpack('<Q', head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    '%s has a header length of %d bytes, above the 100 MB safetensors limit: not a safetensors file or corrupt'
                    % (path, n)
                )
            if 8 + n > file_bytes:
                raise CheckpointError(
                    '%s is truncated: its header length %d reaches beyond the end of the file (%d bytes)'
                    % (path, n, file_bytes)
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError('cannot read %s: %s' % (path, exc.strerror or exc)) from exc
    tensors, data_end = _parse_header(raw, path)
    expected = 8 + n + data_end
    if file_bytes < expected:
        raise CheckpointError(
            '%s is truncated: %d bytes on disk, its header describes %d (an unfinished download?)'
            % (path, file_bytes, expected)
        )
    return Shard(path, tensors, 8 + n, data_end, file_bytes)


def parse_header(header_json: bytes, where: str, data_bytes_available: Optional[int]) -> dict[str, int]:
    """{tensor: bytes} of a safetensors header's JSON, read from a file or fetched from elsewhere.

    ``where`` names its source in messages; ``data_bytes_available``, when known, is how many
    bytes follow the header, which must hold every tensor's data. Raises CheckpointError.
    """
    tensors, data_end = _parse_header(header_json, where)
    if data_bytes_available is not None and data_end > data_bytes_available:
        raise CheckpointError(
            '%s is truncated: its header describes %d bytes of tensor data, %d follow it'
            % (where, data_end, data_bytes_available)
        )
    return tensors


def _parse_header(raw: bytes, where: str) -> tuple[dict[str, int], int]:
    """({tensor: bytes}, end of the last tensor's data) of a header's JSON; CheckpointError naming ``where``."""
    try:
        header = json.loads(raw.decode('utf-8'))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError('%s has an invalid header (not JSON): %s' % (where, exc)) from exc
    except RecursionError:
        raise CheckpointError('%s has an invalid header (nested too deeply)' % where) from None
    if not isinstance(header, dict):
        raise CheckpointError('%s has an invalid header: a JSON object was expected' % where)
    tensors = {}
    data_end = 0
    # The hot loop of a 280,000-tensor checkpoint: entry_problem's checks, lean (JSON true and
    # false pass as 1 and 0 here, where the sizes still agree); entry_problem words what fails.
    for name, info in header.items():
        if name == '__metadata__':
            continue
        try:
            begin, end = info['data_offsets']
            shape = info['shape']
            elements = 1
            for d in shape:
                elements *= d
            valid = (
                isinstance(begin, int)
                and isinstance(end, int)
                and isinstance(elements, int)
                and 0 <= begin <= end < OFFSET_LIMIT
                and min(shape, default=0) >= 0
                and elements * DTYPE_BITS[info['dtype']] == (end - begin) * 8
            )
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise CheckpointError(
                '%s has an invalid header entry for tensor %s: %s' % (where, _shown(name), entry_problem(info))
            )
        tensors[name] = end - begin
        if end > data_end:
            data_end = end
    return tensors, data_end


class Checkpoint:
    """What the preflight knows of a checkpoint's weights.

    ``tensors``: {name: bytes} when sizes are known (from headers), else {name: None}
    (from the index only). ``total_bytes``: sum of tensor bytes (headers) or the
    index's metadata.total_size. ``source``: ``headers``, ``index``, or ``hub`` once the module has sized an index's
    tensors from the shards' headers on the Hub. ``problems``:
    shards the index names that are missing or truncated.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, Optional[int]] = {}
        self.total_bytes = 0
        self.source = 'headers'
        self.shards: list[Shard] = []
        self.missing: list[str] = []
        self.problems: list[str] = []
        self.index_total_size: Optional[int] = None
        # The preflight's sizes of unsized tensors from a config (the config and quantization config they were
        # worked out for, then the sizes): kept with the checkpoint, whose tensors they size.
        self.sized_by_config: Optional[tuple[Any, Any, Any]] = None


def scan(model_path: str) -> Checkpoint:
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


def complete_numbered_set(model_path: str) -> Optional[list[str]]:
    """The shard files if the directory holds every one of a numbered set (model-00001-of-00119 ...), else None.

    Then nothing the index could name is missing, and its weight_map (30 MB of JSON for
    Kimi-K2.5, as long to parse as all the headers) need not be read.
    """
    sets: dict[tuple[str, str], set[int]] = {}
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


def _add_shard(ckpt: Checkpoint, path: str) -> None:
    """Add one shard's tensors to ckpt, or its problem when its header is broken."""
    try:
        shard = read_header(path)
    except CheckpointError as exc:
        ckpt.problems.append(str(exc))
        return
    ckpt.shards.append(shard)
    ckpt.tensors.update(shard.tensors)


def _scan(model_path: str) -> Checkpoint:
    ckpt = Checkpoint()
    index_path = os.path.join(model_path, INDEX_NAME)
    complete = complete_numbered_set(model_path)
    if complete is not None:
        for name in complete:
            _add_shard(ckpt, os.path.join(model_path, name))
        ckpt.total_bytes = sum(b for b in ckpt.tensors.values() if b)
        if ckpt.problems and os.path.exists(index_path):
            return _scan_with_index(model_path, index_path)
        return ckpt
    if os.path.exists(index_path):
        return _scan_with_index(model_path, index_path)
    return _scan_files(model_path)


def _scan_with_index(model_path: str, index_path: str) -> Checkpoint:
    """The index says which shards make the model: report those missing or broken."""
    index = read_json(index_path)
    weight_map, total_size = index_entries(index, index_path)
    shard_names = sorted(set(weight_map.values()))
    present = [s for s in shard_names if os.path.exists(os.path.join(model_path, s))]
    if not present:
        # Planning before the download: the index alone.
        if total_size is None:
            raise CheckpointError(
                '%s names %d shards, none present, and has no metadata.total_size' % (index_path, len(shard_names))
            )
        return index_only(weight_map, total_size)
    ckpt = Checkpoint()
    ckpt.index_total_size = total_size
    for name in shard_names:
        path = os.path.join(model_path, name)
        if name not in present:
            ckpt.missing.append(name)
            ckpt.problems.append('%s is named in %s but missing' % (path, INDEX_NAME))
            continue
        _add_shard(ckpt, path)
    if ckpt.missing or ckpt.problems:
        # Count what the index promises so the plan is for the whole model.
        for tname in weight_map:
            ckpt.tensors.setdefault(tname, None)
    ckpt.total_bytes = sum(b for b in ckpt.tensors.values() if b)
    if (ckpt.missing or ckpt.problems) and ckpt.index_total_size:
        ckpt.total_bytes = max(ckpt.total_bytes, ckpt.index_total_size)
    return ckpt


def index_entries(index: dict[str, Any], where: str) -> tuple[dict[str, str], Optional[int]]:
    """({tensor: shard file}, metadata.total_size or None) of a weights index, read from a file or fetched from
    elsewhere; ``where`` names its source in messages. Raises CheckpointError."""
    weight_map = index.get('weight_map')
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError('%s has no weight_map: not a safetensors index' % where)
    meta = index.get('metadata')
    if not isinstance(meta, dict):
        meta = {}
    total_size = None
    if meta.get('total_size') is not None:
        total_size = _byte_count(meta['total_size'])
        if total_size is None:
            raise CheckpointError(
                '%s has a metadata.total_size that is not a byte count (an integer from 0 to 2**63 - 1): %s'
                % (where, _shown(meta['total_size']))
            )
    for tname, shard_name in weight_map.items():
        if not isinstance(shard_name, str):
            raise CheckpointError(
                '%s maps tensor %s to %s, where a shard file name was expected'
                % (where, _shown(tname), _shown(shard_name))
            )
    return weight_map, total_size


def index_only(weight_map: dict[str, str], total_size: Optional[int]) -> Checkpoint:
    """The checkpoint before its shards are there: the tensors the index names, unsized, every shard missing."""
    ckpt = Checkpoint()
    ckpt.index_total_size = total_size
    ckpt.source = 'index'
    ckpt.tensors = dict((name, None) for name in weight_map)
    ckpt.total_bytes = total_size or 0
    ckpt.missing = sorted(set(weight_map.values()))
    return ckpt


def has_weights(model_path: str) -> bool:
    """Whether the directory holds a weights index or any *.safetensors file, something scan() plans from."""
    if not os.path.isdir(model_path):
        return False
    return any(f == INDEX_NAME or f.endswith('.safetensors') for f in os.listdir(model_path))


def _byte_count(value: Any) -> Optional[int]:
    """value as an int when it is a whole number of bytes (some tools write total_size as a float), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if 0 <= value <= MAX_TOTAL_SIZE else None


def _scan_files(model_path: str) -> Checkpoint:
    """No index: every *.safetensors file in the directory."""
    ckpt = Checkpoint()
    files = sorted(f for f in os.listdir(model_path) if f.endswith('.safetensors'))
    if not files:
        raise CheckpointError('%s holds neither %s nor any *.safetensors file' % (model_path, INDEX_NAME))
    for name in files:
        shard = read_header(os.path.join(model_path, name))
        ckpt.shards.append(shard)
        ckpt.tensors.update(shard.tensors)
    ckpt.total_bytes = sum(b for b in ckpt.tensors.values() if b)
    return ckpt
