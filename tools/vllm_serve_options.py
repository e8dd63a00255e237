#!/usr/bin/env python3
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The long options `vllm serve` accepts, read from a vLLM wheel's source without installing it.

    .venv/bin/pip download --no-deps vllm==0.34.0 -d /tmp/wheels
    .venv/bin/python tools/vllm_serve_options.py /tmp/wheels/vllm-0.34.0-*.whl > tests/fixtures/vllm_serve_options/0.34.0.txt

`vllm serve`'s parser (vllm/entrypoints/common/cli_args.py, make_arg_parser) is built from three places, read here
with the ast module: the options named as literals in add_argument calls (make_arg_parser itself,
EngineArgs.add_cli_args in vllm/engine/arg_utils.py, vllm/entrypoints/cli/serve.py), and the fields of the frontend's
argument dataclasses (BaseFrontendArgs.add_cli_args: every field as --field-name, a bool field with its --no- twin,
as get_kwargs gives it argparse.BooleanOptionalAction). The --no- twins of the engine's own bool options come from the
same get_kwargs at run time and are not listed: a rendered --no-X fails the test until checked and added. The test that holds the rendered command line to this list
(tests/integration/test_role_render.py) reads the file named after the release the role pins.
"""

import ast
import sys
import zipfile

SOURCES = (
    'vllm/engine/arg_utils.py',
    'vllm/entrypoints/common/cli_args.py',
    'vllm/entrypoints/cli/serve.py',
)
FRONTEND_SOURCE = 'vllm/entrypoints/common/cli_args.py'
FRONTEND_BASE = 'BaseFrontendArgs'


def literal_options(tree: ast.AST) -> set[str]:
    """Every '--option' given as a positional argument of an add_argument call."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, 'attr', None) == 'add_argument':
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith('--'):
                    found.add(arg.value)
    return found


def frontend_options(tree: ast.Module) -> set[str]:
    """--field-name for each field of BaseFrontendArgs and the classes derived from it (--no-field too for a bool)."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    found = set()
    for node in classes.values():
        bases = {getattr(base, 'id', None) for base in node.bases}
        if node.name != FRONTEND_BASE and FRONTEND_BASE not in bases:
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                name = item.target.id
                if name.startswith('_'):
                    continue
                option = '--' + name.replace('_', '-')
                found.add(option)
                if ast.unparse(item.annotation) == 'bool':
                    found.add('--no-' + name.replace('_', '-'))
    return found


def serve_options(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        trees = {path: ast.parse(archive.read(path).decode('utf-8'), path) for path in SOURCES}
    options = set().union(*(literal_options(tree) for tree in trees.values()))
    options |= frontend_options(trees[FRONTEND_SOURCE])
    return sorted(options)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    print('# `vllm serve` long options of %s (tools/vllm_serve_options.py)' % argv[1].rsplit('/', 1)[-1])
    print('\n'.join(serve_options(argv[1])))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
