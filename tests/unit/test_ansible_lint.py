"""The Ansible rollout passes ansible-playbook --syntax-check and ansible-lint's production profile."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ANSIBLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ansible")
BIN = os.path.dirname(sys.executable)


def tool(name: str) -> str:
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        path = shutil.which(name) or ""
    if not path:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return path


def run(*cmd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANSIBLE_LOCAL_TEMP": "/tmp/ansible-local", "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(cmd, cwd=ANSIBLE_DIR, capture_output=True, text=True, timeout=300, env=env)


def test_playbooks_pass_syntax_check():
    out = run(tool("ansible-playbook"), "--syntax-check", "-i", "inventory.example.ini", "site.yml", "rolling-restart.yml", "remove-node.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ansible_lint_production_profile():
    out = run(tool("ansible-lint"), "--project-dir", ".", "--profile", "production", "--nocolor")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in out.stdout + out.stderr
