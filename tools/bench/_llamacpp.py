"""llama.cpp as a benchmark peer: build llama-cpp-python once into a cache folder, convert a
checkpoint to GGUF with the converter its sdist ships, quantize it, and serve it over HTTP,
with the Python `llama_cpp.server` or with llama.cpp's own C++ `llama-server`.

    .venv/bin/python tools/bench/_llamacpp.py install         # the one-off build (8-10 min, 2 cores)
    .venv/bin/python tools/bench/_llamacpp.py install-server  # then llama-server (~19 min)

The build is a venv of its own under tools/bench/.cache/llamacpp/ (git-ignored) holding
llama-cpp-python[server] at VERSION, compiled for this CPU (`-march=native`), beside the
unpacked sdist. The converter runs in the calling interpreter (it needs torch, which the venv
does not have) with the sdist's own gguf-py. `llama-server` is compiled with cmake from the
sdist's vendored llama.cpp into server-build/ there, offline.

Facts about the peers that shape how they are measured: `llama_cpp.server` runs one request at
a time (a lock around the one model; concurrent requests wait their turn), reuses the KV of the
previous prompt's longest common prefix, must be started with `--interrupt_requests False`
(otherwise a waiting request cuts the streaming one off), and sends no `usage` in streams.
`llama-server` decodes its `--parallel` slots together (continuous batching), caches each
slot's prompt (a request goes to the slot whose prompt it shares most with, else idle slots'
prompts are kept in RAM, `--cache-ram`), and counts the reused prompt tokens in its usage
(`prompt_tokens_details.cached_tokens`); no endpoint empties those caches.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

#: The pinned llama-cpp-python release; its sdist vendors the llama.cpp whose converter is used.
VERSION = "0.3.36"
#: What the converter needs beyond this interpreter's packages (its Qwen2 path imports it).
CONVERTER_DEPS = ("sentencepiece==0.2.3",)

#: Where the build lives unless told otherwise (ignored by git).
DEFAULT_CACHE = Path(__file__).resolve().parent / ".cache" / "llamacpp"

#: GGUF weight types `convert` writes directly, and those `quantize` makes from one of them.
OUTTYPES = ("bf16", "f16", "f32")
QUANTS = ("Q8_0", "Q4_K_M")

# Only libllama and libggml are needed: no multimodal library, tests, examples or tools.
_CMAKE_ARGS = (
    "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON"
)

# The split regexes of the byte-level BPE pre-tokenizers the benchmarks' tokenizers use, with
# the name llama.cpp gives each (`tokenizer.ggml.pre`).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_BY_SPLIT = {_GPT2_SPLIT: "gpt-2", _QWEN2_SPLIT: "qwen2"}

# The C++ server alone, built from the sdist's vendored llama.cpp with nothing downloaded: no
# web UI (its prebuilt assets would come from a Hugging Face bucket), no HTTPS, and one static
# binary so it runs from its build folder.
_SERVER_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)  # fmt: skip


# ----------------------------------------------------------------------------------- build


def sdist_dir(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The unpacked sdist (its `vendor/llama.cpp` holds the converter and gguf-py)."""
    return cache_dir / f"llama_cpp_python-{VERSION}"


def venv_python(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The interpreter of the venv that llama-cpp-python[server] is installed into."""
    return cache_dir / "venv" / "bin" / "python"


def converter_site(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Where CONVERTER_DEPS are installed (`pip install --target`), put on the converter's path."""
    return cache_dir / "converter-site"


def is_installed(cache_dir: Path = DEFAULT_CACHE) -> bool:
    """Whether a finished build of VERSION and the converter's packages are in `cache_dir`
    (looks only; builds nothing)."""
    stamp = cache_dir / "installed"
    return (
        stamp.exists()
        and stamp.read_text().split()[:1] == [VERSION]
        and venv_python(cache_dir).exists()
        and (converter_site(cache_dir) / ".complete").exists()
    )


def ensure_installed(cache_dir: Path = DEFAULT_CACHE, jobs: int | None = None) -> Path:
    """The venv python that runs `llama_cpp.server`, building llama-cpp-python[server] into
    `cache_dir` first when no finished build of VERSION is there.

    The first call downloads the sdist (kept unpacked for the converter), makes a venv and
    compiles llama.cpp for this CPU with `jobs` compile jobs (default: the CPU count), about
    8-10 minutes on 2 cores; its log is `cache_dir/build.log`. Later calls return at once. A
    failed build raises RuntimeError naming the log and leaves no stamp, so the next call
    tries again.
    """
    if is_installed(cache_dir):
        return venv_python(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    stamp = cache_dir / "installed"
    if stamp.exists() and stamp.read_text().split()[:1] == [VERSION]:
        with (cache_dir / "build.log").open("a") as log:
            _install_converter_deps(cache_dir, log)
        return venv_python(cache_dir)
    log_path = cache_dir / "build.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        _install_converter_deps(cache_dir, log)
        source = sdist_dir(cache_dir)
        if not (source / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
            archive = cache_dir / f"llama_cpp_python-{VERSION}.tar.gz"
            if not archive.exists():
                _run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                     ":all:", f"llama-cpp-python=={VERSION}", "-d", str(cache_dir)],
                    log,
                )  # fmt: skip
            with tarfile.open(archive) as tar:
                tar.extractall(cache_dir, filter="data")
        python = venv_python(cache_dir)
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(cache_dir / "venv")], log)
        env = {
            **os.environ,
            "CMAKE_ARGS": _CMAKE_ARGS,
            "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs or os.cpu_count() or 2),
        }
        _run([str(python), "-m", "pip", "install", "--upgrade", "pip"], log)
        _run([str(python), "-m", "pip", "install", "--verbose", f"{source}[server]"], log, env)
        seconds = time.monotonic() - started
        log.write(f"built in {seconds:.0f} s\n")
    (cache_dir / "installed").write_text(f"{VERSION} built in {seconds:.0f} s\n")
    return python


def server_build_dir(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The cmake build folder of the C++ `llama-server`."""
    return cache_dir / "server-build"


def llama_server_binary(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Where the built `llama-server` executable is (it may not be built yet)."""
    return server_build_dir(cache_dir) / "bin" / "llama-server"


def is_server_built(cache_dir: Path = DEFAULT_CACHE) -> bool:
    """Whether a finished `llama-server` build of VERSION is in `cache_dir` (looks only)."""
    stamp = server_build_dir(cache_dir) / "installed"
    return (
        stamp.exists()
        and stamp.read_text().split()[:1] == [VERSION]
        and llama_server_binary(cache_dir).exists()
    )


def ensure_llama_server(cache_dir: Path = DEFAULT_CACHE, jobs: int | None = None) -> Path:
    """The `llama-server` executable, compiled first from the sdist's vendored llama.cpp (for
    this CPU, Release) when no finished build of VERSION is in `cache_dir/server-build`.

    Needs the unpacked sdist (`ensure_installed` makes it) and cmake; downloads nothing. Only
    the `llama-server` target is built, with `jobs` compile jobs (default: the CPU count):
    about 19 minutes on 2 busy cores; the log is `server-build/build.log`. A failed build raises
    RuntimeError naming the log and leaves no stamp, so the next call tries again.
    """
    if is_server_built(cache_dir):
        return llama_server_binary(cache_dir)
    source = sdist_dir(cache_dir) / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        ensure_installed(cache_dir)
    build = server_build_dir(cache_dir)
    build.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with (build / "build.log").open("w") as log:
        _run(["cmake", "-S", str(source), "-B", str(build), *_SERVER_CMAKE_ARGS], log)
        _run(
            ["cmake", "--build", str(build), "--config", "Release", "--target", "llama-server",
             "-j", str(jobs or os.cpu_count() or 2)],
            log,
        )  # fmt: skip
        seconds = time.monotonic() - started
        log.write(f"built in {seconds:.0f} s\n")
    (build / "installed").write_text(f"{VERSION} built in {seconds:.0f} s\n")
    return llama_server_binary(cache_dir)


def _install_converter_deps(cache_dir: Path, log: IO[str]) -> None:
    site = converter_site(cache_dir)
    if not (site / ".complete").exists():
        _run([sys.executable, "-m", "pip", "install", "--target", str(site), *CONVERTER_DEPS], log)
        (site / ".complete").write_text("\n".join(CONVERTER_DEPS))


def _run(cmd: list[str], log: IO[str], env: dict[str, str] | None = None) -> None:
    """Runs `cmd` with its output appended to `log`; a failure names the log to read."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[:5])} ...` failed; see {log.name}")


# ------------------------------------------------------------------------------ conversion


def pre_tokenizer_name(tokenizer_json: dict[str, Any]) -> str:
    """The `tokenizer.ggml.pre` name for a byte-level BPE tokenizer (tokenizer.json's content)
    that the converter's table of known tokenizers does not hold (a locally built one).

    The split regex decides: Qwen2's gives "qwen2", GPT-2's (also a ByteLevel pre-tokenizer
    with its built-in regex) "gpt-2"; anything else falls back to "gpt-2", the plain
    byte-level split, which tokenizes space-separated words the same way.
    """
    for step in _pre_tokenizer_steps(tokenizer_json.get("pre_tokenizer")):
        kind = step.get("type")
        if kind == "Split":
            pattern = step.get("pattern") or {}
            regex = pattern.get("Regex") if isinstance(pattern, dict) else None
            if regex in _PRE_BY_SPLIT:
                return _PRE_BY_SPLIT[regex]
        if kind == "ByteLevel" and step.get("use_regex", True):
            return "gpt-2"
    return "gpt-2"


def _pre_tokenizer_steps(pre: Any) -> list[dict[str, Any]]:
    if not isinstance(pre, dict):
        return []
    if pre.get("type") == "Sequence":
        return [s for s in pre.get("pretokenizers", []) if isinstance(s, dict)]
    return [pre]


def checkpoint_fingerprint(hf_dir: Path) -> str:
    """A short hash of every file in `hf_dir` (names and contents): the GGUF cache's key."""
    digest = hashlib.sha256()
    for path in sorted(p for p in hf_dir.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(hf_dir)).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def convert(
    hf_dir: Path,
    out_path: Path | None = None,
    outtype: str = "bf16",
    cache_dir: Path = DEFAULT_CACHE,
) -> Path:
    """`hf_dir` (a transformers checkpoint) as a GGUF file of `outtype` (bf16, f16, f32),
    written by the sdist's `convert_hf_to_gguf.py`; returns its path.

    Without `out_path` the file goes to `cache_dir/gguf/<fingerprint>-<outtype>.gguf` and an
    existing one is reused. The converter's pre-tokenizer table is keyed by a hash of known
    tokenizers' output; a tokenizer it does not know gets `pre_tokenizer_name`'s answer instead
    of the converter's NotImplementedError (patched in the converter's own process; the
    vendored file is not edited). Needs the sdist (`ensure_installed`) and torch here.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: choose from {', '.join(OUTTYPES)}")
    if out_path is None:
        out_path = cache_dir / "gguf" / f"{checkpoint_fingerprint(hf_dir)}-{outtype}.gguf"
        if out_path.exists():
            return out_path
    converter = sdist_dir(cache_dir) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not converter.exists():
        raise RuntimeError(f"no converter at {converter}; run `{__file__} install` first")
    tokenizer_file = hf_dir / "tokenizer.json"
    pre = "gpt-2"
    if tokenizer_file.exists():
        pre = pre_tokenizer_name(json.loads(tokenizer_file.read_text()))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    cmd = [sys.executable, __file__, "_convert", str(converter), pre, str(hf_dir),
           "--outfile", str(partial), "--outtype", outtype]  # fmt: skip
    path = os.pathsep.join(
        filter(None, [str(converter_site(cache_dir)), os.environ.get("PYTHONPATH")])
    )
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"GGUF conversion failed:\n{(result.stdout + result.stderr)[-3000:]}")
    partial.replace(out_path)
    return out_path


def _convert_in_this_process(converter: str, pre: str, argv: list[str]) -> None:
    """The converter's main, with `pre` answering for tokenizers its table does not know."""
    import runpy

    root = Path(converter).parent
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    import conversion.base as base  # the vendored converter's package

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            return str(known(self, tokenizer))
        except NotImplementedError:
            base.logger.warning("unknown BPE pre-tokenizer: written as %r", pre)
            return pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [converter, *argv]
    runpy.run_path(converter, run_name="__main__")


def quantize(
    gguf_in: Path,
    gguf_out: Path | None = None,
    qtype: str = "Q8_0",
    threads: int = 0,
    cache_dir: Path = DEFAULT_CACHE,
) -> Path:
    """`gguf_in` quantized to `qtype` (Q8_0, Q4_K_M) by `llama_cpp.llama_model_quantize`;
    returns the output path (default: beside the input, reused when it exists).

    Q4_K needs rows of a multiple of 256 values; llama.cpp falls back to another type for
    tensors whose rows are not (Qwen2.5-0.5B's 896-wide ones), as published GGUFs do.
    """
    if qtype not in QUANTS:
        raise ValueError(f"qtype {qtype!r}: choose from {', '.join(QUANTS)}")
    if gguf_out is None:
        gguf_out = gguf_in.with_name(f"{gguf_in.stem.rsplit('-', 1)[0]}-{qtype}.gguf")
        if gguf_out.exists():
            return gguf_out
    partial = gguf_out.with_name(gguf_out.name + ".partial")
    script = (
        "import ctypes, sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{qtype}\n"
        f"p.nthread = {int(threads)}\n"
        "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),"
        " ctypes.byref(p)))\n"
    )
    cmd = [str(venv_python(cache_dir)), "-c", script, str(gguf_in), str(partial)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"quantization failed:\n{(result.stdout + result.stderr)[-3000:]}")
    partial.replace(gguf_out)
    return gguf_out


# ---------------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ServerOptions:
    """How `llama_cpp.server` is started: compute threads (prompt and decode alike), context
    size, prompt batch, and any further `--name value` arguments of its own."""

    threads: int = 1
    n_ctx: int = 4096
    n_batch: int = 512
    extra: tuple[str, ...] = ()


def server_command(
    gguf: Path, port: int, alias: str, options: ServerOptions, cache_dir: Path = DEFAULT_CACHE
) -> list[str]:
    """The command line of a `llama_cpp.server` serving `gguf` as model `alias` on `port`."""
    threads = str(options.threads) if options.threads > 0 else str(os.cpu_count() or 1)
    return [
        str(venv_python(cache_dir)), "-m", "llama_cpp.server",
        "--model", str(gguf), "--model_alias", alias,
        "--host", "127.0.0.1", "--port", str(port),
        "--n_threads", threads, "--n_threads_batch", threads,
        "--n_ctx", str(options.n_ctx), "--n_batch", str(options.n_batch),
        # Without it a request waiting for the model's lock cuts the streaming one off.
        "--interrupt_requests", "False",
        *options.extra,
    ]  # fmt: skip


@dataclass(frozen=True)
class LlamaServerOptions:
    """How the C++ `llama-server` is started: compute threads (prompt and decode alike), its
    slots (requests decoded together by continuous batching), each slot's context, the
    smallest chunk of a cached prompt it shifts into place to reuse (`--cache-reuse`), and
    any further arguments of its own."""

    threads: int = 1
    parallel: int = 8
    slot_ctx: int = 4096
    cache_reuse: int = 256
    extra: tuple[str, ...] = ()


def llama_server_command(
    gguf: Path, port: int, alias: str, options: LlamaServerOptions, cache_dir: Path = DEFAULT_CACHE
) -> list[str]:
    """The command line of a `llama-server` serving `gguf` as model `alias` on `port`.

    The slots split the context (`--ctx-size` is parallel x slot_ctx; the KV is not unified
    when --parallel is given); prompts are cached per slot, and a request goes to the slot
    whose cached prompt it shares most with.
    """
    threads = str(options.threads) if options.threads > 0 else str(os.cpu_count() or 1)
    return [
        str(llama_server_binary(cache_dir)),
        "--model", str(gguf), "--alias", alias,
        "--host", "127.0.0.1", "--port", str(port),
        "--threads", threads, "--threads-batch", threads,
        "--parallel", str(options.parallel), "--cont-batching",
        "--ctx-size", str(options.parallel * options.slot_ctx),
        "--cache-reuse", str(options.cache_reuse),
        *options.extra,
    ]  # fmt: skip


@dataclass
class Server:
    """A running llama.cpp server (`llama_cpp.server` or `llama-server`): its process, base
    URL and log file."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        """Ends the server's process (terminate, then kill after 30 s)."""
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(
    gguf: Path,
    port: int,
    log: Path,
    alias: str = "default",
    options: ServerOptions = ServerOptions(),
    timeout: float = 300,
    cache_dir: Path = DEFAULT_CACHE,
) -> Server:
    """A `llama_cpp.server` on `gguf`, ready (its /v1/models answers); RuntimeError with the
    log's tail if it exits or is not ready within `timeout` seconds (the process is ended)."""
    cmd = server_command(gguf, port, alias, options, cache_dir)
    threads = cmd[cmd.index("--n_threads") + 1]
    return _start("llama_cpp.server", cmd, port, log, threads, "/v1/models", timeout)


def start_llama_server(
    gguf: Path,
    port: int,
    log: Path,
    alias: str = "default",
    options: LlamaServerOptions = LlamaServerOptions(),
    timeout: float = 300,
    cache_dir: Path = DEFAULT_CACHE,
) -> Server:
    """A `llama-server` (built by `ensure_llama_server`) on `gguf`, ready (its /health says
    ok once the model is loaded); RuntimeError with the log's tail if it exits or is not
    ready within `timeout` seconds (the process is ended)."""
    if not llama_server_binary(cache_dir).exists():
        raise RuntimeError(f"no llama-server in {cache_dir}; run `{__file__} install-server`")
    cmd = llama_server_command(gguf, port, alias, options, cache_dir)
    threads = cmd[cmd.index("--threads") + 1]
    return _start("llama-server", cmd, port, log, threads, "/health", timeout)


def _start(
    name: str, cmd: list[str], port: int, log: Path, threads: str, ready_path: str, timeout: float
) -> Server:
    """Runs `cmd` (output to `log`) and waits until GET `ready_path` answers 200."""
    _sibling_modules()
    from _peer_server import wait_ready

    env = {**os.environ, "OMP_NUM_THREADS": threads}
    print(f"+ {' '.join(cmd)}", flush=True)
    process = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    if wait_ready(process, f"{server.url}{ready_path}", timeout):
        return server
    server.stop()
    tail = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{name} did not start; its log ends with:\n{tail}")


def prepare_gguf(
    hf_dir: Path, outtype: str = "bf16", quant: str | None = None, cache_dir: Path = DEFAULT_CACHE
) -> Path:
    """The GGUF to serve for `hf_dir`: built if needed, converted (cached by the checkpoint's
    fingerprint) to `outtype` and, with `quant`, quantized from that."""
    ensure_installed(cache_dir)
    gguf = convert(hf_dir, outtype=outtype, cache_dir=cache_dir)
    return quantize(gguf, qtype=quant, cache_dir=cache_dir) if quant else gguf


def _sibling_modules() -> None:
    """Put this folder on the path (for `_peer_server`) when loaded from a file path."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["_convert"]:
        _convert_in_this_process(argv[1], argv[2], argv[3:])
        return 0
    if argv[:1] == ["install"]:
        print(ensure_installed())
        print((DEFAULT_CACHE / "installed").read_text().strip())
        return 0
    if argv[:1] == ["install-server"]:
        print(ensure_llama_server())
        print((server_build_dir() / "installed").read_text().strip())
        return 0
    print(f"usage: {Path(__file__).name} install | install-server", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
