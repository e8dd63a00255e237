# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""What the GPU preflight's parts share: their error, and byte arithmetic in whole numbers.

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

GIB = 1024**3
MIB = 1024**2


class PreflightError(Exception):
    """The preflight cannot answer (nvidia-smi missing, malformed input); the message says why."""


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, exact for integers of any size (a float would round 540 GB)."""
    return -(-a // b)


def gib(n: float) -> str:
    """Bytes as GiB with two decimals, as vLLM writes them."""
    return '%.2f' % (n / float(GIB))
