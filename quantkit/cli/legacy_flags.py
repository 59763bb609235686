"""`quantize`'s old flag spellings, kept for one release as hidden aliases of `--set FIELD=VALUE`.

They are rewritten into the --set form before the command line is parsed, so they never show in --help and
behave exactly as the --set they stand for; each prints a one-line note with that form.
"""
from __future__ import annotations

import typer
from typer.core import TyperCommand

from ..errors import UserError

# flag taking a value -> the recipe field it sets
VALUE_FLAGS = {
    "--damp": "quant.gptq.damp", "--block-size": "quant.gptq.block_size", "--actorder": "quant.gptq.actorder",
    "--gptq-holdout": "calibration.holdout", "--awq-grid": "quant.awq.grid",
    "--awq-search-tokens": "quant.awq.search_tokens", "--awq-fallback": "quant.awq.fallback",
    "--awq-holdout": "calibration.holdout", "--awq-tolerance": "quant.awq.min_gain",
    "--awq-clip-prior-tokens": "quant.awq.clip_prior_tokens", "--kv-cache": "quant.kv_cache",
    "--smooth-alpha": "quant.smoothquant.alpha", "--moe-min-tokens": "quant.moe.min_tokens",
    "--signround-iters": "quant.signround.iters", "--signround-lr": "quant.signround.lr",
    "--signround-batch": "quant.signround.batch", "--signround-holdout": "calibration.holdout",
    "--seed": "calibration.seed", "--calib-cut": "calibration.cut", "--text-field": "calibration.text_field",
    "--min-tokens": "calibration.min_tokens",
}

# on/off switch -> (field, value)
SWITCHES = {
    "--sym": ("quant.symmetric", True), "--asym": ("quant.symmetric", False),
    "--full-range": ("quant.full_range", True), "--no-full-range": ("quant.full_range", False),
    "--clip-search": ("quant.clip_search", True), "--no-clip-search": ("quant.clip_search", False),
    "--static-groups": ("quant.gptq.static_groups", True), "--no-static-groups": ("quant.gptq.static_groups", False),
    "--awq-duo": ("quant.awq.duo", True), "--no-awq-duo": ("quant.awq.duo", False),
    "--awq-clip": ("quant.awq.clip", True), "--no-awq-clip": ("quant.awq.clip", False),
    "--smooth": ("quant.smooth", True), "--no-smooth": ("quant.smooth", False),
    "--moe-calibrate-all": ("quant.moe.calibrate_all_experts", True),
    "--moe-routed-only": ("quant.moe.calibrate_all_experts", False),
    "--signround-clip": ("quant.signround.clip", True), "--no-signround-clip": ("quant.signround.clip", False),
}


def _as_set(arg: str, following: list[str]) -> tuple[str, int] | None:
    """The FIELD=VALUE an old flag stands for and how many following arguments it used; None: not an old flag."""
    flag, eq, inline = arg.partition("=")
    if flag in SWITCHES and not eq:
        field, on = SWITCHES[flag]
        return f"{field}={'true' if on else 'false'}", 0
    if flag not in VALUE_FLAGS:
        return None
    if eq:
        return f"{VALUE_FLAGS[flag]}={inline}", 0
    if not following:
        raise UserError(f"{flag} needs a value; it is now --set {VALUE_FLAGS[flag]}=VALUE")
    return f"{VALUE_FLAGS[flag]}={following[0]}", 1


def rewrite(args: list[str]) -> list[str]:
    """The command line with every old flag replaced by its --set form (a note per flag on stderr)."""
    out, i = [], 0
    while i < len(args):
        if args[i] == "--":  # everything after is positional
            return out + args[i:]
        got = _as_set(args[i], args[i + 1:])
        if got is None:
            out.append(args[i])
            i += 1
            continue
        typer.echo(f"note: {args[i]} is now --set {got[0]}", err=True)
        out += ["--set", got[0]]
        i += 1 + got[1]
    return out


class WithLegacyFlags(TyperCommand):
    """A typer command that reads the old spellings above before parsing its own options."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, rewrite(list(args)))
