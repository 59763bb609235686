"""Named specs loaded from the Hugging Face hub through `datasets`, cache first.

`datasets` retries an unreachable hub for half a minute before giving up, so reachability is probed first
(one TCP connect, a few seconds at most); when the hub is down or offline mode is on, `datasets` is put in
offline mode for the call so it answers from the cache or fails at once.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
from urllib.parse import urlparse

from ..errors import UserError
from .corpus import Corpus, LazyRows, RowReader
from .specs import DatasetSpec

PROBE_TIMEOUT_S = 3.0
_TRUE = {"1", "ON", "YES", "TRUE"}


def offline_requested() -> bool:
    return any(os.environ.get(v, "").upper() in _TRUE
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    from huggingface_hub import constants

    url = urlparse(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    ok = []

    def probe():
        # getaddrinfo has no timeout of its own, hence the thread.
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
            ok.append(True)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(ok)


@contextlib.contextmanager
def _offline():
    import datasets.config
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def load_hub(spec: DatasetSpec, for_eval: bool, text_field: str | None = None) -> Corpus:
    import datasets

    args = spec.hub_args(for_eval)
    flag = "--data" if for_eval else "--calib"
    offline = offline_requested() or not hub_reachable()
    label = f"dataset '{spec.name}' ({spec.hub}" + (f", {spec.config}" if spec.config else "") + f", split {args['split']})"
    try:
        with _offline() if offline else contextlib.nullcontext():
            ds = datasets.load_dataset(**args)
    except (ConnectionError, FileNotFoundError, OSError) as e:
        if offline:
            raise UserError(f"{label} is not cached and the hub is unreachable; pass a local file with {flag} PATH") \
                from None
        raise UserError(f"could not load {label}: {e}; pass a local file with {flag} PATH") from None
    # A text_field given on the command line overrides the spec's, as for files.
    field = text_field if text_field not in (None, "text") else None
    reader = RowReader(ds.column_names, label, text_field=field or spec.text_field,
                       messages_field=None if field else spec.messages_field,
                       text_template=None if field else spec.text_template)
    source = {"kind": "hub", "name": spec.hub, "config": spec.config, "split": args["split"],
              "data_files": args.get("data_files", {}).get(args["split"]), "fingerprint": ds._fingerprint,
              "rows": len(ds), "license": spec.license}
    ds = ds if reader.template else ds.select_columns([reader.field])
    return Corpus(rows=LazyRows(len(ds), lambda i: reader(ds[i], f"{label} row {i}")), source=source,
                  continuous=spec.continuous, separator=spec.separator)
