#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
---
module: deployment
short_description: Read, record or restore a host's vLLM deployments that passed their gate
version_added: 0.1.0
description:
  - Owns a host's deployment state in a directory private to root (O(path), C(0700)), outside every directory the
    service user can write. Each deployment that passed its gate has a directory of its own there, named by the UTC
    time it passed and its release (C(20261201T120000Z-0123456789ab)), with the unit and the environment file that
    served and its C(record.json); the link C(last-good) names the newest good one; C(rollbacks.json) counts the
    rollbacks.
  - O(state=read) returns the last good deployment's record (RV(last_good), V({}) before any deployment passed).
  - O(state=recorded) snapshots the unit and the environment file that passed the gate with O(record), switches
    C(last-good) to them in one rename, and prunes the deployments beyond the newest O(keep) and the releases under
    O(releases_dir) that no kept deployment uses. A release is recorded at most once a second; a second record of
    it in the same second is refused.
  - O(state=restored) puts the last good deployment's unit and environment file back at O(unit_file) and
    O(environment_file) and counts the rollback; it returns RV(rolled_back=true) with the record, whose
    C(model_path) and C(kv_cache_quant_state) give the checkpoint's state for M(llmserve.vllm.kv_cache_quant).
    The caller restarts the unit.
  - Nothing follows a link but C(last-good), which only this module writes; a deployment directory, a record, a
    unit or an environment file that is a link is refused, and so is a directory not private to the user the
    module runs as (whoever can rename in it could plant the unit a rollback installs). Only regular files of at
    most 1 MiB are read, without waiting on a FIFO; a record nested deeper than 32 levels, or larger than 1 MiB as
    JSON, is refused before anything is written, so that every record written can be read back and rolled back
    to.
  - Every file is written beside its place and renamed into it; a deployment directory is made whole under a
    temporary name first, and the files O(state=restored) puts back are all written before the first is renamed
    in. A run that fails leaves every file as it was; a run killed at any point leaves each file whole, old or new,
    and temporary files that the next run removes. Concurrent runs on one O(path) take turns on a lock
    (C(<path>/.llmserve-deployment.lock)).
  - The environment file holds secrets; its content is never returned nor shown in a diff.
author:
  - llmserve.vllm contributors (@llmserve)
extends_documentation_fragment:
  - llmserve.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - Reports the deployment that would be recorded, what would be pruned or restored, and changes nothing.
  diff_mode:
    support: partial
    details:
      - O(state=restored) shows the unit's change; the environment file, which holds secrets, is never shown.
  idempotent:
    support: partial
    details:
      - O(state=read) changes nothing. O(state=recorded) records one deployment a call, and O(state=restored) counts
        one rollback a call, as each call is one such event.
options:
  path:
    description:
      - The deployments directory, private to root, an absolute path. O(state=recorded) and O(state=restored) create it
        C(0700) where missing; O(state=read) of a missing one changes nothing and returns no deployment.
    type: path
    required: true
  state:
    description: What to do with the state (see the description).
    type: str
    choices: [read, recorded, restored]
    default: read
  record:
    description:
      - What the deployment that passed is, for O(state=recorded) (the role's release, venv, package spec, serving
        arguments, checkpoint and its KV-cache state, the gate's answer and figures). Must hold C(release), the 12
        hexadecimal digits of the release it runs. C(deployment) and C(recorded_at) are set by the module.
    type: dict
    default: {}
  unit_file:
    description:
      - The service's unit file, snapshotted by O(state=recorded) and put back by O(state=restored). Required for both,
        an absolute path.
    type: path
  environment_file:
    description:
      - The service's environment file (secrets), snapshotted by O(state=recorded) and put back by O(state=restored).
        Required for both, an absolute path other than O(unit_file).
    type: path
  environment_secrets:
    description:
      - For O(state=restored), environment variables whose values of now replace those of the last good deployment's
        environment file, such as the API key. A rollback brings back the settings that passed, never an old secret, as
        a key rotated since, and found in a leak, must not come back.
      - Each value is written quoted as systemd reads it (C($) and C(`) kept literal); an empty value removes the
        variable; a variable the file lacks is added at its end. A value with a line break or a NUL is refused.
      - Never shown, neither the values nor the environment file, in the result or a diff.
    type: dict
    default: {}
  releases_dir:
    description:
      - Where the releases (virtual environments named by 12 hexadecimal digits) live, for O(state=recorded)'s prune,
        an absolute path. Without it no release is removed.
    type: path
  keep:
    description: How many deployments O(state=recorded) keeps, the new one included; at least 1.
    type: int
    default: 3
  lock_timeout:
    description:
      - How many seconds to wait for another run on the same O(path) to release the lock
        (C(<path>/.llmserve-deployment.lock)) before failing with a message that names the lock file.
    type: int
    default: 60
"""

EXAMPLES = r"""
- name: Read the deployment a failed change would roll back to
  llmserve.vllm.deployment:
    path: /var/lib/llmserve-vllm/vllm-kimi/deployments
  register: deployments

- name: Record what passed the gate and prune what no kept deployment uses
  llmserve.vllm.deployment:
    path: /var/lib/llmserve-vllm/vllm-kimi/deployments
    state: recorded
    record:
      release: 0123456789ab
      serve_argv: [/opt/vllm-kimi/0123456789ab/bin/vllm, serve, /models/kimi-k2.5-nvfp4]
      kv_cache_quant_state: absent
    unit_file: /etc/systemd/system/vllm-kimi.service
    environment_file: /etc/llmserve-vllm/vllm-kimi.env
    releases_dir: /opt/vllm-kimi
    keep: 3

- name: Put back the last good deployment after a failed gate
  llmserve.vllm.deployment:
    path: /var/lib/llmserve-vllm/vllm-kimi/deployments
    state: restored
    unit_file: /etc/systemd/system/vllm-kimi.service
    environment_file: /etc/llmserve-vllm/vllm-kimi.env
    # The key of now, not the one the last good deployment served with.
    environment_secrets:
      VLLM_API_KEY: "{{ vllm_api_key }}"
  register: restored
"""

RETURN = r"""
last_good:
  description: The last good deployment's record (after this call), V({}) before any deployment passed its gate.
  returned: always
  type: dict
  sample:
    deployment: 20261201T120000Z-0123456789ab
    release: 0123456789ab
    kv_cache_quant_state: absent
deployment:
  description: The deployment recorded or restored; empty for O(state=read).
  returned: always
  type: str
  sample: 20261201T120000Z-0123456789ab
record:
  description: The record written (O(state=recorded)) or put back (O(state=restored)); V({}) for O(state=read).
  returned: always
  type: dict
  sample:
    deployment: 20261201T120000Z-0123456789ab
    recorded_at: '2026-12-01T12:00:00Z'
    release: 0123456789ab
pruned:
  description:
    - The deployments and releases O(state=recorded) removed (in check mode, would remove). One that cannot be removed
      is left, with a warning; the deployment is recorded all the same.
  returned: always
  type: list
  elements: str
  sample: [/var/lib/llmserve-vllm/vllm-kimi/deployments/20261101T120000Z-00112233aabb, /opt/vllm-kimi/00112233aabb]
rolled_back:
  description: Whether the last good deployment was put back (O(state=restored)).
  returned: always
  type: bool
  sample: true
rollbacks:
  description: The rollback count, C(total) so far and the Unix time of the C(last) one (0 for none).
  returned: always
  type: dict
  sample:
    total: 1
    last: 1796126400
"""

import contextlib
import os
import time
from typing import Any

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import nul_free_path, range_problem
from ansible_collections.llmserve.vllm.plugins.module_utils._deployment import (
    LOCK,
    DeploymentError,
    deployment_name,
    ensure_private_directory,
    is_release,
    last_good,
    record,
    remove_stale,
    restore,
    rollbacks,
    secrets_problem,
)
from ansible_collections.llmserve.vllm.plugins.module_utils._file_transaction import (
    DirectoryLock,
    FileTransactionError,
)
from ansible_collections.llmserve.vllm.plugins.module_utils._file_transaction import remove_stale as remove_stale_files

MODULE_NAME = 'llmserve.vllm.deployment'
PATH_OPTIONS = ('path', 'unit_file', 'environment_file', 'releases_dir')


def input_problem(p):
    """Why the options cannot be acted on, or None."""
    problem = range_problem('keep', p['keep'], 1) or range_problem('lock_timeout', p['lock_timeout'], 0)
    if problem:
        return problem
    if p['state'] != 'read' and not (p['unit_file'] and p['environment_file']):
        return 'state %s needs unit_file and environment_file' % p['state']
    for option in PATH_OPTIONS:
        # A relative path would name a place under the task's temporary directory, gone once the task ends.
        if p[option] and not os.path.isabs(p[option]):
            return '%s must be an absolute path, got %r' % (option, p[option])
    if p['state'] != 'read' and os.path.normpath(p['unit_file']) == os.path.normpath(p['environment_file']):
        return 'unit_file and environment_file must be two files, got %s for both' % p['unit_file']
    if p['environment_secrets'] and p['state'] != 'restored':
        return 'environment_secrets applies to state restored only, not to state %s' % p['state']
    release = p['record'].get('release')
    if p['state'] == 'recorded' and not is_release(release):
        return 'record must hold release, the 12 hexadecimal digits of the release that passed, got %r' % (release,)
    return secrets_problem(p['environment_secrets'])


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type=nul_free_path, required=True),
            state=dict(type='str', choices=['read', 'recorded', 'restored'], default='read'),
            record=dict(type='dict', default={}),
            unit_file=dict(type=nul_free_path),
            environment_file=dict(type=nul_free_path),
            environment_secrets=dict(type='dict', default={}, no_log=True),
            releases_dir=dict(type=nul_free_path),
            keep=dict(type='int', default=3),
            lock_timeout=dict(type='int', default=60),
        ),
        supports_check_mode=True,
    )
    p = module.params
    # Checked before anything is touched: bad input changes nothing.
    problem = input_problem(p)
    if problem:
        module.fail_json(msg=problem)
    result: dict[str, Any] = dict(changed=False, last_good={}, deployment='', record={}, pruned=[], rolled_back=False)
    warnings: list[str] = []
    failure = None
    if p['state'] == 'read' and not os.path.lexists(p['path']):
        # Nothing was ever recorded here: a read leaves the host as it is.
        module.exit_json(**dict(result, rollbacks={'total': 0, 'last': 0}))
    try:
        created = ensure_private_directory(p['path'], module.check_mode)
        result['changed'] = created
        # Check mode changes nothing, not even a lock file; every other run takes its turn.
        lock = (
            contextlib.nullcontext()
            if module.check_mode
            else DirectoryLock(p['path'], LOCK, p['lock_timeout'], MODULE_NAME)
        )
        with lock:
            if p['state'] != 'read' and not module.check_mode:
                stale = remove_stale(p['path'])
                if p['state'] == 'restored':
                    # A restore killed half way leaves its temporary files beside the unit and the environment file.
                    for directory in sorted({os.path.dirname(p['unit_file']), os.path.dirname(p['environment_file'])}):
                        stale += remove_stale_files(directory)
                warnings.extend('removed %s, left by an interrupted run' % path for path in stale)
            warnings.extend(apply(module, created, result))
    except (DeploymentError, FileTransactionError, OSError) as exc:
        failure = str(exc)
    for warning in warnings:
        module.warn(warning)
    if failure:
        module.fail_json(msg=failure, **result)
    module.exit_json(**result)


def apply(module, created, result):
    """Read, record or restore as the state asks, into result; returns the warnings."""
    p = module.params
    warnings = []
    if p['state'] == 'recorded':
        now = time.gmtime()
        content = dict(p['record'], recorded_at=time.strftime('%Y-%m-%dT%H:%M:%SZ', now))
        done = record(
            p['path'],
            deployment_name(time.strftime('%Y%m%dT%H%M%SZ', now), p['record']['release']),
            content,
            p['unit_file'],
            p['environment_file'],
            p['releases_dir'],
            p['keep'],
            module.check_mode,
        )
        warnings = done.pop('warnings')
        result.update(done, changed=True)
    elif p['state'] == 'restored':
        done = restore(
            p['path'], p['unit_file'], p['environment_file'], time.time, module.check_mode, p['environment_secrets']
        )
        before, after = done.pop('unit_before'), done.pop('unit_after')
        if module._diff and before != after:
            result['diff'] = dict(before=before, after=after, before_header=p['unit_file'], after_header=p['unit_file'])
        result.update(done, changed=True)
    # A directory only planned (check mode) holds nothing yet.
    present = not (created and module.check_mode)
    result.setdefault('rollbacks', rollbacks(p['path']) if present else {'total': 0, 'last': 0})
    if p['state'] == 'recorded' and module.check_mode:
        result['last_good'] = result['record']
    elif present:
        result['last_good'] = last_good(p['path'])[1]
    return warnings


if __name__ == '__main__':
    main()
