#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
---
module: checkpoint_sealed
short_description: Say whether a user other than root could change a model checkpoint, and how
version_added: 0.2.0
description:
  - vLLM loads a checkpoint's weights and, with C(--trust-remote-code), runs its Python files as the service; a
    checkpoint a user other than root could change is code that user may run as the service. This module names
    each way one could, so that a play can refuse the checkpoint before serving it.
  - It judges the checkpoint directory and everything in it (the tree is walked without following a link, and a
    link inside it is one such way, as what it leads to may be anywhere), and every directory that holds a name the
    kernel reads to reach it, each parent up to C(/) and those of every link on the way, as whoever may write a
    directory may rename what is in it. O(path) itself may be a link (to where the disk is).
  - An entry is one if another user owns it, every user may write it, a group other than root's may write it, or
    its POSIX ACL (C(system.posix_acl_access), which C(ls -l) shows only as its mask) grants write to a user or
    group other than root's, masked or not. A directory above the checkpoint with the sticky bit (C(/tmp)) lets
    others add names but rename none of root's, and is judged by its owner and ACL alone.
  - It never changes anything and never fails for what it finds; a path that does not exist is reported with
    RV(exists=false).
author:
  - llmserve.vllm contributors (@llmserve)
extends_documentation_fragment:
  - llmserve.vllm.attributes
  - llmserve.vllm.attributes.READ_ONLY
options:
  path:
    description:
      - The checkpoint directory, the one that holds C(config.json) and the weights.
    type: path
    required: true
seealso:
  - module: llmserve.vllm.checkpoint_verify
  - name: acl(5)
    description: POSIX access control lists, their entries and mask.
    link: https://man7.org/linux/man-pages/man5/acl.5.html
"""

EXAMPLES = r"""
- name: Read who but root could change the checkpoint
  llmserve.vllm.checkpoint_sealed:
    path: /shared/kimi
  register: __sealed

- name: Refuse a checkpoint another user could change
  ansible.builtin.assert:
    that: __sealed.writers | length == 0
    fail_msg: "{{ __sealed.writers | join('; ') }}"
"""

RETURN = r"""
exists:
  description: Whether O(path) exists; the other values are empty where it does not.
  returned: always
  type: bool
  sample: true
directory:
  description: The directory O(path) resolves to, every link followed.
  returned: when RV(exists)
  type: str
  sample: /data/disk1/kimi
writers:
  description:
    - One text per entry a user other than root could change, naming its path and why; the directories above the
      checkpoint first, then the checkpoint and what is in it, named under O(path) as given. Empty where only root
      could change it.
  returned: always
  type: list
  elements: str
  sample:
    - /shared is owned by alice
    - /shared/kimi/modeling_kimi.py is writable by user bob through its ACL
"""

import grp
import os
import pwd

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import nul_free_path
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._writers import (
    CheckpointWalkError,
    checkpoint_writers,
    directories_on_path,
)


def account_name(kind, ident):
    """The name of a user or group, or 'uid N' / 'gid N' where the system has none for it."""
    try:
        return pwd.getpwuid(ident).pw_name if kind == 'user' else grp.getgrgid(ident).gr_name
    except KeyError:
        return '%s %d' % ('uid' if kind == 'user' else 'gid', ident)


def main():
    module = AnsibleModule(argument_spec=dict(path=dict(type=nul_free_path, required=True)), supports_check_mode=True)
    path = os.path.abspath(module.params['path'])
    if not os.path.lexists(path):
        module.exit_json(changed=False, exists=False, writers=[])
    try:
        directory = directories_on_path(path)[1]
        if not os.path.isdir(directory):
            module.fail_json(msg='checkpoint %s is not a directory (%s)' % (path, directory), exists=True, writers=[])
        writers = checkpoint_writers(path, account_name)
    except FileNotFoundError:
        # A link that leads nowhere: the checkpoint is not there, which the GPU preflight says in its own words.
        module.exit_json(changed=False, exists=False, writers=[])
    except (CheckpointWalkError, ValueError, OSError) as exc:
        module.fail_json(msg='cannot judge who may change checkpoint %s: %s' % (path, exc), exists=True, writers=[])
    module.exit_json(changed=False, exists=True, directory=directory, writers=writers)


if __name__ == '__main__':
    main()
