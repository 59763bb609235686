"""Issue 37.7: a seeded mutation loop over a real tiny checkpoint. Each case damages one thing (config.json,
quantkit.json, a safetensors header, tensor bytes, the weights file itself) and loads the result through
quantkit.load, then decodes greedily. Each must end one of three ways: a one-line UserError; the same greedy
tokens as the intact checkpoint; or a different answer with the one-line manifest warning (an edited config,
a flipped weight bit: the load hashes files of this size). Never another exception, a hang, or a silently
different answer."""
from __future__ import annotations

import json
import logging
import math
import random
import shutil

import pytest
import torch
from damage import WEIGHTS, read_raw, write_raw

import quantkit
from quantkit.errors import UserError
from quantkit.inspect_ckpt import inspect_checkpoint
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams

from helpers import deadline, make_tiny_model

SEED, CASES, PER_CASE_S = 37, 280, 20
PROMPT = [3, 17, 42, 9]
POOL = [None, -1, 0, 1, 3, 5, 8, 48, 64, 128, 10 ** 30, "64", "x", [], {}, True, 1.5, float("nan")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A W4 group-32 checkpoint of a tiny llama (~0.3 MB, no tokenizer) and its greedy answer."""
    from typer.testing import CliRunner

    import quantkit.cli.quantize_cmd  # noqa: F401  (registers the command)
    from quantkit.cli import app

    tmp = tmp_path_factory.mktemp("fuzz")
    src = make_tiny_model(tmp / "src", "llama", vocab_size=256)
    r = CliRunner().invoke(app, ["quantize", str(src), "-o", str(tmp / "w4"), "-q", "--method", "rtn",
                                 "--group-size", "32"])
    assert r.exit_code == 0, r.output
    return tmp / "w4", _greedy(tmp / "w4")


def _greedy(folder) -> list[int]:
    model = quantkit.load(folder, exact=True)
    return generate(model, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)).output_ids()


def _inspect_is_sane(folder, case: str) -> None:
    """inspect reads only headers: a one-line UserError, or sizes no larger than the files it read."""
    try:
        with deadline(PER_CASE_S):
            info = inspect_checkpoint(folder)
    except UserError as e:
        assert "\n" not in str(e), f"{case}: inspect: {e}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{case}: inspect raised {type(e).__name__}: {e}") from e
    on_disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert 0 < info["total_bytes"] <= on_disk, f"{case}: inspect reports {info['total_bytes']} of {on_disk} bytes"
    assert all(0 < r["bits_per_weight"] < 64 for r in info["layers"]), f"{case}: {info['layers'][:1]}"


# -- mutations: each takes (folder, rng) and returns what it did ------------------------------------------------

def _set_path(obj: dict, path: list[str], value) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def m_quant_config(folder, rng):
    cfg = json.loads((folder / "config.json").read_text())
    field = rng.choice(["num_bits", "group_size", "strategy", "type", "symmetric", "actorder"])
    value = rng.choice(POOL + ["group", "channel", "tensor", "int", "float"])
    _set_path(cfg, ["quantization_config", "config_groups", "group_0", "weights", field], value)
    (folder / "config.json").write_text(json.dumps(cfg))
    return f"weights.{field} = {value!r}"


def m_config_field(folder, rng):
    cfg = json.loads((folder / "config.json").read_text())
    field = rng.choice(["hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size",
                        "num_key_value_heads", "rope_theta", "tie_word_embeddings", "quantization_config",
                        "model_type", "max_position_embeddings"])
    value = rng.choice(POOL)
    if rng.random() < 0.2:
        cfg.pop(field, None)
        value = "deleted"
    else:
        cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return f"config.{field} = {value!r}"


def m_json_file(folder, rng):
    name = rng.choice(["config.json", "quantkit.json"])
    text = (folder / name).read_text()
    how = rng.choice(["truncate", "empty", "list", "deep", "garbage"])
    new = {"truncate": text[:rng.randrange(len(text))], "empty": "", "list": "[1, 2]",
           "deep": "[" * 50_000, "garbage": "\x00\xff{"}[how]
    (folder / name).write_text(new, errors="surrogateescape")
    return f"{name}: {how}"


def m_header(folder, rng):
    head, data = read_raw(folder)
    name = rng.choice(sorted(k for k in head if k != "__metadata__"))
    entry = head[name]
    how = rng.choice(["dtype", "shape", "offsets", "overlap", "negative"])
    if how == "dtype":
        entry["dtype"] = rng.choice(["F16", "BF16", "I8", "U8", "F64", "I64", "F7", "", 5])
    elif how == "shape":
        entry["shape"] = [d + rng.choice([-1, 1]) for d in entry["shape"]] or [1]
    elif how == "offsets":
        entry["data_offsets"] = [o + rng.choice([-8, -1, 1, 8]) for o in entry["data_offsets"]]
    elif how == "overlap":
        other = head[rng.choice(sorted(k for k in head if k not in ("__metadata__", name)))]
        entry["data_offsets"] = list(other["data_offsets"])
    else:
        entry["shape"] = [-d for d in entry["shape"]] or [-1]
    write_raw(folder, head, data)
    return f"header {name}: {how}"


def _scale_names(head):
    return sorted(k for k in head if k.endswith("weight_scale"))


def m_values(folder, rng):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / WEIGHTS))
    name = rng.choice(_scale_names(tensors) + ["model.embed_tokens.weight", "model.norm.weight"])
    value = rng.choice([math.nan, math.inf, -math.inf, 0.0])
    t = tensors[name]
    if value == 0.0 and rng.random() < 0.5:
        t.zero_()
    else:
        t.view(-1)[rng.randrange(t.numel())] = value
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    return f"{name} <- {value}"


def m_bytes(folder, rng):
    path = folder / WEIGHTS
    raw = bytearray(path.read_bytes())
    how = rng.choice(["flip", "truncate", "append", "zero-length"])
    if how == "flip":
        at = rng.randrange(len(raw))
        raw[at] ^= 1 << rng.randrange(8)
        how += f" bit at {at}"
    elif how == "truncate":
        raw = raw[:rng.randrange(len(raw))]
    elif how == "append":
        raw += bytes(rng.randrange(1, 64))
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    return f"weights bytes: {how}"


def m_symlink(folder, rng):
    path = folder / WEIGHTS
    outside = folder.parent / f"outside-{rng.randrange(10 ** 6)}"
    how = rng.choice(["copy", "text", "dir", "dangling"])
    if how == "copy":
        shutil.copy(path, outside)
    elif how == "text":
        outside.write_text("not weights")
    elif how == "dir":
        outside.mkdir()
    path.unlink()
    path.symlink_to(outside)
    return f"weights symlinked out of the folder ({how})"


MUTATIONS = [m_quant_config, m_config_field, m_json_file, m_header, m_values, m_bytes, m_symlink]


def test_mutated_checkpoints_refuse_or_answer_the_same(tiny, tmp_path, caplog):
    intact, want = tiny
    rng = random.Random(SEED)
    seen = {"refused": 0, "same": 0, "warned": 0}
    torch.set_num_threads(1)
    for i in range(CASES):
        folder = tmp_path / f"case{i}"
        shutil.copytree(intact, folder)
        what = MUTATIONS[i % len(MUTATIONS)](folder, rng)
        caplog.clear()
        try:
            with deadline(PER_CASE_S), caplog.at_level(logging.WARNING, logger="quantkit"):
                got = _greedy(folder)
        except UserError as e:
            assert "\n" not in str(e) and str(e), f"case {i} ({what}): {e!r}"
            seen["refused"] += 1
        except Exception as e:  # noqa: BLE001  (the point: name the case, whatever it raised)
            raise AssertionError(f"case {i} ({what}) raised {type(e).__name__}: {e}") from e
        else:
            warned = any("not as quantkit wrote it" in r.getMessage() for r in caplog.records)
            assert got == want or warned, f"case {i} ({what}): a different answer {got} != {want} with no warning"
            seen["same" if got == want else "warned"] += 1
        _inspect_is_sane(folder, f"case {i} ({what})")
        shutil.rmtree(folder)
    assert seen["refused"] > CASES // 3 and seen["same"] > 0, seen
