"""`quantkit serve`: the OpenAI-compatible HTTP server over the runtime (quantkit/serve, docs/security.md)."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

import typer

from .common import app, console, emit_json


def _names(values: Optional[list[str]]) -> tuple[str, ...]:
    """Repeated options and comma-separated lists alike."""
    return tuple(v.strip() for value in values or [] for v in value.split(",") if v.strip())


def check_options(kv_cache: str, counts: dict[str, int], header_timeout: float = 10.0) -> None:
    from ..errors import UserError

    if kv_cache not in ("auto", "fp8"):
        raise UserError(f"unknown --kv-cache '{kv_cache}'; choose auto or fp8")
    if not 0 < header_timeout <= 3600:
        raise UserError(f"--header-timeout must be between 0 and 3600 seconds, got {header_timeout}")
    for name, v in counts.items():
        if v < 1:
            raise UserError(f"{name} must be at least 1, got {v}")


def check_port(port: int) -> None:
    from ..errors import UserError

    if not 0 <= port <= 65535:
        raise UserError(f"--port must be between 0 and 65535 (0: any free port), got {port}")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything is printed or loaded, so a taken port fails at once."""
    from ..errors import UserError

    check_port(port)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}; check --host") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port or --host") from None
    return sock


def warn_if_open(host: str, api_key: Optional[str], port: int) -> None:
    from ..serve.security import is_loopback

    if not api_key and not is_loopback(host):
        typer.echo(f"warning: --host {host} accepts connections from other machines and no --api-key is set: "
                   f"anyone who can reach port {port} can use this server; set --api-key or QUANTKIT_API_KEY",
                   err=True)


def load_engines(path, *, threads, dtype, draft, prompt_lookup, num_speculative_tokens, spec_max_batch, max_batch,
                 max_queue, kv_cache, compile_, compare, device="cpu"):
    """The served model's engine, and the compare model (or None)."""
    from ..open_model import open_model
    from ..runtime.engine import Engine
    from ..serve.playground import load_compare

    opened = open_model(path, dtype=dtype, threads=threads, draft=draft, prompt_lookup=prompt_lookup,
                        compile=compile_, warn=lambda note: typer.echo(note, err=True), device=device)
    model, tok, make_drafter, dt = opened.model, opened.tokenizer, opened.make_drafter, opened.dtype
    from ..linear.dispatch import kernel_paths

    for line in kernel_paths(model):  # once at start: which CPU path each Linear kind runs, and why
        typer.echo(line, err=True)
    if kv_cache == "fp8":
        from ..runtime.kv_cache import new_cache

        new_cache(model, "fp8")  # fails now, with the reason, if the checkpoint has no calibrated KV scales
    engine = Engine(model, tok, drafter_factory=make_drafter, num_speculative_tokens=num_speculative_tokens,
                    max_active=max_batch, max_queue=max_queue, spec_max_batch=spec_max_batch, kv_cache=kv_cache,
                    worker=False)  # run() steps it on the main thread
    try:
        base = load_compare(compare, engine, dtype=dt, prompt_lookup=prompt_lookup, compile_=compile_, device=device,
                            max_active=max_batch, max_queue=max_queue, spec_max_batch=spec_max_batch) if compare else None
    except BaseException:
        engine.close()
        raise
    return engine, base


@app.command("serve")
def serve_cmd(
    path: str = typer.Argument(..., help="quantkit checkpoint or Hugging Face model folder ('embedded' for SmolLM2-135M)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind (default: this machine only)"),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free port)"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="name clients send as 'model' (default: the folder name)"),
    draft: Optional[str] = typer.Option(None, "--draft", help="draft model folder, a head folder from 'quantkit draft train', 'early-exit:N', or 'self-w4'"),
    prompt_lookup: Optional[int] = typer.Option(None, "--prompt-lookup", help="draft by prompt lookup: match the last N down to 2 tokens (N=1: single tokens)"),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help="tokens drafted per verify step"),
    spec_max_batch: Optional[int] = typer.Option(None, "--spec-max-batch", help="speculate only while at most this many requests are active (default: 8 for float32 models, 3 for float16 checkpoints, 2 for int4/int8 checkpoints on a CPU, where it was measured to stop paying)"),
    max_batch: int = typer.Option(64, "--max-batch", help="requests decoded at the same time"),
    max_queue: int = typer.Option(256, "--max-queue", help="requests waiting beyond --max-batch before 429"),
    max_tokens_limit: Optional[int] = typer.Option(None, "--max-tokens-limit", help="largest max_tokens a request may ask (default: the context)"),
    clamp_max_tokens: bool = typer.Option(False, "--clamp-max-tokens", help="cut max_tokens to the context the prompt leaves instead of answering 400"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="QUANTKIT_API_KEY", help="key clients must send ('Authorization: Bearer KEY') on every /v1 route; also read from QUANTKIT_API_KEY"),
    allowed_hosts: Optional[list[str]] = typer.Option(None, "--allowed-hosts", help="more Host names to accept besides the bound address (comma-separated or repeated; '*': any)"),
    allowed_origins: Optional[list[str]] = typer.Option(None, "--allowed-origins", help="web origins allowed to call the API from a browser (CORS; default: none)"),
    max_body_bytes: int = typer.Option(2 << 20, "--max-body-bytes", help="largest request body accepted (413 beyond)"),
    header_timeout: float = typer.Option(10.0, "--header-timeout", help="seconds a connection has to send a request's headers before it is closed"),
    max_connections: int = typer.Option(512, "--max-connections", help="open connections (and requests in flight) beyond which requests get 503"),
    kv_cache: str = typer.Option("auto", "--kv-cache", help="KV cache dtype: auto (model dtype) or fp8"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 (CPU default), float16, bfloat16"),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when this torch sees a GPU, else CPU), cpu, cuda or cuda:N"),
    compile_: bool = typer.Option(False, "--compile", help="torch.compile the decode step: faster per token after a slow first call (about a minute on a small CPU)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice; 1 is fastest for small models on a busy machine)"),
    compare: Optional[str] = typer.Option(None, "--compare", help="base model to compare with side by side in the playground at / (same tokenizer)"),
    as_json: bool = typer.Option(False, "--json", help="print the resolved settings as JSON before serving"),
) -> None:
    """Serve a model over OpenAI-compatible HTTP (/v1/completions, /v1/chat/completions, /metrics).

    Example: quantkit serve ./smollm2-w4 --prompt-lookup 3 --port 8000
    then:    curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{"model": "smollm2-w4", "prompt": "Hello", "max_tokens": 16}'
    """
    from ..devices import resolve_device
    from ..runtime.checkpoint import resolve_path
    from ..serve.config import ServeConfig

    check_options(kv_cache, {"--max-batch": max_batch, "--max-queue": max_queue, "--max-connections": max_connections,
                             "--num-speculative-tokens": num_speculative_tokens, "--max-body-bytes": max_body_bytes},
                  header_timeout)
    device = resolve_device(device)
    sock = bind(host, port)
    port = sock.getsockname()[1]
    warn_if_open(host, api_key, port)
    try:
        engine, base = load_engines(path, threads=threads, dtype=dtype, draft=draft, prompt_lookup=prompt_lookup,
                                    num_speculative_tokens=num_speculative_tokens, spec_max_batch=spec_max_batch,
                                    max_batch=max_batch, max_queue=max_queue, kv_cache=kv_cache, compile_=compile_,
                                    compare=compare, device=device)
    except BaseException:
        sock.close()
        raise
    name = model_name or Path(resolve_path(path)).name
    config = ServeConfig(max_tokens_limit=max_tokens_limit, clamp_max_tokens=clamp_max_tokens, api_key=api_key or None,
                         host=host, allowed_hosts=_names(allowed_hosts), allowed_origins=_names(allowed_origins),
                         max_body_bytes=max_body_bytes, header_timeout=header_timeout, max_connections=max_connections)
    _announce(as_json, {"model": name, "host": host, "port": port, "draft": draft, "prompt_lookup": prompt_lookup,
                        "num_speculative_tokens": num_speculative_tokens, "max_batch": max_batch, "max_queue": max_queue,
                        "compare": base.name if base else None, "compile": compile_, "api_key": bool(api_key),
                        "device": device})
    run(engine, base, name, config, sock)


def _announce(as_json: bool, settings: dict) -> None:
    """The resolved settings as JSON, or the one line saying where the server is."""
    if as_json:
        emit_json(settings)
        return
    url = f"http://{settings['host']}:{settings['port']}"
    console.print(f"serving '{settings['model']}' on {url}/v1, playground at {url}/ (Ctrl-C to stop)")


def run(engine, base, name: str, config, sock: socket.socket) -> None:
    """Serve on the bound socket until Ctrl-C or SIGTERM. HTTP runs on a thread of its own and the engine's loop
    on this, the main thread (runtime/engine.py says why); the engine stops when the server does, and the
    server when the loop ends."""
    import signal
    import threading

    import uvicorn

    from ..serve.app import create_app
    from ..serve.http_limits import header_deadline_protocol
    from ..serve.playground import mount

    server = uvicorn.Server(uvicorn.Config(mount(create_app(engine, name, config), compare=base), log_level="warning",
                                           http=header_deadline_protocol(config.header_timeout),
                                           limit_concurrency=config.max_connections))

    def serve_http():
        try:
            server.run(sockets=[sock])
        finally:
            engine.close()  # a server that failed to start, or stopped, ends the loop below

    def stop(signum, frame):
        if server.should_exit:  # a second Ctrl-C or SIGTERM: stop now
            raise KeyboardInterrupt
        # take no new requests; the loop below runs on until uvicorn has answered those in flight and returned
        server.should_exit = True

    # uvicorn listens for signals on the main thread only, which is the loop's
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    http = threading.Thread(target=serve_http, name="quantkit-http", daemon=True)
    http.start()
    try:
        engine.run()
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.should_exit = True
        http.join(timeout=10)
        sock.close()
        for e in [engine] + ([base.engine] if base else []):
            e.close()
