"""The runtime: our own decode loop, speculative decoding, batching (the Engine) and metrics; the HTTP server
over it is quantkit.serve.

Import submodules directly (`quantkit.runtime.generate`, `.speculative`, `.engine`); this package keeps its
import light so `quantkit --help` stays fast.
"""
