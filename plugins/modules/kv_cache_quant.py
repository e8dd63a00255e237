#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, division, print_function
__metaclass__ = type

DOCUMENTATION = r'''
---
module: kv_cache_quant
short_description: Strip or restore the FP8 KV-cache quantization of a model checkpoint
version_added: 0.1.0
description:
  - Finds the FP8 KV-cache quantization a checkpoint declares and replaces it with V(null),
    so that vLLM's C(--kv-cache-dtype auto) keeps the KV cache in the model's dtype; or puts back
    exactly what it replaced.
  - "It looks in C(hf_quant_config.json) (C(quantization.kv_cache_quant_algo), the nested ModelOpt
    form) and in C(config.json): C(quantization_config.kv_cache_scheme) (an object or the string form),
    C(quantization_config.kv_cache_quant_algo), and the same under C(text_config) for multimodal
    checkpoints such as Kimi-K2.5. ModelOpt and compressed-tensors checkpoints alike."
  - Keys are never deleted, only set to V(null). vLLM's NVFP4 loader requires the key
    C(kv_cache_quant_algo) in the nested C(hf_quant_config.json) form.
  - Only an FP8 KV cache is stripped (C(kv_cache_quant_algo) V(FP8), a C(kv_cache_scheme) with
    C(num_bits) 8 and C(type) V(float), or the string V(FP8)). Other values (an NVFP4 or int8 KV cache)
    stay as they are, with a warning.
  - When C(config.json) has a C(quantization_config), vLLM ignores C(hf_quant_config.json); both are
    stripped all the same, so that the checkpoint stays consistent.
  - Only the changed values change in the files; key order, indentation and the trailing newline stay,
    so C(--diff) shows just those lines. All edits are planned and checked in memory first; on bad input
    nothing is modified.
  - Files are replaced atomically. A config file that is a symbolic link, as in the Hugging Face cache
    (C(snapshots/<rev>/config.json -> ../../blobs/<sha>), a blob that other revisions share), is replaced
    by a real file in that snapshot; the blob is never written.
  - O(state=absent) keeps a record beside the checkpoint, C(<path>/.llmserve-kv-cache-quant.json), a JSON
    file a person can read, with the file, key, original value (and its exact text), the link the file was
    and the time. O(state=present) puts those values back, byte for byte, turns a file that was a link back
    into that link when the blob still holds the same bytes, and removes the record.
author:
  - llmserve.vllm contributors (@llmserve)
options:
  path:
    description:
      - The checkpoint directory, the one that holds C(config.json) and/or C(hf_quant_config.json).
      - For a Hugging Face cache, the snapshot directory C(models--ORG--NAME/snapshots/<rev>).
    type: path
    required: true
  state:
    description:
      - V(absent) strips the FP8 KV-cache quantization (each such key set to V(null)).
      - V(present) restores the values a previous V(absent) run recorded. Without a record there is
        nothing to restore; the module then reports C(changed=false) with a warning instead of failing,
        so that a play can always ensure V(present).
    type: str
    choices: [absent, present]
    default: absent
  backup:
    description:
      - Keep a timestamped copy of each config file before it is changed, next to it.
    type: bool
    default: false
extends_documentation_fragment:
  - llmserve.vllm.attributes
  - llmserve.vllm.attributes.CHANGES_FILES
notes:
  - The KV-cache dtype this module reports mirrors vLLM 0.32.0. Whether an FP8 KV cache works depends on
    the GPU and the vLLM version (on SM120, older vLLM had only the Triton MLA backend, which did not support
    an FP8 KV cache); decide with that in mind.
seealso:
  - name: vLLM quantized KV cache
    description: How vLLM uses an FP8 KV cache.
    link: https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/
'''

EXAMPLES = r'''
- name: Ensure the checkpoint does not ask for an FP8 KV cache
  llmserve.vllm.kv_cache_quant:
    path: /models/Kimi-K2.5-NVFP4
    state: absent
  register: __kv

- name: Show which KV-cache dtype vLLM will now choose
  ansible.builtin.debug:
    msg: "{{ __kv.kv_cache_dtype_before }} -> {{ __kv.kv_cache_dtype_after }}"

- name: Ensure a Hugging Face cache snapshot keeps its blobs intact while stripping
  llmserve.vllm.kv_cache_quant:
    path: /srv/hf/hub/models--nvidia--Kimi-K2.5-NVFP4/snapshots/0123456789abcdef0123456789abcdef01234567
    backup: true

- name: Ensure the checkpoint's original KV-cache quantization is back
  llmserve.vllm.kv_cache_quant:
    path: /models/Kimi-K2.5-NVFP4
    state: present
'''

RETURN = r'''
path:
  description: The checkpoint directory.
  returned: always
  type: str
  sample: /models/Kimi-K2.5-NVFP4
files:
  description: The config files that change (or would change in check mode), one entry per file.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The file.
      returned: always
      type: str
      sample: /models/Kimi-K2.5-NVFP4/hf_quant_config.json
    changes:
      description: The keys that change, as a dotted key path with the values before and after.
      returned: always
      type: list
      elements: dict
      sample: [{key: quantization.kv_cache_quant_algo, before: FP8, after: null}]
    backup_file:
      description: The backup copy of the file.
      returned: when O(backup=true) and the file changed
      type: str
      sample: /models/Kimi-K2.5-NVFP4/hf_quant_config.json.2412.2026-11-30@04:10:00~
  sample:
    - path: /models/Kimi-K2.5-NVFP4/hf_quant_config.json
      changes: [{key: quantization.kv_cache_quant_algo, before: FP8, after: null}]
record:
  description:
    - The record file beside the checkpoint, written by O(state=absent) and removed by O(state=present).
  returned: always
  type: str
  sample: /models/Kimi-K2.5-NVFP4/.llmserve-kv-cache-quant.json
kv_cache_dtype_before:
  description:
    - What vLLM's C(--kv-cache-dtype auto) resolves to for the checkpoint before the change,
      V(fp8) for an FP8 KV cache, otherwise V(auto) (the model's dtype).
    - It mirrors vLLM 0.32.0. vLLM reads config.json's top-level C(quantization_config), or
      C(hf_quant_config.json) when there is none; for ModelOpt its C(kv_cache_scheme) /
      C(kv_cache_quant_algo) decide. A compressed-tensors C(kv_cache_scheme), also one under
      C(text_config), makes standard attention layers FP8, not MLA layers (DeepSeek-V3, Kimi).
      A ModelOpt config only under C(text_config) does not change vLLM's choice.
  returned: always
  type: str
  sample: fp8
kv_cache_dtype_after:
  description: The same after the change (or as it would be after it, in check mode).
  returned: always
  type: str
  sample: auto
'''

import binascii
import os
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_native

from ansible_collections.llmserve.vllm.plugins.module_utils._kv_cache_quant import (
    RECORD_NAME,
    KvCacheQuantError,
    checkpoint_kv_cache_dtype,
    label,
    plan_restore,
    plan_strip,
    read_checkpoint,
    read_record,
    render_record,
)


def _stage(where, directory, data=None, link=None):
    """Put the new content (or a new link) under a temporary name in the file's own directory."""
    try:
        if link is not None:
            # os.symlink refuses an existing name, so the random name cannot be raced.
            staged = os.path.join(directory, '.llmserve-kvq-%s' % binascii.hexlify(os.urandom(8)).decode('ascii'))
            os.symlink(link, staged)
            return staged
        handle, staged = tempfile.mkstemp(prefix='.llmserve-kvq-', dir=directory)
        with os.fdopen(handle, 'wb') as out:
            out.write(data)
        return staged
    except (IOError, OSError) as exc:
        raise KvCacheQuantError('cannot write %s: %s (a temporary file in %s)'
                                % (where, exc.strerror or exc, directory))


def _remove(paths):
    for staged in paths:
        try:
            os.unlink(staged)
        except OSError:
            pass


def _write(module, path, plans, record_path, record):
    """Stage every file first, so that a directory we cannot write fails before anything changes."""
    writes = []
    results = [plan.result() for plan in plans]
    try:
        for plan in plans:
            where = label(plan.file.name, path)
            directory = os.path.dirname(plan.file.full)
            if plan.relink is not None:
                writes.append((plan.file.full, _stage(where, directory, link=plan.relink)))
            else:
                writes.append((plan.file.full, _stage(where, directory, data=plan.new_text.encode('utf-8'))))
        if record is not None:
            # The record goes first, so that an interrupted run still knows the originals.
            writes.insert(0, (record_path, _stage(label(RECORD_NAME, path), path,
                                                  data=render_record(record).encode('utf-8'))))
        if module.params['backup']:
            for plan, result in zip(plans, results):
                try:
                    result['backup_file'] = module.backup_local(plan.file.full)
                except Exception as exc:
                    raise KvCacheQuantError('cannot back up %s: %s'
                                            % (label(plan.file.name, path), to_native(exc.__cause__ or exc)))
    except KvCacheQuantError:
        _remove([source for dest, source in writes])
        raise
    for dest, source in writes:
        if os.path.islink(source):
            os.rename(source, dest)
        else:
            module.atomic_move(source, dest)
    if record is None and os.path.lexists(record_path):
        os.unlink(record_path)
    return results


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type='path', required=True),
            state=dict(type='str', default='absent', choices=['absent', 'present']),
            backup=dict(type='bool', default=False),
        ),
        supports_check_mode=True,
    )
    path = os.path.abspath(module.params['path'])
    record_path = os.path.join(path, RECORD_NAME)
    result = dict(changed=False, path=path, files=[], record=record_path)

    try:
        files = read_checkpoint(path)
        record = read_record(path)
        if module.params['state'] == 'absent':
            plans, new_record, warnings = plan_strip(path, files, record)
            changed = bool(plans)
        else:
            new_record = None
            if record is None:
                plans = []
                warnings = ['%s: no record of stripped KV-cache quantization, nothing to restore'
                            % label(RECORD_NAME, path)]
            else:
                plans, warnings = plan_restore(path, files, record)
            changed = record is not None
    except KvCacheQuantError as exc:
        module.fail_json(msg=str(exc), **result)

    for warning in warnings:
        module.warn(warning)
    result['kv_cache_dtype_before'] = checkpoint_kv_cache_dtype(files)
    result['kv_cache_dtype_after'] = checkpoint_kv_cache_dtype(files, plans)
    result['changed'] = changed
    result['files'] = [plan.result() for plan in plans]
    if module._diff and plans:
        result['diff'] = [dict(before=plan.file.text, after=plan.new_text,
                               before_header=plan.file.full, after_header=plan.file.full)
                          for plan in plans]

    if changed and not module.check_mode:
        try:
            result['files'] = _write(module, path, plans, record_path, new_record)
        except KvCacheQuantError as exc:
            module.fail_json(msg=str(exc), **result)
    module.exit_json(**result)


if __name__ == '__main__':
    main()
