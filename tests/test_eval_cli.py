"""`quantkit eval` on the command line: tables, --json, report files and the gate exit codes."""
import json

import pytest
import torch

import quantkit.cli.eval_cmd  # noqa: F401  (registers the command until the lead wires it into _register)
from quantkit.evaluate.gates import GATES
from test_eval_support import perturbed, save, task_file, tiny_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # shared cores: avoid oversubscription stalls on tiny matmuls
    d = tmp_path_factory.mktemp("evalcli")
    m = tiny_model()
    yield {"base": save(m, d / "base"), "noisy": save(perturbed(m, 0.3), d / "noisy"), "tasks": task_file(d)}
    torch.set_num_threads(n)


def _args(f, *extra):
    return ["eval", f"base={f['base']}", f"noisy={f['noisy']}", "--tasks", f["tasks"], "--max-new-tokens", "3",
            *extra]


def test_gate_passes_exit_0_and_json(cli, folders, tmp_path):
    code, out, err = cli(*_args(folders, "--gate", "max_kl_p99=1000", "--json", "-o", tmp_path / "r"))
    assert code == 0, err
    report = json.loads(out)
    assert [r["label"] for r in report["variants"]] == ["base", "noisy"]
    assert report["gate_failures"] == []
    assert (tmp_path / "r" / "report.md").is_file() and (tmp_path / "r" / "task_exact_match.png").is_file()


def test_gate_violated_exit_1(cli, folders):
    code, out, err = cli(*_args(folders, "--gate", "max_kl_p99=0", "--gate", "min_agreement=0.5", "--no-plots"))
    assert code == 1
    assert "gate failed" in err and "noisy: max_kl_p99" in err
    assert "exact match" in err and "per task" in err  # the tables went to the terminal


def test_unknown_gate_exit_2_lists_valid_names(cli, folders):
    code, out, err = cli(*_args(folders, "--gate", "max_perplexity=2"))
    assert code == 2
    assert "unknown gate max_perplexity" in err and all(g in err for g in GATES)


def test_gate_needing_data_exit_2(cli, folders):
    code, _, err = cli(*_args(folders, "--gate", "max_ppl_increase=0.02"))
    assert code == 2 and "pass --data" in err
