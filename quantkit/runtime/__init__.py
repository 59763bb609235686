"""The runtime: opening checkpoints (`quantkit.load`, checkpoint.py), our own decode loop, the speculative
rejection rule, batching (the Engine) and metrics; the HTTP server over it is quantkit.serve, the drafters are
quantkit.drafts.

Import submodules directly (`quantkit.runtime.checkpoint`, `.generate`, `.sequence`, `.engine`); this package
keeps its import light so `quantkit --help` stays fast.
"""
