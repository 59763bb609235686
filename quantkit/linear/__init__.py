"""Every module that stands in for an nn.Linear, one concept per file: the checkpoint's own quantised layouts
(quant.py: packed INT4/INT8; fp8.py: E4M3), the CPU layouts the runtime computes float weights in (opaque.py's
base; half_weight.py: float16 weights, float32 products; packed.py: oneDNN's blocks; half_head.py: a float16
head copy; relayout.py: which of them a float weight gets), fused projections (fused.py), and dispatch.py, the
one place that picks among them for a loaded model."""
