# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ask every host of an inventory's `vllm` group the coherence question and print the answer.

    python3 tools/gate_report.py -i inventories/sandbox

Runs llmserve.vllm.chat_check (the role's gate) ad hoc, so it also reports on a
rerun of the deploy where nothing changed and the role's gate did not run.
Exits non-zero when a host's answer does not pass.  `ansible` must be on PATH
and find the collection (ANSIBLE_COLLECTIONS_PATH; the Makefile exports it).
"""

from __future__ import absolute_import, division, print_function

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

# Jinja in ad-hoc arguments is rendered per host from the inventory.
GATE_ARGS = {
    "url": "http://{{ vllm_kimi_host | default('127.0.0.1') }}:{{ vllm_kimi_port | default(8000) }}",
    "model": "{{ vllm_kimi_served_model_name }}",
    "api_key": "{{ vllm_kimi_api_key | default(omit, true) }}",
    "timeout": 600,
    "unit": "{{ vllm_kimi_service_name | default('vllm-kimi') }}.service",
}


def describe(host, result):
    if result.get("unreachable"):
        return False, "%s: unreachable: %s" % (host, result.get("msg"))
    ok = not result.get("failed")
    lines = ["%s: %s answered %s" % (host, result.get("model", "?"), json.dumps(result.get("answer")))]
    if ok:
        lines.append("  gate: /health answered after %.1f s, coherent answer after %.1f s; %s tokens in %.2f s "
                     "(%.1f tokens/s); restarts seen: %s"
                     % (result["healthy_after"] or 0.0, result["elapsed"], result["completion_tokens"],
                        result["request_seconds"], result["tokens_per_second"], result["restarts"]))
    else:
        lines.append("  gate FAILED: %s" % result.get("msg"))
    return ok, "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-i", "--inventory", required=True)
    parser.add_argument("--limit", default="vllm")
    args = parser.parse_args(argv)
    tree = tempfile.mkdtemp(prefix="llmserve-gate-")
    try:
        proc = subprocess.run(["ansible", args.limit, "-i", args.inventory, "-m", "llmserve.vllm.chat_check",
                               "-a", json.dumps(GATE_ARGS), "-t", tree],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        hosts = sorted(os.listdir(tree))
        if not hosts:
            sys.stderr.write(proc.stdout.decode(errors="replace"))
            return proc.returncode or 1
        all_ok = True
        for host in hosts:
            with open(os.path.join(tree, host)) as f:
                ok, text = describe(host, json.load(f))
            all_ok = all_ok and ok
            print(text)
        return 0 if all_ok else 2
    finally:
        shutil.rmtree(tree)


if __name__ == "__main__":
    sys.exit(main())
