# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Run a host command with a deadline and a bound on its output.

PRIVATE to the collection: this is not a public API; it may change without notice.

AnsibleModule.run_command waits as long as the command runs: a wedged NVIDIA driver
keeps nvidia-smi in the kernel for ever, and the module with it. Here the command runs
in its own process group, which is killed (SIGKILL, children included) when the
deadline passes or the output grows past the bound. Output is decoded as UTF-8 with
undecodable bytes replaced, so that whatever a command prints can be returned as JSON.
"""

import os
import selectors
import signal
import subprocess
import time
from typing import IO, Any, Callable, cast

# nvidia-smi's answers for eight GPUs and a hundred processes are a few KiB.
MAX_OUTPUT_BYTES = 16 * 1024 * 1024
# A process stuck in uninterruptible sleep does not die at SIGKILL; it is not waited for longer.
REAP_SECONDS = 1


class CommandError(Exception):
    """The command printed too much, or ran past its deadline; the message names it and the bound."""


class CommandTimeout(CommandError):
    """The command ran past its deadline."""


def run(
    argv: list[str], timeout: float, max_output: int = MAX_OUTPUT_BYTES, clock: Callable[[], float] = time.monotonic
) -> tuple[int, str, str]:
    """Run argv; return (rc, stdout, stderr) as text. rc is -N when signal N killed it.

    Raises OSError when argv cannot be started, CommandTimeout when it does not finish
    within timeout seconds, CommandError when it prints more than max_output bytes
    (it is killed then).
    """
    deadline = clock() + timeout
    shown = ' '.join(argv)
    late = '%s did not finish within %s seconds and was killed' % (shown, timeout)
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    # Both are pipes: Popen was asked for them.
    stdout, stderr = cast(IO[bytes], proc.stdout), cast(IO[bytes], proc.stderr)
    chunks: dict[Any, list[bytes]] = {stdout: [], stderr: []}
    size = 0
    try:
        with selectors.DefaultSelector() as selector:
            for pipe in chunks:
                selector.register(pipe, selectors.EVENT_READ)
            # Read both pipes to their end, so that neither fills up and blocks the command.
            while selector.get_map():
                left = deadline - clock()
                if left <= 0:
                    raise _killed(proc, CommandTimeout(late))
                for key, _events in selector.select(left):
                    data = os.read(key.fd, 65536)
                    if not data:
                        selector.unregister(key.fileobj)
                    chunks[key.fileobj].append(data)
                    size += len(data)
                    if size > max_output:
                        raise _killed(
                            proc, CommandError('%s printed more than %d bytes and was killed' % (shown, max_output))
                        )
        try:
            rc = proc.wait(max(deadline - clock(), 0))
        except subprocess.TimeoutExpired:
            raise _killed(proc, CommandTimeout(late)) from None
    finally:
        stdout.close()
        stderr.close()
    out, err = (b''.join(chunks[pipe]).decode('utf-8', 'replace') for pipe in (stdout, stderr))
    return rc, out, err


def _killed(proc: subprocess.Popen[bytes], error: CommandError) -> CommandError:
    """SIGKILL the command's process group (a shell's children too) and reap it if it dies at once; return error."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass  # already gone
    try:
        proc.wait(REAP_SECONDS)
    except subprocess.TimeoutExpired:
        pass  # in uninterruptible sleep: it is reaped when the driver lets it go
    return error
