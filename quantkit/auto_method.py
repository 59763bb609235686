"""What `--method auto` (the default) means: the solver measured best for the scheme and the architecture.

The rule comes from docs/benchmarks.md. With the default calibration (128 x 512 tokens the model samples itself)
AWQ then GPTQ closed 58-71% of the RTN-to-float gap on three texts no calibration source contains, AWQ alone
42-56%, GPTQ alone less ("The default method"). With a few thousand tokens of one domain GPTQ used to fit that
domain and lose to RTN on the others, and auto then chose AWQ alone; since GPTQ's Hessian gives up prior / (prior
+ tokens) of its off-diagonal part (solvers/decorrelation.py), AWQ+GPTQ calibrated on 2,048 tokens of each of
three domains is the best in-domain (AWQ alone 5.9-7.7% worse there) and beats RTN on the other two ("GPTQ at
every calibration size", suite `calib_size`): one choice at every calibration size. For 8-bit integer weights RTN
is within 0.3% of float, so a calibration pass buys nothing. FP8 and FP4 keep RTN: GPTQ's gain there was
measured on in-domain text only, and AWQ searches on an integer grid. An architecture with no AWQ map gets RTN.
"""
from __future__ import annotations

from .schemes import get_scheme

AUTO = "auto"


def choose_method(config, scheme_name: str, target_schemes: list[str], bits: float | None = None) -> tuple[str, str]:
    """(method, why) for `auto` on a model with CONFIG; why is the one line quantkit.json and the CLI show.
    bits: the recipe's bit budget, which spends 3, 4 and 8-bit integer widths (plan._bit_budget)."""
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
    return "awq+gptq", (f"auto: awq+gptq ({scheme_name} on '{model_type}': the measured best for integer weights "
                        "of 4 bits or fewer, at every calibration size)")


def resolve(recipe, config):
    """RECIPE itself when its method is concrete, else a copy with the chosen method; and the reason (or None)."""
    q = recipe.quant
    if q.method != AUTO:
        return recipe, None
    method, why = choose_method(config, q.scheme, [t.scheme for t in q.targets], q.bits)
    out = recipe.model_copy(deep=True)
    out.quant.method = method
    return out, why
