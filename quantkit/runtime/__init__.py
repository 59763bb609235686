"""The runtime: our own decode loop, speculative decoding, metrics and the OpenAI-compatible server.

Import submodules directly (`quantkit.runtime.generate`, `.speculative`, `.server`); this package keeps its
import light so `quantkit --help` stays fast.
"""
