# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


class ModuleDocFragment:
    # Descriptions of the attributes; combine with one of the support fragments below.
    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
  idempotent:
    description:
      - When run twice in a row outside check mode, with the same arguments, the second invocation reports no change.
"""

    # For modules that change files and support check and diff mode fully.
    CHANGES_FILES = r"""
options: {}
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
  idempotent:
    support: full
"""

    # For modules that only read and report (preflight checks, readiness waits).
    READ_ONLY = r"""
options: {}
attributes:
  check_mode:
    support: full
    details:
      - This module never changes anything, so it runs unchanged in check mode.
  diff_mode:
    support: N/A
    details:
      - This module never changes anything.
  idempotent:
    support: full
"""
