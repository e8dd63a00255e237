# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Sphinx's configuration of the docsite (make docsite): the one `antsibull-docs sphinx-init` writes, with this
project's pages (docs/*.md, read by myst_parser) and without the network that this machine does not have."""

project = 'llmserve.vllm'
copyright = 'llmserve.vllm contributors'  # noqa: A001 (the name Sphinx reads)
title = 'llmserve.vllm'
html_short_title = 'llmserve.vllm'

extensions = ['sphinx.ext.autodoc', 'sphinx.ext.intersphinx', 'sphinx_antsibull_ext', 'myst_parser']

pygments_style = 'ansible'
highlight_language = 'YAML+Jinja'

html_theme = 'sphinx_ansible_theme'
html_show_sphinx = False
display_version = False
html_use_smartypants = True
html_use_modindex = False
html_use_index = False
html_copy_source = False

# No inventories of docs.python.org, Jinja's or Ansible's docs can be fetched here: the links into Ansible's own docs
# stay unresolved and are named below; any other unresolved reference fails the build (sphinx-build -W).
intersphinx_mapping: dict = {}
default_role = 'any'
nitpicky = True
nitpick_ignore_regex = [
    ('ref', r'ansible_collections\.ansible\.builtin\..*'),
    ('ref', r'(common_return_values|ansible_configuration_settings)'),
]

# The guides' headings, down to the third level, are link targets, as on GitHub.
myst_heading_anchors = 3
