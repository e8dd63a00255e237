# SPDX-License-Identifier: GPL-3.0-or-later
"""Fail when a function of the collection's code is longer than the limit (make lint).

    python3 tools/function_length.py [--limit 60] PATH...

Each PATH is a Python file or a directory searched for *.py files. A function's length runs from its
`def` line to its last line, docstring and comments included: what a reader has to hold at once. Prints
each function over the limit as path:line: name is N lines, and exits 1 when there is any.
"""

import argparse
import ast
import os
import sys


def python_files(paths):
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()
                for name in sorted(files):
                    if name.endswith('.py'):
                        yield os.path.join(root, name)
        else:
            yield path


def long_functions(path, limit):
    """(line, name, length) of each function in the file at path longer than limit lines."""
    with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                yield node.lineno, node.name, length


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--limit', type=int, default=60, help='the most lines a function may have (default 60)')
    parser.add_argument('paths', nargs='+', help='Python files, or directories to search for *.py files')
    args = parser.parse_args(argv)
    found = 0
    for path in python_files(args.paths):
        for line, name, length in long_functions(path, args.limit):
            print('%s:%d: %s is %d lines (at most %d)' % (path, line, name, length, args.limit))
            found += 1
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
