"""`quasar-hf serve MODEL_OR_CHECKPOINT`: Transformers' OpenAI-compatible server, every request decoded with
Quasar, concurrent clients batched (quasar_hf/serving/transformers_server.py).

MODEL_OR_CHECKPOINT is a Quasar checkpoint folder, or a model (folder, Hub id, embedded alias) that is
quantized with the defaults once and cached. With --compile the steps are compiled and warmed up for
every batch size the server runs before it listens, so no request pays for a compile.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from quasar_hf.commands.loading import UsageError

SERVED_CACHE = "served"  # cache_dir()/served/<name>: checkpoints quantized for `serve`


def log(message: str) -> None:
    print(f"quasar-hf serve: {message}", file=sys.stderr, flush=True)


def servable_checkpoint(name: str) -> str:
    """A Quasar checkpoint folder for `name`: itself when it is one, else its quantization with the
    defaults, made once and cached (cache_dir()/served), atomically (a staging folder, then a rename)."""
    from quasar_hf.commands.loading import (
        is_quasar_checkpoint,
        load_tokenizer,
        quantize_checkpoint,
        resolve_model,
        save_quantized,
    )
    from quasar_hf.detect import package_version
    from quasar_hf.models import cache_dir

    path = resolve_model(name)
    if is_quasar_checkpoint(path):
        return path
    key = hashlib.sha256(f"{Path(path).resolve() if Path(path).is_dir() else path}|{package_version()}".encode()).hexdigest()[:12]
    target = cache_dir() / SERVED_CACHE / f"{Path(path).name}-quasar-w8a8-{key}"
    if (target / "config.json").is_file():
        log(f"serving {target} (quantized from {name} earlier)")
        return str(target)
    log(f"{name} is not a Quasar checkpoint: quantizing it with the defaults (once; cached in {target}) ...")
    model = quantize_checkpoint(path, {}, "bfloat16")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    hub_id = name if "/" in name and not Path(name).exists() else None  # a model card names Hub ids only
    save_quantized(model, load_tokenizer(path), str(staging), base_model=hub_id)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
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
    """Load (or quantize) the model, warm up compiled steps with --compile, then serve until stopped."""
    try:
        import uvicorn  # noqa: F401
        from fastapi import FastAPI  # noqa: F401
    except ImportError:
        raise UsageError("serving needs Transformers' serving extra: pip install 'transformers[serving]'") from None
    from quasar_hf.serving.transformers_server import build_app, served_model

    checkpoint = servable_checkpoint(args.model)
    problem = kernel_report()
    if problem is not None:
        log(problem)
    quasar = {"drafter": args.drafter, **({"compile": True} if args.compile else {})}
    started = time.perf_counter()
    app, model_manager, state = build_app(
        checkpoint,
        device=args.device,
        max_batch_size=args.max_batch_size,
        quasar=quasar,
        max_tokens=args.max_model_len if args.compile else None,
    )
    model = served_model(model_manager, checkpoint)
    log(f"loaded {checkpoint} in {time.perf_counter() - started:.1f} s")
    if args.compile:
        from quasar_hf.speculative.warm_up import warm_up

        warm_up(model, batch_sizes=serving_batch_sizes(args.max_batch_size), max_length=args.max_model_len, log=log)
    return _listen(app, args.host, args.port, state)


def serving_batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes a server meets, as compiled steps round them: powers of two up to max_batch_size."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, size]


def _listen(app: Any, host: str, port: int, state: Any) -> int:
    import uvicorn

    log(f"listening on http://{host}:{port}/v1 (OpenAI API: /v1/chat/completions, /v1/completions, /v1/responses)")
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        state.shutdown()
    return 0
