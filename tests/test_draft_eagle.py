"""The EAGLE-style draft head: training lowers held-out loss, save/load/resume, exact output when drafting."""
import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.drafts import drafter_factory
from quantkit.drafts.eagle_draft import EagleDrafter
from quantkit.drafts.eagle_head import load_head, new_head, save_head
from quantkit.drafts.eagle_train import TrainOptions, train_head
from quantkit.errors import UserError
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.testing.models import single_thread, tiny_llama

V = 64


def _own_text(model, n, seed, length=24):
    """Text the target itself samples (temperature 1) after random 3-token openings: what a head is trained on
    and then drafts for."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, V, (3,), generator=g).tolist()
        params = SamplingParams(max_tokens=length - 3, temperature=1.0, seed=seed * 1000 + i, ignore_eos=True)
        out.append(torch.tensor(p + generate(model, p, params).output_ids()))
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=V, hidden=32, layers=2, seed=7, init_std=0.2)


def train_on_own_text(target, out, **options):
    """A head trained for 120 steps on 48 sequences of the target's own text (the module fixtures' heads)."""
    with single_thread():
        opts = TrainOptions(steps=120, eval_every=20, lr=3e-3, patience=20, **options)
        return out, train_head(target, _own_text(target, 48, 1), out, opts)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    return train_on_own_text(target, tmp_path_factory.mktemp("head"))


def test_training_lowers_heldout_loss_and_raises_agreement(trained):
    _, result = trained
    first, hist = result["history"][0], result["history"]
    assert first["step"] == 0  # the untrained head, measured the same way
    assert result["best_loss"] < 0.75 * first["heldout_loss"]
    assert max(h["heldout_top1"] for h in hist) > first["heldout_top1"] + 0.1


def test_saved_head_has_vllm_eagle_names_and_loads_back(trained, target):
    out, _ = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["hidden_size"] == target.config.hidden_size
    state = load_file(str(out / "model.safetensors"))
    assert "fc.weight" in state and state["fc.weight"].shape == (32, 64)
    assert "layers.0.self_attn.q_proj.weight" in state and "layers.0.mlp.down_proj.weight" in state
    # no input norm on the one layer, no embedding and no output head: those are the target's
    assert not [k for k in state if "input_layernorm" in k or "embed" in k or "lm_head" in k]
    head = load_head(out, target)
    for name, t in head.state_dict().items():
        assert torch.equal(t, state[name]), name
    other = tiny_llama(vocab_size=V, hidden=48, layers=2)
    with pytest.raises(UserError, match="hidden_size"):
        load_head(out, other)


def test_resume_continues_from_the_saved_step(target, tmp_path):
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, V, (16,), generator=g) for _ in range(24)]
    opts = dict(eval_every=10, lr=3e-3, patience=50)
    with single_thread():
        straight = train_head(target, data, tmp_path / "a", TrainOptions(steps=40, **opts))
        first = train_head(target, data, tmp_path / "b", TrainOptions(steps=20, **opts))
        resumed = train_head(target, data, tmp_path / "b", TrainOptions(steps=40, **opts))
    assert first["steps"] == 20 and resumed["resumed_from"] == 20 and resumed["steps"] == 40
    assert [h["step"] for h in resumed["history"]] == [0, 10, 20, 30, 40]
    # the optimiser, the data order and the held-out bests all carried over: the same run as without a stop
    assert resumed["history"] == straight["history"]
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_drafter_feeds_the_head_the_targets_features_at_the_right_positions(target, trained):
    """At every draft, the head's feature for the last position equals the head run over the whole context with
    the target's features computed from scratch: the hook places the prefill's and verifies' rows right and
    drops the rows of refused drafts."""
    head = load_head(trained[0], target)
    prompt = _own_text(target, 1, 9)[0].tolist()[:10]  # before the drafter: its hook would see these forwards
    drafter = EagleDrafter(target, head)
    seen = []
    feed = drafter._feed
    drafter._feed = lambda ids: seen.append((ids.clone(), feed(ids))) or seen[-1][1]
    with single_thread():
        generate(target, prompt, SamplingParams(max_tokens=30), drafter=drafter, cost_aware=False)
    assert len(seen) > 5
    with torch.no_grad():
        for ids, g in seen:
            feats = target.model(input_ids=ids[None]).last_hidden_state
            L = ids.shape[0]
            want = head(target.model.embed_tokens(ids[None, 1:]), feats[:, :-1], torch.arange(1, L)[None])[0, -1]
            assert (g - want).abs().max() <= 1e-4 * want.abs().max(), L


def test_greedy_with_trained_head_equals_plain_on_50_prompts(target, trained, tmp_path):
    save_head(new_head(target, seed=0), tmp_path)
    makers = {"trained": drafter_factory(target, None, draft=str(trained[0])),
              "untrained": drafter_factory(target, None, draft=str(tmp_path))}
    accepted = {"trained": 0, "untrained": 0}
    steps = 0
    with single_thread():
        for i, sample in enumerate(_own_text(target, 50, 5)):
            prompt = sample.tolist()[: 4 + i % 8]
            plain = generate(target, prompt, SamplingParams(max_tokens=12)).output_ids()
            name = "trained" if i % 5 else "untrained"  # four in five prompts with the trained head
            seq = generate(target, prompt, SamplingParams(max_tokens=12), drafter=makers[name](), cost_aware=False)
            assert seq.output_ids() == plain, i
            accepted[name] += seq.metrics.accepted
            steps += seq.metrics.spec_steps
    assert steps > 200
    # per prompt, training made drafts the target keeps (the untrained head's are near chance on 64 tokens)
    assert accepted["trained"] / 40 > 3 * accepted["untrained"] / 10 + 0.2


@pytest.mark.parametrize("vocab", [None, [0, 1]], ids=["full-vocab", "reduced-vocab"])
def test_sampled_sequences_with_a_head_follow_the_target(vocab):
    # As tests/test_speculative.py's end-to-end test; the head is untrained, so its drafts are clearly wrong.
    # The reduced head drafts only tokens 0 and 1 (q is 0 on 2 and 3; this target gives token 2 ~78% of the
    # 2nd token's mass): the refusal's residual must then give them back their whole mass.
    v = 4
    tgt = tiny_llama(vocab_size=v, hidden=16, layers=1, seed=21, init_std=0.8)
    head = new_head(tgt, seed=3, vocab_ids=None if vocab is None else torch.tensor(vocab))
    head = head.eval().requires_grad_(False)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    head.attach_output(tgt)
    prompt = [1, 2, 3]
    with torch.inference_mode():
        seqs = torch.tensor([prompt + [a, b, c] for a in range(v) for b in range(v) for c in range(v)])
        pr = tgt(seqs).logits[:, -4:-1].softmax(-1)
    a, b, c = seqs[:, 3], seqs[:, 4], seqs[:, 5]
    i = torch.arange(len(seqs))
    exact = torch.zeros(v * v).index_add_(0, b * v + c, pr[i, 0, a] * pr[i, 1, b] * pr[i, 2, c])
    counts, drafted, kept = torch.zeros(v * v), 0, 0
    n = 800
    with single_thread():
        for s in range(n):
            params = SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True)
            seq = generate(tgt, prompt, params, drafter=EagleDrafter(tgt, head), num_speculative_tokens=2)
            assert seq.metrics.spec_steps >= 1
            drafted, kept = drafted + seq.metrics.drafted, kept + seq.metrics.accepted
            t1, t2 = seq.output_ids()[1:3]
            counts[t1 * v + t2] += 1
    tv = 0.5 * (counts / n - exact).abs().sum().item()
    # 800 draws on 16 outcomes: an exact sampler's TV stays under ~0.06 (tests/test_speculative.py)
    assert tv < 0.09
    assert 0.1 < kept / drafted < 0.9  # drafts were both kept and refused, so the rule's both branches ran
    if vocab is not None:  # tokens the head cannot draft came out (at their rate: the TV above), via the residual
        assert counts.view(v, v)[2:].sum() / n > 0.5  # a 2nd token the head could not draft


def test_cli_trains_a_head_that_generate_drafts_with(tmp_path):
    from pathlib import Path

    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    import quantkit.cli.draft_cmd  # noqa: F401  (registers the commands)
    import quantkit.cli.generate_cmd  # noqa: F401
    from quantkit.cli import app
    from quantkit.models.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    folder, head = tmp_path / "tiny", tmp_path / "head"
    tiny_llama(vocab_size=len(tok), hidden=32, seed=9).save_pretrained(folder)
    tok.save_pretrained(folder)
    text = Path(__file__).resolve().parent.parent / "calibration" / "texts" / "prose_calib.txt"
    run = CliRunner().invoke
    with single_thread():
        r = run(app, ["draft", "train", str(folder), "-o", str(head), "--data", str(text), "--samples", "8",
                      "--seq-len", "16", "--steps", "4", "--eval-every", "2", "--device", "cpu", "--json",
                      "--draft-vocab", "512"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["steps"] == 4 and (head / "model.safetensors").is_file()
        assert json.loads((head / "config.json").read_text())["draft_vocab_size"] == 512
        args = ["generate", str(folder), "--prompt", "The lighthouse keeper", "--max-tokens", "8", "--json"]
        drafted, plain = run(app, args + ["--draft", str(head)]), run(app, args)
    assert drafted.exit_code == 0, drafted.output
    assert json.loads(drafted.stdout)["completion"] == json.loads(plain.stdout)["completion"]
    assert json.loads(drafted.stdout)["metrics"]["spec_steps"] > 0
    bad = run(app, ["draft", "train", str(folder), "-o", str(head), "--steps", "0"])
    # the app raises it; quantkit's main() turns a UserError into one line and exit code 2
    assert isinstance(bad.exception, UserError) and "--steps must be at least 1" in str(bad.exception)


def test_every_recipe_draft_field_is_a_draft_train_flag_with_the_same_default():
    import inspect

    from quantkit.cli.draft_cmd import DRAFT_FLAGS, train_cmd
    from quantkit.recipe import DraftOptions

    params = inspect.signature(train_cmd).parameters
    assert set(DRAFT_FLAGS) <= set(params)
    assert sorted(DRAFT_FLAGS.values()) == sorted(f for f in DraftOptions.model_fields if f != "train")
    for flag, field in DRAFT_FLAGS.items():
        if field != "output":  # the recipe's default is '<output>-draft'; the command needs -o
            assert params[flag].default.default == DraftOptions.model_fields[field].default, flag


def test_a_recipe_draft_section_trains_a_head_for_the_written_checkpoint(tmp_path):
    from pathlib import Path

    from transformers import AutoTokenizer

    from quantkit.models.embedded import embedded_model_dir
    from quantkit.recipe import parse_recipe
    from quantkit.recipe_run import run_recipe

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    folder = tmp_path / "tiny"
    tiny_llama(vocab_size=len(tok), hidden=32, seed=9).save_pretrained(folder)
    tok.save_pretrained(folder)
    text = Path(__file__).resolve().parent.parent / "calibration" / "texts" / "prose_calib.txt"
    recipe = (f"model: {folder}\noutput: {tmp_path / 'w4'}\nquant:\n  method: rtn\n  group_size: 32\n"
              f"draft:\n  data: {text}\n  samples: 8\n  seq_len: 16\n  steps: 3\n  eval_every: 2\n  vocab: 512\n")
    with single_thread():
        result = run_recipe(parse_recipe(recipe))
    head = tmp_path / "w4-draft"
    assert result["draft"]["steps"] == 3 and result["draft"]["output"] == str(head)
    assert json.loads((head / "config.json").read_text())["draft_vocab_size"] == 512
    from quantkit.open_model import open_model

    opened = open_model(str(tmp_path / "w4"), draft=str(head))  # the quantised checkpoint drafts with it
    prompt = tok("The lighthouse keeper")["input_ids"]
    with single_thread():
        plain = generate(opened.model, prompt, SamplingParams(max_tokens=8)).output_ids()
        seq = generate(opened.model, prompt, SamplingParams(max_tokens=8), drafter=opened.make_drafter(),
                       cost_aware=False)
    assert seq.output_ids() == plain and seq.metrics.spec_steps > 0
    # a missing draft.data fails before quantising, and `train: false` skips the step
    bad = recipe.replace(str(text), str(tmp_path / "nope.txt")).replace("w4", "w4b")
    with pytest.raises(UserError, match="draft.data"):
        run_recipe(parse_recipe(bad))
    assert not (tmp_path / "w4b").exists()
    off = recipe.replace("draft:\n", "draft:\n  train: false\n").replace("w4", "w4c")
    with single_thread():
        assert run_recipe(parse_recipe(off))["draft"] is None
