"""Do engines load quantkit's MoE checkpoints and score them as transformers does? W4 g64 symmetric RTN of small
random Qwen3-MoE / Mixtral / OLMoE models (hidden 512, 8 experts, top-2, bfloat16, the dtype vLLM's CPU MoE
kernel runs), scored on the same token windows and greedy prompts by transformers (the reference), quantkit's
runtime and vLLM's CPU build, the latter with its W4A16 path (VLLM_CPU_INT4_W4A8=0) and its DA8W4 path (=1,
activations in int8).

    python bench/moe_vllm.py [--archs qwen3_moe,mixtral,olmoe]     # needs .venv-vllm (bench/vllm_env.sh)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SIZES = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, vocab_size=512, num_hidden_layers=2,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
PER_ARCH = {
    "qwen3_moe": dict(head_dim=64, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                      mlp_only_layers=[], norm_topk_prob=True),
    "mixtral": dict(intermediate_size=256, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=256, num_experts=8, num_experts_per_tok=2),
}


def _checkpoint(arch: str, tmp: Path) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    cfg = AutoConfig.for_model(arch, **SIZES, **PER_ARCH[arch])
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    src, out = tmp / f"{arch}-src", tmp / f"{arch}-w4"
    m.save_pretrained(src)
    # the engines want a tokenizer folder; the scores use token ids only
    vocab = {f"t{i}": i for i in range(SIZES["vocab_size"])}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                            unk_token="t0").save_pretrained(src)
    subprocess.run([sys.executable, "-c", "from quantkit.cli import main; main()", "quantize", str(src), "-o",
                    str(out), "--group-size", "64", "--quiet"], check=True)
    return out


def main() -> None:
    from quantkit.evaluate import backends
    from quantkit.evaluate.backends import compare, score_quantkit, score_transformers, score_vllm, vllm_python

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="qwen3_moe,mixtral,olmoe")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(3, 500, (96,), generator=g).tolist() for _ in range(4)]
    prompts = [w[:16] for w in windows[:2]]
    print("| model | engine | loads | ppl vs transformers | mean abs logprob diff | greedy tokens agreeing |\n"
          "|---|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            path = str(_checkpoint(arch, Path(tmp)))
            ref = score_transformers(path, windows, prompts, 8, "bfloat16")
            engines = [("quantkit", score_quantkit(path, windows, prompts, 8, "bfloat16"))]
            for w4a8 in ("0", "1"):
                backends.VLLM_ENV = {**backends.VLLM_ENV, "VLLM_CPU_INT4_W4A8": w4a8}
                job = {"model": path, "dtype": "bfloat16", "windows": windows, "prompts": prompts, "max_new": 8}
                engines.append((f"vLLM CPU, W4A8={w4a8}", score_vllm([job], vllm_python(), timeout=400)[0]))
            for name, s in engines:
                if not s.ok:
                    print(f"| {arch} | {name} | no: {(s.error or '')[:120]} | | | |", flush=True)
                    continue
                c = compare(ref, s)
                print(f"| {arch} | {name} | yes | {c['ppl_rel']:+.2%} | {c['logprob_mean_abs']:.4f} "
                      f"| {sum(c['greedy_agree'])}/{8 * len(prompts)} |", flush=True)


if __name__ == "__main__":
    main()
