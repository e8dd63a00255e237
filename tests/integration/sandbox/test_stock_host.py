# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What a stock Debian or Ubuntu host gives the first start, met by the running vLLM on the sandbox host.

The sandbox mounts /run `nodev,noexec,nosuid` as a stock host's initramfs does (tools/sandbox), so the service's
runtime directory, where its HOME and every cache lie, is executable only where the unit says so (ExecPaths=). What
vLLM runs by name (ninja for torch's and FlashInfer's JIT builds) is found through the unit's PATH, which must hold
the release's own bin/ first: systemd's default PATH holds none of it.
"""

import os

# systemd's default PATH for units on the sandbox's Debian bookworm (systemd 252): what follows the release's bin/
# where no CUDA toolkit is named (the CPU build).
SYSTEMD_PATH = ['/usr/local/sbin', '/usr/local/bin', '/usr/sbin', '/usr/bin', '/sbin', '/bin']
STOCK_RUN = {'nodev', 'noexec', 'nosuid'}


def main_pid(sandbox):
    pid = sandbox.show('MainPID')['MainPID']
    assert pid != '0', 'the service is not running:\n%s' % sandbox.journal()
    return pid


def environ(sandbox, pid):
    """The environment of a process, read as root from /proc (its API key left out)."""
    text = sandbox.sh('tr "\\0" "\\n" < /proc/%s/environ' % pid)
    pairs = (line.split('=', 1) for line in text.splitlines() if '=' in line)
    return dict((name, value) for name, value in pairs if name != 'VLLM_API_KEY')


def mount_options(sandbox, path, pid=None):
    """The mount options of the mount holding path: the host's, or in the mount namespace of process pid."""
    enter = 'nsenter -t %s -m ' % pid if pid else ''
    return set(sandbox.sh('%sfindmnt --noheadings --output OPTIONS --target %s' % (enter, path)).strip().split(','))


def test_run_is_mounted_as_on_a_stock_host(sandbox):
    assert mount_options(sandbox, '/run') >= STOCK_RUN


def test_vllm_may_map_code_from_its_runtime_directory_alone(sandbox):
    """ExecPaths= lifts noexec on the runtime directory inside the unit's namespace; /run stays noexec outside."""
    pid = main_pid(sandbox)
    runtime = '/run/%s' % sandbox.unit
    home = environ(sandbox, pid)['HOME']
    assert home.startswith(runtime + '/')
    assert 'noexec' not in mount_options(sandbox, home, pid)
    assert 'noexec' in mount_options(sandbox, '/run', pid)
    assert 'noexec' in mount_options(sandbox, runtime)


def test_vllm_finds_the_releases_programs_first_on_its_path(sandbox):
    pid = main_pid(sandbox)
    interpreter = sandbox.sh('tr "\\0" "\\n" < /proc/%s/cmdline' % pid).splitlines()[0]
    release_bin = os.path.dirname(interpreter)
    assert release_bin.startswith(sandbox.vars['vllm_kimi_venv_root'] + '/'), interpreter
    path = environ(sandbox, pid)['PATH'].split(':')
    assert path[0] == release_bin, path
    assert path[1:] == SYSTEMD_PATH, path
