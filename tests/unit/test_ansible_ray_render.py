"""The role's ray backend as it renders: a Ray node unit per host (the head's is
the Ray head), and dpserve settings only on the head, holding every rank.

Rendered by ansible-playbook itself on localhost (connection local, no ssh),
from the role's own defaults, vars and templates."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.unit.test_ansible_lint import ANSIBLE_DIR, tool

ROLE = os.path.join(ANSIBLE_DIR, "roles", "dpserve")


def render(tmp_path, backend: str) -> dict[str, dict[str, str]]:
    out = tmp_path / "out"
    # the role's defaults at their precedence: below the inventory's group and host variables
    (tmp_path / "inventory" / "group_vars").mkdir(parents=True)
    (tmp_path / "inventory" / "group_vars" / "all.yml").write_text(open(os.path.join(ROLE, "defaults", "main.yml")).read())
    inventory = tmp_path / "inventory" / "hosts.ini"
    inventory.write_text(textwrap.dedent("""
        [head]
        n1 ansible_host=10.77.0.11 dpserve_ranks=2
        [workers]
        n2 ansible_host=10.77.0.12 dpserve_ranks=3
        [dpserve:children]
        head
        workers
    """))
    (tmp_path / "inventory" / "group_vars" / "dpserve.yml").write_text(textwrap.dedent(f"""
        ansible_connection: local
        ansible_python_interpreter: {sys.executable}
        dpserve_backend: {backend}
        dpserve_model_path: /models/m
        dpserve_bin: /opt/dpserve/bin/dpserve
    """))
    playbook = tmp_path / "render.yml"
    playbook.write_text(textwrap.dedent(f"""
        - hosts: dpserve
          gather_facts: false
          vars_files: ["{ROLE}/vars/main.yml"]
          tasks:
            - ansible.builtin.file: {{path: "{out}/{{{{ inventory_hostname }}}}", state: directory, mode: "0755"}}
            - ansible.builtin.template: {{src: "{ROLE}/templates/dpserve.env.j2", dest: "{out}/{{{{ inventory_hostname }}}}/env", mode: "0644"}}
              when: _dpserve_runs_dpserve | bool
            - ansible.builtin.template: {{src: "{ROLE}/templates/dpserve-ray.service.j2", dest: "{out}/{{{{ inventory_hostname }}}}/ray.service", mode: "0644"}}
              when: _dpserve_ray | bool
    """))
    env = {**os.environ, "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"), "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run([tool("ansible-playbook"), "-i", str(inventory.parent), str(playbook)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {host: {f: (out / host / f).read_text() for f in ("env", "ray.service") if (out / host / f).exists()} for host in ("n1", "n2")}


def settings(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


@pytest.mark.slow
def test_ray_backend_renders_ray_nodes_everywhere_and_dpserve_on_the_head(tmp_path):
    files = render(tmp_path, "ray")
    head, worker = files["n1"], files["n2"]
    assert "env" not in worker, "no dpserve on a Ray worker node"
    env = settings(head["env"])
    assert env["DPSERVE_DATA_PARALLEL_BACKEND"] == "ray"
    assert env["DPSERVE_RAY_ADDRESS"] == "10.77.0.11:6379"
    assert env["DPSERVE_DATA_PARALLEL_SIZE"] == "5", "every host's ranks, placed from the head"
    assert "DPSERVE_DATA_PARALLEL_SIZE_LOCAL" not in env and "DPSERVE_HEADLESS" not in env
    assert "--head --port 6379 --include-dashboard false" in head["ray.service"]
    assert "--node-ip-address 10.77.0.11" in head["ray.service"]
    assert "--address 10.77.0.11:6379" in worker["ray.service"] and "--head" not in worker["ray.service"]
    assert "--num-cpus" not in worker["ray.service"], "Ray counts the host's CPUs by default"


@pytest.mark.slow
def test_mp_backend_renders_as_before(tmp_path):
    files = render(tmp_path, "mp")
    assert set(files["n2"]) == {"env"} and set(files["n1"]) == {"env"}
    head, worker = settings(files["n1"]["env"]), settings(files["n2"]["env"])
    assert "DPSERVE_DATA_PARALLEL_BACKEND" not in head
    assert (head["DPSERVE_DATA_PARALLEL_SIZE_LOCAL"], worker["DPSERVE_DATA_PARALLEL_START_RANK"], worker["DPSERVE_HEADLESS"]) == ("2", "2", "true")
