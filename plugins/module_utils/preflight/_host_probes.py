# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""What the host says about a start of vLLM: who holds GPU memory or the port, how big /dev/shm is.

PRIVATE to the collection: this is not a public API; it may change without notice.

Read from /proc and statvfs, without tools that a minimal host may lack (ss, lsof, fuser).
"""

import errno
import os
import socket
from typing import Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import GIB, PreflightError

# NCCL's shared-memory transport and vLLM's shared-memory message queues need /dev/shm
# space per rank pair: 8 ranks = 56 directed pairs x a few MiB of NCCL buffers each,
# plus vLLM's broadcast queues and PyTorch's tensor passing between worker processes.
# Docker's default 64 MiB /dev/shm is known to break NCCL; 1 GiB is ample for TP 8.
DEFAULT_SHM_MIN_BYTES = GIB
DEFAULT_SHM_PATH = '/dev/shm'
# Where the NVIDIA device nodes are; tests point it at a directory built from a real host's listing.
DEFAULT_DEV_PATH = '/dev'


def read_proc(path: str) -> Optional[str]:
    """The text of a /proc file, or None when it cannot be read; bytes that are not UTF-8 (a process may give
    itself any name) are replaced, so that they can be returned as JSON."""
    try:
        with open(path, 'rb') as f:
            return f.read().decode('utf-8', 'replace')
    except OSError:
        return None


def proc_cgroup(pid: int, proc: str = '/proc') -> str:
    return read_proc(os.path.join(proc, str(pid), 'cgroup')) or ''


def belongs_to_service(pid: int, service_name: Optional[str], proc: str = '/proc') -> bool:
    """Whether pid runs in the systemd unit service_name (its cgroup path names the unit)."""
    if not service_name:
        return False
    unit = service_name if '.' in service_name else service_name + '.service'
    for line in proc_cgroup(pid, proc).splitlines():
        path = line.split(':', 2)[-1].strip()
        if path.endswith('/' + unit) or ('/' + unit + '/') in path:
            return True
    return False


def listening_inodes(port: int, proc: str = '/proc') -> Optional[set[str]]:
    """Inodes of TCP sockets listening on port (any local address), from /proc/net/tcp{,6}."""
    inodes = set()
    found_table = False
    for table in ('tcp', 'tcp6'):
        text = read_proc(os.path.join(proc, 'net', table))
        if text is None:
            continue
        found_table = True
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 10 or cols[3] != '0A':
                continue
            if int(cols[1].rsplit(':', 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes if found_table else None


def socket_owners(inodes: set[str], proc: str = '/proc') -> set[int]:
    """PIDs whose file descriptors hold one of these socket inodes."""
    wanted = set('socket:[%s]' % i for i in inodes)
    owners: set[int] = set()
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return owners
    for pid in pids:
        fd_dir = os.path.join(proc, pid, 'fd')
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) in wanted:
                    owners.add(int(pid))
                    break
            except OSError:
                continue
    return owners


def process_name(pid: int, proc: str = '/proc') -> Optional[str]:
    """The command name of pid, or None when it cannot be read (another PID namespace, gone)."""
    name = read_proc(os.path.join(proc, str(pid), 'comm'))
    return name.strip() if name is not None else None


def port_conflict(host: str, port: int, service_name: Optional[str], proc: str = '/proc') -> Optional[str]:
    """None if host:port is free (or held by our own service), else a problem string."""
    inodes = listening_inodes(port, proc)
    if inodes is None:
        # No /proc/net: try to connect.
        s = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            s.connect((host, port))
        except OSError:
            return None
        finally:
            s.close()
        return 'port %d on %s is already in use by another process' % (port, host)
    if not inodes:
        return None
    owners = socket_owners(inodes, proc)
    if owners and all(belongs_to_service(p, service_name, proc) for p in owners):
        return None
    if owners:
        who = ', '.join('PID %d (%s)' % (p, process_name(p, proc) or '?') for p in sorted(owners))
        return 'port %d is already in use by %s' % (port, who)
    return 'port %d is already in use by another process' % port


def shm_size(path: str) -> Optional[int]:
    """Total bytes of the filesystem at path (tmpfs /dev/shm)."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise PreflightError('cannot read the size of %s: %s' % (path, exc.strerror or exc)) from exc
    return st.f_blocks * st.f_frsize


def device_node_exists(dev_path: str, name: str) -> bool:
    """Whether the device node dev_path/name exists (CUDA opens /dev/nvidia-uvm for every context)."""
    return os.path.exists(os.path.join(dev_path, name))
