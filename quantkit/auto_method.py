"""What `--method auto` (the default) means: the solver measured best for the scheme, the architecture and the
amount of calibration text.

The rule comes from docs/benchmarks.md ("The default method"), SmolLM2-135M W4 g64 scored on three texts no
calibration source contains. With the default calibration (128 x 512 tokens the model samples itself) AWQ then
GPTQ closed 58-71% of the RTN-to-float gap on every text, AWQ alone 42-56%, GPTQ alone less. With a few
thousand tokens of one domain GPTQ fits that domain and loses to RTN on the others, while AWQ never fell below
RTN: so below GPTQ_MIN_TOKENS calibration tokens the choice is AWQ alone. For 8-bit integer weights RTN is
within 0.3% of float, so a calibration pass buys nothing. FP8 and FP4 keep RTN: GPTQ's gain there was measured
on in-domain text only, and AWQ searches on an integer grid. An architecture with no AWQ map gets RTN.
"""
from __future__ import annotations

from .schemes import get_scheme

AUTO = "auto"
# calibration tokens from which AWQ+GPTQ beat AWQ alone on every held-out text (docs/benchmarks.md)
GPTQ_MIN_TOKENS = 32768


def choose_method(config, scheme_name: str, target_schemes: list[str], bits: float | None = None,
                  calib_tokens: int = GPTQ_MIN_TOKENS) -> tuple[str, str]:
    """(method, why) for `auto` on a model with CONFIG; why is the one line quantkit.json and the CLI show.
    bits: the recipe's bit budget, which spends 3, 4 and 8-bit integer widths (plan._bit_budget);
    calib_tokens: calibration samples x tokens per sample."""
    from .solvers.awq_maps import map_for

    schemes = [get_scheme(n) for n in (scheme_name, *target_schemes)]
    weight_only_int = [s for s in schemes if s.type == "int" and s.activations is None]
    # a budget below 8 bits gives some Linears 3 or 4 bits whatever the base scheme says
    low_int = [s for s in weight_only_int if s.num_bits <= 4 or (bits is not None and bits < 8)]
    model_type = getattr(config, "model_type", None)
    if not low_int or any(s.is_fp4 for s in schemes):  # AWQ refuses the FP4 schemes (plan.py)
        return "rtn", f"auto: rtn ({scheme_name}: no calibrated method measured better for this scheme)"
    # the map, not the model type: a mapped type can still have no map for some configs (post-norm OPT)
    if map_for(config) is None:
        return "rtn", f"auto: rtn (AWQ has no scaling map for this '{model_type}' model)"
    if calib_tokens < GPTQ_MIN_TOKENS:
        return "awq", (f"auto: awq ({scheme_name} on '{model_type}' with {calib_tokens} calibration tokens: GPTQ "
                       f"on fewer than {GPTQ_MIN_TOKENS} fitted its calibration domain and lost to RTN on others)")
    return "awq+gptq", (f"auto: awq+gptq ({scheme_name} on '{model_type}' with {calib_tokens} calibration tokens: "
                        "the measured best for integer weights of 4 bits or fewer)")


def resolve(recipe, config):
    """RECIPE itself when its method is concrete, else a copy with the chosen method; and the reason (or None)."""
    q = recipe.quant
    if q.method != AUTO:
        return recipe, None
    c = recipe.calibration
    method, why = choose_method(config, q.scheme, [t.scheme for t in q.targets], q.bits, c.num_samples * c.seq_len)
    out = recipe.model_copy(deep=True)
    out.quant.method = method
    return out, why
