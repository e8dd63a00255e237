#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
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
    file a person can read, with the checkpoint it belongs to and, per change, the file, key, original value
    (and its exact text), the link the file was and the time. O(state=present) puts those values back, byte
    for byte, turns a file that was a link back into that link when the blob still holds the same bytes, and
    removes the record. A record that names another checkpoint, or keys other than the KV-cache ones, is
    refused.
  - All changes of a run are one transaction. Every new file, backup and a copy of every file replaced are
    first written under temporary names (C(.llmserve-kvq-*)) beside the files, so that a full disk or a
    directory that cannot be written fails before anything changes; then they are renamed into place, the
    record first (it goes last on O(state=present)). When a rename fails (an immutable file), the renames
    done are undone; the files, the record and the backups are as they were, and no temporary file is left.
    A run killed at any moment leaves each file wholly old or wholly new, the record still describing the
    originals; the next run removes the temporary files it left, with a warning, and finishes the job.
  - Runs on one checkpoint take turns. Outside check mode a run holds an exclusive lock (C(flock)) on
    C(<path>/.llmserve-kv-cache-quant.lock), which it creates and removes again. Where that file cannot be
    created (a read-only checkpoint) the run goes on without the lock; it can then change nothing anyway.
  - Only regular files are read, of at most 16 MiB and 64 levels of nesting; a FIFO, device or directory in
    place of a config file or the record is refused at once, never waited on.
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
        nothing to restore and the module reports C(changed=false), so that a play can always ensure V(present).
        It warns only where a KV-cache quantization key is null, as a strip leaves it, for a strip whose record is
        gone, which it cannot undo.
    type: str
    choices: [absent, present]
    default: absent
  backup:
    description:
      - Keep a timestamped copy of each config file before it is changed, next to it.
    type: bool
    default: false
  lock_timeout:
    description:
      - How many seconds to wait for another run on the same checkpoint to release the lock
        (C(<path>/.llmserve-kv-cache-quant.lock)) before failing with a message that names the lock file.
    type: int
    default: 60
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
"""

EXAMPLES = r"""
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
"""

RETURN = r"""
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
      C(text_config) when there is no top-level one, makes standard attention layers FP8, not MLA
      layers (vLLM runs a model as MLA by its C(model_type), such as DeepSeek-V3 and Kimi).
      A ModelOpt config only under C(text_config) does not change vLLM's choice.
    - M(llmserve.vllm.gpu_preflight) gives the same answer for the same checkpoint.
  returned: always
  type: str
  sample: fp8
kv_cache_dtype_after:
  description: The same after the change (or as it would be after it, in check mode).
  returned: always
  type: str
  sample: auto
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import nul_free_path, range_problem
from ansible_collections.llmserve.vllm.plugins.module_utils._file_transaction import (
    DirectoryLock,
    FileTransactionError,
    Transaction,
    remove_stale,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._kv_cache_quant import (
    LOCK_NAME,
    MODULE_NAME,
    RECORD_NAME,
    KvCacheQuantError,
    check_directory,
    checkpoint_kv_cache_dtype,
    label,
    nulled_kv_keys,
    plan_restore,
    plan_strip,
    read_checkpoint,
    read_record,
    render_record,
)


def backup_name(full):
    """The name AnsibleModule.backup_local gives a backup: basename.PID.YYYY-MM-DD@HH:MM:SS~."""
    return '%s.%s.%s' % (full, os.getpid(), time.strftime('%Y-%m-%d@%H:%M:%S~', time.localtime()))


def plan(path, state):
    """(files, plans, new record or None, warnings, changed) for the checkpoint as it is now."""
    files = read_checkpoint(path)
    record = read_record(path)
    if state == 'absent':
        plans, new_record, warnings = plan_strip(path, files, record)
        return files, plans, new_record, warnings, bool(plans)
    if record is None:
        # A checkpoint as published has nothing to restore and nothing to say; a null key may be a strip whose record
        # was lost, which nothing here can undo.
        warnings = [
            '%s: no record of stripped KV-cache quantization, so %s (null) cannot be restored'
            % (label(RECORD_NAME, path), nulled)
            for nulled in nulled_kv_keys(path, files)
        ]
        return files, [], None, warnings, False
    plans, warnings = plan_restore(path, files, record)
    return files, plans, None, warnings, True


def write(path, plans, record, backup):
    """Apply the plans all or nothing; the results with the backup files made.

    The record goes in before the configs change and out after they are restored, so that
    a run killed in between still knows the originals; a failure undoes both.
    """
    transaction = Transaction()
    results = [plan.result() for plan in plans]
    record_path = os.path.join(path, RECORD_NAME)
    if backup:
        for plan, result in zip(plans, results):
            result['backup_file'] = backup_name(plan.file.full)
            transaction.backup(plan.file.full, label(plan.file.name, path), result['backup_file'])
    for plan in plans:
        where = label(plan.file.name, path)
        if plan.relink is not None:
            transaction.replace(plan.file.full, where, link=plan.relink)
        else:
            transaction.replace(plan.file.full, where, data=plan.new_text.encode('utf-8'))
    if record is not None:
        # Staged after the files, so that a directory that cannot be written is reported by their names.
        transaction.replace(
            record_path, label(RECORD_NAME, path), data=render_record(record).encode('utf-8'), first=True
        )
    if record is None and os.path.lexists(record_path):
        transaction.remove(record_path, label(RECORD_NAME, path))
    transaction.commit()
    return results


def run(module, path, result):
    """Plan, report and (outside check mode) write; the warnings to show."""
    files, plans, new_record, warnings, changed = plan(path, module.params['state'])
    result['kv_cache_dtype_before'] = checkpoint_kv_cache_dtype(files)
    result['kv_cache_dtype_after'] = checkpoint_kv_cache_dtype(files, plans)
    result['files'] = [plan.result() for plan in plans]
    if module._diff and plans:
        result['diff'] = [
            dict(before=plan.file.text, after=plan.new_text, before_header=plan.file.full, after_header=plan.file.full)
            for plan in plans
        ]
    if changed and not module.check_mode:
        result['files'] = write(path, plans, new_record, module.params['backup'])
    result['changed'] = changed
    return warnings


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type=nul_free_path, required=True),
            state=dict(type='str', default='absent', choices=['absent', 'present']),
            backup=dict(type='bool', default=False),
            lock_timeout=dict(type='int', default=60),
        ),
        supports_check_mode=True,
    )
    problem = range_problem('lock_timeout', module.params['lock_timeout'], 0)
    if problem:
        module.fail_json(msg=problem)
    path = os.path.abspath(module.params['path'])
    result = dict(changed=False, path=path, files=[], record=os.path.join(path, RECORD_NAME))

    try:
        check_directory(path)
        if module.check_mode:
            warnings = run(module, path, result)
        else:
            with DirectoryLock(path, LOCK_NAME, module.params['lock_timeout'], MODULE_NAME) as lock:
                warnings = (
                    ['removed %s, left by an interrupted run' % stale for stale in remove_stale(path)]
                    if lock.held
                    else []
                )
                warnings.extend(run(module, path, result))
    except (KvCacheQuantError, FileTransactionError) as exc:
        module.fail_json(msg=str(exc), **result)

    for warning in warnings:
        module.warn(warning)
    module.exit_json(**result)


if __name__ == '__main__':
    main()
