"""The OpenAI-compatible HTTP server over the runtime's Engine (quantkit serve).

app.py builds the app; completions.py, chat.py and info.py hold the handlers (module level, reading the shared
state from `request.app.state.serve`); generation.py runs one request on the engine and responses.py shapes
its answer; protocol.py validates request bodies; security.py guards every request; playground.py serves the
browser page (static/) and the compare model. This package imports quantkit.runtime, never the reverse.
"""
