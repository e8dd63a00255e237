# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Build the CUDA vLLM payload for the lent GPU machine, and lay out what each device call carries.

The device has Python 3.12 with torch 2.11.0+cu130 and no network; a call carries at most 64 MiB. So the
release and what `vllm serve` imports beyond the device's packages (tools/gpu_run/vllm-RELEASE.txt) are
downloaded here for Python 3.12 on manylinux, installed with `pip install --no-deps --no-index --target`, pruned
of the kernels an H100/H200 never loads, packed with `xz -9` and split in three parts, one per call.

    python3 tools/gpu_run/payload.py build --release 0.26.0      # .build/gpu_run/0.26.0/part-{1,2,3}, SHA256SUMS
    python3 tools/gpu_run/payload.py stage --release 0.26.0 --into /work/main/.gpu-run --model DIR  # c1, c2, c3

docs/testing.md ("A recorded run on a real GPU") gives the calls in order.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PLATFORMS = [f'manylinux_2_{minor}_x86_64' for minor in (35, 34, 31, 28, 27, 26, 24, 17, 5)] + [
    'manylinux2014_x86_64',
    'manylinux1_x86_64',
]
TARGET = ['--only-binary=:all:', '--python-version', '3.12', '--implementation', 'cp']
TARGET += [arg for platform in PLATFORMS for arg in ('--platform', platform)]
# Loaded by no code path on SM90 (vllm/platforms/cuda.py picks FlashAttention-3 there; vllm-rs is the optional Rust
# frontend; fmha_sm100 is Blackwell's; DeepGEMM's extension for the other Pythons): 300 MiB of the 700.
PRUNED = [
    'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so',
    'vllm/vllm-rs',
    'vllm/third_party/fmha_sm100',
    *(f'vllm/third_party/deep_gemm/_C.cpython-3{minor}-x86_64-linux-gnu.so' for minor in (10, 11, 13, 14)),
]
PARTS = 3
# What every call carries besides its part: the device-side scripts and what call 3 needs to serve and judge.
HARNESS = ['device.py', 'synthetic.py']


def requirements(release: str, kind: str = '') -> list[str]:
    """Read the pinned list of a release (kind '-spares' for the conditional wheels)."""
    path = HERE / f'vllm-{release}{kind}.txt'
    if not path.is_file():
        sys.exit(f'{path} is missing: the payload of vLLM {release} has no dependency list in the repository.')
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith('#')]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, '-m', 'pip', *args], check=True)


def download(specs: list[str], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    pip('download', '-q', '--no-deps', *TARGET, '-d', str(into), *specs)


def install_site(wheels: Path, specs: list[str], site: Path) -> None:
    """Install the pinned specs, not bare names: the wheel cache keeps every version ever downloaded (xgrammar 0.2.9
    beside 0.2.7), and a bare name takes the newest."""
    shutil.rmtree(site, ignore_errors=True)
    pip(
        'install',
        '-q',
        '--no-deps',
        '--no-index',
        '--no-compile',
        *TARGET,
        '--find-links',
        str(wheels),
        '--target',
        str(site),
        *specs,
    )
    for pruned in PRUNED:
        path = site / pruned
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def pack(site: Path, out: Path) -> list[Path]:
    """tar | xz -9 | split -n 3; returns the parts, with SHA256SUMS of the whole beside them."""
    whole = out / 'site.tar.xz'
    with whole.open('wb') as sink:
        tar = subprocess.Popen(['tar', '-C', str(site), '-cf', '-', '.'], stdout=subprocess.PIPE)
        subprocess.run(['xz', '-9', '-T0', '-c'], stdin=tar.stdout, stdout=sink, check=True)
        if tar.wait() != 0:
            sys.exit(f'tar of {site} failed')
    digest = hashlib.sha256(whole.read_bytes()).hexdigest()
    (out / 'SHA256SUMS').write_text(f'{digest}  site.tar.xz\n')
    subprocess.run(
        ['split', '-n', str(PARTS), '-d', '-a', '1', '--numeric-suffixes=1', whole.name, 'part-'], cwd=out, check=True
    )
    whole.unlink()
    return sorted(out.glob('part-*'))


def build(release: str, out: Path, cache: Path) -> None:
    specs = requirements(release)
    spares = requirements(release, '-spares')
    download(specs, cache / 'wheels')
    download(spares, out / 'spares')
    download([ansible_core_pin()], out / 'ansible')
    install_site(cache / 'wheels', specs, out / 'site')
    for part in pack(out / 'site', out):
        print(f'{part}: {part.stat().st_size / 2**20:.1f} MiB')
    shutil.rmtree(out / 'site')


def ansible_core_pin() -> str:
    """The tool venv's ansible-core (tests/requirements.txt): the gate code runs on the device under it."""
    for line in (REPO / 'tests' / 'requirements.txt').read_text().splitlines():
        if line.startswith('ansible-core=='):
            return line.split()[0]
    sys.exit('tests/requirements.txt pins no ansible-core')


def stage(out: Path, plans: Path, into: Path, model: Path) -> None:
    """Lay out INTO/c1, c2, c3, one folder a call (each named alone in its call's carry), all at once: the calls then
    follow each other with nothing to do here in between. c1 and c2 hold the harness and a part; c3 the last part and
    what serving and judging need, for call 3 and the calls after it (the device keeps the unpacked site)."""
    shutil.rmtree(into, ignore_errors=True)
    for call in range(1, PARTS + 1):
        folder = into / f'c{call}'
        folder.mkdir(parents=True)
        for name in HARNESS:
            shutil.copy2(HERE / name, folder / name)
        shutil.copy2(out / f'part-{call}', folder / f'part-{call}')
    last = into / f'c{PARTS}'
    shutil.copy2(out / 'SHA256SUMS', last / 'SHA256SUMS')
    for extra in ('spares', 'ansible'):
        shutil.copytree(out / extra, last / extra)
    shutil.copytree(REPO / 'plugins', last / 'collection' / 'ansible_collections' / 'llmserve' / 'vllm' / 'plugins')
    for gpu in ('h100', 'h200'):
        shutil.copytree(plans / gpu, last / 'plan' / gpu)
    shutil.copytree(model, last / 'model', ignore=shutil.ignore_patterns('*.md'))
    for folder in sorted(into.iterdir()):
        size = sum(path.stat().st_size for path in folder.rglob('*') if path.is_file())
        print(f'{folder}: {size / 2**20:.1f} MiB')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('action', choices=['build', 'stage'])
    parser.add_argument('--release', default='0.26.0')
    parser.add_argument('--out', type=Path, help='where the parts go (default .build/gpu_run/RELEASE)')
    parser.add_argument('--cache', type=Path, default=Path.home() / '.cache' / 'llmserve' / 'gpu_run')
    parser.add_argument('--into', type=Path, help="the session checkout's .gpu-run (ignored by git, named in carry)")
    parser.add_argument('--model', type=Path, help='the checkpoint calls 3 and 4 serve (tiny-kimi-gpu)')
    parser.add_argument('--plans', type=Path, help='the rendered plans (default .build/gpu_run/plan)')
    args = parser.parse_args()
    out = args.out or REPO / '.build' / 'gpu_run' / args.release
    if args.action == 'build':
        out.mkdir(parents=True, exist_ok=True)
        build(args.release, out, args.cache)
        return
    if args.into is None or args.model is None:
        parser.error('stage needs --into and --model')
    stage(out, args.plans or REPO / '.build' / 'gpu_run' / 'plan', args.into, args.model)


if __name__ == '__main__':
    main()
