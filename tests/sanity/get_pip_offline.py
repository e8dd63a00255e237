# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
# Offline stand-in for ansible-test's get-pip.py download: these machines reach PyPI
# but not ci-files.testing.ansible.com. It bootstraps the pip bundled with Python and
# is all that ansible-test needs from the real script.
import ensurepip

ensurepip.bootstrap()
