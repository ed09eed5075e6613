#!/usr/bin/env bash
# The Python packages the end-to-end server tests use (the official openai client, jsonschema,
# pytest), in a virtual environment of the repository's own (.venv, git-ignored). The engine
# itself never uses Python.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import openai, jsonschema, pytest, httpx" 2>/dev/null; then
    .venv/bin/pip install -q --disable-pip-version-check openai jsonschema pytest httpx
fi
