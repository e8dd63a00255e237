# -*- coding: utf-8 -*-
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run a module of the collection as Ansible runs it on a host: a subprocess reading its arguments file.

That works the same on ansible-core 2.17 to 2.19 and exercises exit codes, JSON output and
no_log masking.
"""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import contextlib
import json
import os
import subprocess
import sys
from unittest import mock

from ansible.module_utils import basic

import ansible_collections.llmserve.vllm as collection

# The directory that holds ansible_collections/, wherever this checkout is linked from.
COLLECTIONS_PATH = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(collection.__path__[0]))))


def run_module(module, tmp_path, args, path_prefix=None):
    """Run llmserve.vllm.<module> with args; return (rc, result). path_prefix goes first on PATH."""
    args_file = tmp_path / ('%s-args.json' % module)
    args_file.write_text(json.dumps({'ANSIBLE_MODULE_ARGS': args}))
    env = dict(os.environ, PYTHONPATH=COLLECTIONS_PATH)
    # Local test servers on loopback must not be reached through a proxy.
    env['no_proxy'] = env['NO_PROXY'] = '127.0.0.1,localhost'
    if path_prefix:
        env['PATH'] = '%s:%s' % (path_prefix, env.get('PATH', ''))
    proc = subprocess.run([sys.executable, '-m', 'ansible_collections.llmserve.vllm.plugins.modules.' + module, str(args_file)],
                          env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120, check=False)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout.decode('utf-8'))


def warning_texts(result):
    """The module's warnings: plain strings before ansible-core 2.19, structured summaries since."""
    return [w if isinstance(w, str) else w['event']['msg'] for w in result.get('warnings', [])]


@contextlib.contextmanager
def module_args(args):
    """AnsibleModule in this process reads args: for cases that patch the process (os.fsync failing)."""
    try:
        # ansible-core 2.19 and later encode the arguments with a serialization profile.
        from ansible.module_utils.testing import patch_module_args
    except ImportError:
        with mock.patch.object(basic, '_ANSIBLE_ARGS', json.dumps({'ANSIBLE_MODULE_ARGS': args}).encode('utf-8')):
            yield
        return
    with patch_module_args(args):
        yield
