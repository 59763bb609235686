"""Capture: what a decoder layer, and each Linear in it, is fed by the calibration samples; and which samples
are held out to judge the solvers' choices.

The one place every solver and layer transform (GPTQ, AWQ's block search and clip, SmoothQuant, learned rounding,
the KV observers) gets its activations from: `layer.py` runs the model a layer at a time and hands over a
layer's, a block's or a Linear's inputs (the KV observer runs the captured layer inputs through the layer with a
recording cache: keys and values are no module's input); `holdout.py` decides, by each sample's place in the
whole calibration set, which samples the guards judge on. Below the solvers (layer 3): it knows modules and
tensors, no algorithm. This file imports nothing, so the recipe schema reads the hold-out default without torch.
"""
