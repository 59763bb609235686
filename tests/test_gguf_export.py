"""The GGUF container read back by another reader: transformers' GGUF loader (which dequantises with the
`gguf` package and undoes llama.cpp's Q/K row interleave itself) rebuilds from our file exactly the weights
quantkit decodes, the same config and the same tokenizer. A tiny Llama with a tiny byte-level BPE, 256 wide
so the k-quants apply, 8 layers so the _M mixes' first/last-eighth rules pick different types."""
from pathlib import Path

import pytest
import torch

from quantkit.errors import UserError


def _tiny_bpe(folder):
    """A 600-token byte-level BPE trained on a few sentences: the same GPT-2 tokenizer structure SmolLM2's has,
    without its 49152-row embedding to quantise."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["Agnes took over the bakery on Mill Street in the autumn she turned thirty."] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    src = tmp_path_factory.mktemp("tiny")
    tok = _tiny_bpe(src)
    cfg = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=8, vocab_size=len(tok),
                               max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            (p.normal_(0, 0.05) if p.dim() == 2 else p.uniform_(0.5, 1.5))
    model.save_pretrained(src)
    return src, model


@pytest.mark.parametrize("scheme", ["q4_k_m", "q3_k_m"])
def test_transformers_reads_back_exactly_our_decoded_weights(tiny_src, tmp_path, scheme):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.gguf_job import quantize_to_gguf

    src, model = tiny_src
    decoded: dict = {}
    summary = quantize_to_gguf(str(src), str(tmp_path / "m.gguf"), scheme, method="rtn", decoded=decoded)
    assert {"Q4_K", "Q6_K"} <= set(summary["types"]) if scheme == "q4_k_m" else {"Q3_K", "Q4_K", "Q5_K"} <= set(summary["types"])
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    sd = back.state_dict()
    assert decoded.keys() == {k for k, v in model.state_dict().items() if v.dim() == 2 and k != "lm_head.weight"}
    for name, w in decoded.items():
        assert torch.equal(sd[name], w), name
        assert not torch.equal(w, model.state_dict()[name])  # rounded for real
    for name, p in model.state_dict().items():  # norms travel in float32 unchanged
        if p.dim() == 1:
            assert torch.equal(sd[name], p), name
    cfg = back.config
    assert (cfg.num_key_value_heads, cfg.num_attention_heads, cfg.num_hidden_layers) == (2, 4, 8)
    text = "Agnes took over the bakery in 1987, with 3 ovens and 12 loaves."
    tok_back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    assert tok_back(text)["input_ids"] == AutoTokenizer.from_pretrained(src)(text)["input_ids"]


def test_f16_export_is_the_float_model_in_float16(tiny_src, tmp_path):
    """--scheme f16 (the float file llama.cpp's own llama-quantize starts from): every weight read back by
    transformers equals the source's float16 rounding; nothing is quantised."""
    from transformers import AutoModelForCausalLM

    from quantkit.gguf_job import quantize_to_gguf

    src, model = tiny_src
    summary = quantize_to_gguf(str(src), str(tmp_path / "f.gguf"), "f16")
    assert set(summary["types"]) == {"F16", "F32"}  # F32: the norms
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="f.gguf", dtype=torch.float32).state_dict()
    for name, p in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(back[name], p.half().float() if p.dim() == 2 else p), name


def test_an_existing_output_needs_overwrite(tiny_src, tmp_path):
    from quantkit.gguf_job import quantize_to_gguf

    (tmp_path / "m.gguf").write_bytes(b"keep")
    with pytest.raises(UserError, match="--overwrite"):
        quantize_to_gguf(str(tiny_src[0]), str(tmp_path / "m.gguf"), "q8_0")
    assert (tmp_path / "m.gguf").read_bytes() == b"keep"


def test_cli_writes_a_gguf_and_refuses_what_it_does_not_read(tiny_src, tmp_path, cli):
    import json

    from gguf import GGUFReader

    from damage import one_line_error

    out = tmp_path / "m.gguf"
    code, stdout, err = cli("quantize", tiny_src[0], "-o", out, "--format", "gguf", "--scheme", "q6_k", "--method",
                            "rtn", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["output"] == str(out) and summary["types"]["Q6_K"] == 8 * 7 + 1  # 7 Linears a layer, the embedding
    assert {t.tensor_type.name for t in GGUFReader(str(out)).tensors} == {"Q6_K", "F32"}
    one_line_error(cli("quantize", tiny_src[0], "-o", out, "--format", "gguf", "--overwrite", "--scheme", "w4a16"),
                   "q4_k_m")
    one_line_error(cli("quantize", tiny_src[0], "-o", out, "--format", "gguf", "--overwrite", "--dtype", "float16"),
                   "--dtype")
    one_line_error(cli("quantize", tiny_src[0], "-o", out, "--format", "gguf", "--overwrite", "--method", "awq"),
                   "rtn")
    one_line_error(cli("quantize", tiny_src[0], "-o", out, "--format", "ggml"), "compressed-tensors")


def test_gptq_export_moves_codes_and_still_reads_back_exactly(tiny_src, tmp_path):
    from transformers import AutoModelForCausalLM

    from quantkit.gguf_job import quantize_to_gguf

    src, _ = tiny_src
    calib = dict(calib=str(Path(__file__).parent / "data" / "calib_sample.txt"), num_samples=4, seq_len=64)
    rtn, gptq = {}, {}
    quantize_to_gguf(str(src), str(tmp_path / "r.gguf"), "q4_k_m", method="rtn", decoded=rtn)
    summary = quantize_to_gguf(str(src), str(tmp_path / "g.gguf"), "q4_k_m", method="gptq", decoded=gptq, **calib)
    assert summary["method"] == "gptq"
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="g.gguf", dtype=torch.float32).state_dict()
    for name, w in gptq.items():
        assert torch.equal(back[name], w), name
        if name != "model.embed_tokens.weight":  # a lookup has no inputs: rtn
            assert not torch.equal(w, rtn[name]), name
    assert torch.equal(gptq["model.embed_tokens.weight"], rtn["model.embed_tokens.weight"])


def test_gptq_export_solves_on_the_hessian_with_the_decorrelation_prior(tiny_src, tmp_path):
    """GGUF's GPTQ reads the Hessian as the compressed-tensors GPTQ does: on T calibration tokens it gives up
    2048 / (2048 + T) of the off-diagonal part (issue 43's prior) and keeps the diagonal. Checked on one Linear
    against the solve of a Hessian shrunk here from the measured one."""
    from gguf import GGUFReader

    from quantkit.formats.gguf_codec import decode
    from quantkit.gguf_job import gather_hessians, quantize_to_gguf
    from quantkit.solvers.gguf_gptq import gguf_gptq
    from safetensors.torch import load_file

    src, _ = tiny_src
    calib = dict(calib=str(Path(__file__).parent / "data" / "calib_sample.txt"), num_samples=4, seq_len=64)
    gptq = {}
    summary = quantize_to_gguf(str(src), str(tmp_path / "g.gguf"), "q4_k_m", method="gptq", decoded=gptq, **calib)
    share = 2048 / (2048 + 4 * 64)
    assert summary["hessian_decorrelate"] == round(share, 4)
    measured, tokens = gather_hessians(str(src), **calib)
    assert tokens == 4 * 64
    name = "model.layers.0.mlp.down_proj.weight"
    H = measured[name]
    shrunk = H * (1 - share)
    shrunk.diagonal().copy_(H.diagonal())
    kind = {t.name: t.tensor_type.name for t in GGUFReader(str(tmp_path / "g.gguf")).tensors}["blk.0.ffn_down.weight"]
    w = load_file(str(src / "model.safetensors"))[name].float()
    assert torch.equal(gptq[name], decode(gguf_gptq(w, shrunk, kind)[0], w.shape))
    assert not torch.equal(gptq[name], decode(gguf_gptq(w, H, kind)[0], w.shape))


def test_the_default_weighs_rounding_by_activations_and_lowers_the_output_error(tiny_src, tmp_path, cli):
    """--method auto (the default): each input column's mean squared activation on the calibration text weighs
    its rounding error. Against rtn (no data) on the same type, the output error on those activations,
    tr((W - Q) H (W - Q)ᵀ) with the full H, must come out lower over the model's Linears."""
    import json

    from quantkit.gguf_job import gather_hessians, quantize_to_gguf

    src, _ = tiny_src
    calib = dict(calib=str(Path(__file__).parent / "data" / "calib_sample.txt"), num_samples=4, seq_len=64)
    rtn, auto = {}, {}
    quantize_to_gguf(str(src), str(tmp_path / "r.gguf"), "q4_0", method="rtn", decoded=rtn)
    summary = quantize_to_gguf(str(src), str(tmp_path / "a.gguf"), "q4_0", decoded=auto, **calib)
    assert summary["method"] == "rtn, activation-weighted"
    from safetensors.torch import load_file

    weights = load_file(str(src / "model.safetensors"))
    H = gather_hessians(str(src), **calib)[0]

    def error(decoded):
        return sum(float(torch.trace((weights[n] - decoded[n]).double() @ H[n].double()
                                     @ (weights[n] - decoded[n]).double().t())) for n in H)
    assert error(auto) < 0.97 * error(rtn), (error(auto), error(rtn))
    # and from the command line, as a user runs it: the default needs no --method
    out = tmp_path / "cli.gguf"
    code, stdout, err = cli("quantize", src, "-o", out, "--format", "gguf", "--scheme", "q4_0", "--calib",
                            calib["calib"], "--num-samples", "4", "--seq-len", "64", "--json")
    assert code == 0, err
    assert json.loads(stdout)["method"] == "rtn, activation-weighted"
