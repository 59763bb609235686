"""Issue 37.2: quantkit.json carries a sha256 manifest of every file; `quantkit verify` checks the files against
it and runs the load checks (exit 0 / 1 changed / 2 damaged, --json for CI); a load warns in one line when
the files are not as written, and still loads (the edit may be on purpose)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from damage import ckpt, damaged, run_cli  # noqa: F401  (fixtures)
from damage import edit_json, edit_tensors, read_raw

WEIGHTS = "model.safetensors"


def _verify(run_cli, folder):
    code, out, err = run_cli("verify", folder, "--json")
    return code, json.loads(out)


def test_manifest_lists_every_file_but_itself(ckpt):
    manifest = json.loads((ckpt / "quantkit.json").read_text())["manifest"]
    names = {p.name for p in ckpt.iterdir() if p.name != "quantkit.json"}
    assert manifest["algorithm"] == "sha256" and set(manifest["files"]) == names
    for name, rec in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_verify_passes_an_intact_checkpoint(run_cli, ckpt):
    code, report = _verify(run_cli, ckpt)
    assert code == 0 and report["ok"] and not report["manifest"]["problems"] and report["integrity"]["error"] is None
    code, out, _ = run_cli("verify", ckpt)
    assert code == 0 and "files match" in out and "load checks: pass" in out


def test_a_flipped_weight_byte_is_caught_by_verify(run_cli, damaged):
    """Same size, one bit different, no NaN: only the digest tells."""
    head, _ = read_raw(damaged)
    raw = bytearray((damaged / WEIGHTS).read_bytes())
    # the lowest mantissa byte of the embedding's first float32
    at = 8 + int.from_bytes(raw[:8], "little") + head["model.embed_tokens.weight"]["data_offsets"][0]
    raw[at] ^= 0x01
    (damaged / WEIGHTS).write_bytes(bytes(raw))
    code, report = _verify(run_cli, damaged)
    assert code == 1 and report["manifest"]["problems"] == [f"{WEIGHTS} has changed (sha256 differs)"]
    assert report["integrity"]["error"] is None


def test_an_edited_config_loads_with_one_warning_and_verify_exits_1(run_cli, damaged):
    edit_json(damaged, "config.json", lambda c: c.__setitem__("eos_token_id", 5))
    proc = subprocess.run([sys.executable, "-c", "from quantkit.cli import main; main()", "generate", str(damaged),
                           "--prompt", "hi", "--max-tokens", "2", "--json"], capture_output=True, text=True,
                          timeout=120)
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert proc.returncode == 0 and len(warnings) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "config.json has" in warnings[0] and f"quantkit verify {damaged}" in warnings[0]
    code, report = _verify(run_cli, damaged)
    assert code == 1 and report["manifest"]["problems"][0].startswith("config.json has")


def test_damage_the_load_checks_refuse_is_exit_2(run_cli, damaged):
    edit_tensors(damaged, lambda t: t["model.layers.0.mlp.up_proj.weight_scale"].__setitem__((1, 0), float("nan")))
    code, report = _verify(run_cli, damaged)
    assert code == 2 and not report["ok"]
    assert "up_proj.weight_scale holds 1 non-finite" in report["integrity"]["error"]


def test_missing_and_added_files_are_named(run_cli, damaged):
    (damaged / "generation_config.json").unlink()
    (damaged / "extra.safetensors").write_bytes(b"")
    _, report = _verify(run_cli, damaged)
    assert "generation_config.json is missing" in report["manifest"]["problems"]
    assert "extra.safetensors was added" in report["manifest"]["problems"]


def test_no_manifest_is_said_not_assumed(run_cli, damaged):
    edit_json(damaged, "quantkit.json", lambda m: m.pop("manifest"))
    code, report = _verify(run_cli, damaged)
    assert code == 1 and "no manifest" in report["manifest"]["problems"][0]
    code, out, err = run_cli("generate", damaged, "--prompt", "hi", "--max-tokens", "2")
    assert code == 0 and "warning" not in err


def test_source_model_identity_is_recorded(ckpt, tmp_path):
    from quantkit.formats.manifest import source_identity

    meta = json.loads((ckpt / "quantkit.json").read_text())
    src_config = (ckpt.parent / "src" / "config.json").read_bytes()
    assert meta["source_config_sha256"] == hashlib.sha256(src_config).hexdigest()
    assert meta["quantkit_version"]
    snapshot = tmp_path / "models--x--y" / "snapshots" / ("ab12" * 10)
    snapshot.mkdir(parents=True)
    assert source_identity(snapshot) == {"source_revision": "ab12" * 10}
