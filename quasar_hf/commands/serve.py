"""`quasar-hf serve MODEL_OR_CHECKPOINT`: Transformers' OpenAI-compatible server, every request decoded with
Quasar, concurrent clients batched (quasar_hf/serving/transformers_server.py).

MODEL_OR_CHECKPOINT is a Quasar checkpoint folder, or a model (folder, Hub id, embedded alias) that is
quantized with the defaults once and cached. The port is bound first; /health answers 503 until the
model is loaded and, with --compile, its steps compiled and warmed up for every batch size the server
runs, so no request pays for a compile.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from quasar_hf.commands.loading import UsageError

SERVED_CACHE = "served"  # cache_dir()/served/<name>: checkpoints quantized for `serve`
API_KEY_ENV = "QUASAR_HF_API_KEY"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
GRACEFUL_SECONDS = 5  # after SIGTERM, how long open connections may take to finish


def log(message: str) -> None:
    print(f"quasar-hf serve: {message}", file=sys.stderr, flush=True)


def servable_checkpoint(name: str) -> str:
    """A Quasar checkpoint folder for `name`: itself when it is one, else its quantization with the
    defaults, made once and cached (cache_dir()/served); a lock lets one process quantize while others
    wait for its result, and the folder appears whole (atomic_folder)."""
    from quasar_hf.commands.loading import (
        is_quasar_checkpoint,
        load_tokenizer,
        quantize_checkpoint,
        resolve_model,
        save_quantized,
    )
    from quasar_hf.detect import package_version
    from quasar_hf.locking import exclusive_lock
    from quasar_hf.models import cache_dir

    path = resolve_model(name)
    if is_quasar_checkpoint(path):
        return path
    key = hashlib.sha256(f"{Path(path).resolve() if Path(path).is_dir() else path}|{package_version()}".encode()).hexdigest()[:12]
    target = cache_dir() / SERVED_CACHE / f"{Path(path).name}-quasar-w8a8-{key}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():
            log(f"serving {target} (quantized from {name} earlier)")
            return str(target)
        log(f"{name} is not a Quasar checkpoint: quantizing it with the defaults (once; cached in {target}) ...")
        model = quantize_checkpoint(path, {}, "bfloat16")
        hub_id = name if "/" in name and not Path(name).exists() else None  # a model card names Hub ids only
        save_quantized(model, load_tokenizer(path), str(target), base_model=hub_id)
    return str(target)


def kernel_report() -> str | None:
    """One start-up line when the C++ kernels do not run here (the reason and the fix), else None."""
    from quasar_hf.ops import native

    reason = native.unavailable_reason()
    if reason is None:
        return None
    return (
        f"the C++ kernels are unavailable ({reason}); the server runs torch's fallbacks, slower, and greedy Quasar "
        "output then equals plain decoding only up to near-ties. Fix: install a C++ compiler (g++) or set $CXX, then "
        "restart; `quasar-hf doctor` lists every kernel and why it does not run."
    )


def run_serve(args: Any) -> int:
    """Bind the port, answer /health with 503 while the model loads (or is quantized) and warms up, then serve."""
    try:
        import uvicorn  # noqa: F401
        from fastapi import FastAPI  # noqa: F401
        from prometheus_client import CollectorRegistry  # noqa: F401
    except ImportError:
        raise UsageError("serving needs its extra: pip install 'quasar-hf[serve]'") from None
    from quasar_hf.serving.gate import ServingGate
    from quasar_hf.serving.metrics import CONTENT_TYPE, ServingMetrics

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.host not in LOOPBACK_HOSTS and api_key is None:
        log(
            f"WARNING: listening on {args.host} with no API key: anyone who reaches this address can use the server. "
            f"Set --api-key or ${API_KEY_ENV}."
        )
    sock = bound_socket(args.host, args.port)
    request_log = logging.getLogger("quasar_hf.serving")
    request_log.setLevel(logging.INFO)
    if not request_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("quasar-hf serve: %(message)s"))
        request_log.addHandler(handler)
    metrics = ServingMetrics()
    holder: dict[str, Any] = {}

    def shut_down() -> None:
        gate.close()
        if "state" in holder:
            holder["state"].shutdown()

    gate = ServingGate(lambda: (metrics.exposition(), CONTENT_TYPE), api_key=api_key, on_shutdown=shut_down)
    server = _uvicorn_server(gate, shut_down)
    loader = threading.Thread(target=_load, args=(args, gate, metrics, holder, server), name="quasar-load", daemon=True)
    loader.start()
    log(f"listening on http://{args.host}:{args.port}/v1 (/health answers 503 until the model is ready)")
    server.run(sockets=[sock])
    return 1 if "error" in holder else 0


def _load(args: Any, gate: Any, metrics: Any, holder: dict, server: Any) -> None:
    """Quantize or load the checkpoint and warm up compiled steps, then open the gate (on a thread)."""
    from quasar_hf.serving.transformers_server import build_app

    try:
        checkpoint = servable_checkpoint(args.model)
        problem = kernel_report()
        if problem is not None:
            log(problem)
        quasar = {"drafter": args.drafter, **({"compile": True} if args.compile else {})}
        started = time.perf_counter()
        app, model, state = build_app(
            checkpoint,
            device=args.device,
            max_batch_size=args.max_batch_size,
            quasar=quasar,
            max_model_len=args.max_model_len,
            default_model_len=compiled_model_len() if args.compile else None,
            metrics=metrics,
            max_queued=args.max_queued,
            request_timeout=args.request_timeout,
            trust_remote_code=args.trust_remote_code,
            prompt_cache_bytes=int(prompt_cache_gb(args.prompt_cache_gb) * 2**30),
        )
        holder["state"] = state
        log(f"loaded {checkpoint} in {time.perf_counter() - started:.1f} s")
        if args.compile:
            from quasar_hf.speculative.warm_up import warm_up

            batch_sizes = serving_batch_sizes(args.max_batch_size)
            warm_up(model, batch_sizes=batch_sizes, max_length=state.manager.context_tokens, log=log)
        gate.open(app, alive=lambda: state.manager.batcher.is_alive)
        log("ready")
    except BaseException as error:  # noqa: B036 - the server cannot serve: say why and stop listening
        holder["error"] = error
        log(f"cannot serve {args.model}: {type(error).__name__}: {error}")
        server.should_exit = True


def _uvicorn_server(app: Any, on_exit: Any) -> Any:
    """uvicorn's server for `app`: SIGTERM first calls `on_exit` (running rows end, waiting requests get 503),
    then uvicorn closes the open connections within GRACEFUL_SECONDS."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            on_exit()
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SECONDS, lifespan="on"))


def prompt_cache_gb(asked: float | None) -> float:
    """The prompt cache's budget in GiB: as asked, else a tenth of this machine's memory, at most 8 GiB."""
    if asked is not None:
        return asked
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1.0
    return min(8.0, memory / 10 / 2**30)


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port, bound now so a port in use fails before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port} ({error.strerror}); choose another --port or stop what uses it"
        ) from None
    sock.set_inheritable(True)
    return sock


def compiled_model_len() -> int:
    """--compile without --max-model-len: the tokens that fit the compiled cache (COMPILED_SLOTS_BASE slots less one
    padded verify step), so every request takes the cache size warm_up compiled (compiled_steps.call_cache_slots)."""
    from quasar_hf.speculative.compiled_steps import COMPILED_SLOTS_BASE
    from quasar_hf.speculative.config import DEFAULT_NUM_DRAFT_TOKENS

    return COMPILED_SLOTS_BASE - DEFAULT_NUM_DRAFT_TOKENS - 1


def serving_batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes a server meets, as compiled steps round them: powers of two up to max_batch_size."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, size]
