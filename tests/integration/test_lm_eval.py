"""lm-evaluation-harness end to end against a running node (issue 14): its
`local-completions` model scores a multiple-choice task (loglikelihood: echo +
logprobs on the prompt, token-id prompts in batches) and runs a generate-until
task, on local files (nothing downloaded). It must finish, and score the same
twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).parent.parent / "data" / "lm_eval"
TASKS = {
    "dpserve_mc": """
output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "dpserve_gen": """
output_type: generate_until
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""",
}
DATA_FILES = {"dpserve_mc": "mc.jsonl", "dpserve_gen": "gen.jsonl"}


def write_tasks(folder: Path) -> None:
    for name, body in TASKS.items():
        head = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {DATA / DATA_FILES[name]}\n"
            'test_split: test\ndoc_to_text: "{{question}}"\n'
        )
        (folder / f"{name}.yaml").write_text(head + body)


def run_lm_eval(server, demo_model_dir: str, tasks_dir: Path, out: Path) -> tuple[dict, dict]:
    """(results by task, each sample's filtered responses by task): loglikelihoods and generations."""
    model_args = ",".join([
        "model=demo",
        f"base_url={server.url}/v1/completions",
        "tokenizer_backend=huggingface",
        f"tokenizer={demo_model_dir}",
        "tokenized_requests=True",
        "num_concurrent=2",
        "max_retries=1",
        "max_length=256",
    ])
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
           "--tasks", "dpserve_mc,dpserve_gen", "--include_path", str(tasks_dir), "--batch_size", "4",
           "--output_path", str(out), "--seed", "1234", "--log_samples"]
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "hf-cache"), "NO_PROXY": "127.0.0.1,localhost"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    found = sorted(out.rglob("results_*.json"))
    assert found, proc.stdout[-2000:]
    samples = {}
    for path in sorted(out.rglob("samples_*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        samples[path.name.split("_2")[0]] = [(r["doc_id"], r["filtered_resps"]) for r in rows]
    return json.loads(found[-1].read_text())["results"], samples


def test_lm_eval_local_completions_completes_and_repeats(server, demo_model_dir, tmp_path):
    write_tasks(tmp_path)
    first, first_samples = run_lm_eval(server, demo_model_dir, tmp_path, tmp_path / "run1")
    second, second_samples = run_lm_eval(server, demo_model_dir, tmp_path, tmp_path / "run2")
    assert len(first_samples) == 2 and first_samples == second_samples  # every loglikelihood and answer, not only the scores
    scores = {task: {k: v for k, v in r.items() if k.startswith(("acc", "exact_match"))} for task, r in first.items()}
    print("lm-eval scores:", json.dumps(scores, sort_keys=True))
    assert set(first) == {"dpserve_mc", "dpserve_gen"}
    assert "acc,none" in first["dpserve_mc"] and "exact_match,none" in first["dpserve_gen"]
    assert scores == {task: {k: v for k, v in r.items() if k.startswith(("acc", "exact_match"))} for task, r in second.items()}
