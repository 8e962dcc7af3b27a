"""The benchmark tools' own logic, without running a benchmark: the vLLM / SGLang adapters of
tools/bench/engine_bench.py against stand-in modules (neither peer installs on a CPU machine),
tools/bench/report.py rendering and plotting from saved figures, and the corpus part of
tools/bench/grammar_bench.py on stand-in corpora over a tiny vocabulary."""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"


@pytest.fixture(scope="module")
def engine_bench() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("engine_bench")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def report() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("report")
    finally:
        sys.path.remove(str(BENCH))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class _PrefixMemory:
    """What a prefix cache would report: the longest prefix shared with an earlier prompt."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def cached(self, prompt: list[int]) -> int:
        best = max((_common_prefix(prompt, s) for s in self.seen), default=0)
        self.seen.append(prompt)
        return min(best, len(prompt) - 1)


def _fake_vllm(log: dict[str, Any]) -> dict[str, types.ModuleType]:
    vllm = types.ModuleType("vllm")
    params_mod = types.ModuleType("vllm.sampling_params")

    class SamplingParams:
        def __init__(self, **kw: Any) -> None:
            self.kw = kw

    class StructuredOutputsParams:
        def __init__(self, json: Any = None) -> None:
            self.json = json

    class LLM:
        def __init__(self, **kw: Any) -> None:
            log["init"] = kw
            self.memory = _PrefixMemory()

        def reset_prefix_cache(self) -> None:
            log["resets"] = log.get("resets", 0) + 1
            self.memory = _PrefixMemory()

        def generate(self, prompts: list[Any], params: list[Any], use_tqdm: bool) -> list[Any]:
            log.setdefault("params", []).extend(p.kw for p in params)
            outs = []
            for prompt, p in zip(prompts, params, strict=True):
                ids = prompt["prompt_token_ids"]
                seqs = [
                    types.SimpleNamespace(token_ids=[7 + j] * p.kw["max_tokens"])
                    for j in range(p.kw["n"])
                ]
                cached = self.memory.cached(ids)
                outs.append(types.SimpleNamespace(outputs=seqs, num_cached_tokens=cached))
            return outs

    vllm.LLM = LLM  # type: ignore[attr-defined]
    vllm.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    params_mod.StructuredOutputsParams = StructuredOutputsParams  # type: ignore[attr-defined]
    return {"vllm": vllm, "vllm.sampling_params": params_mod}


def _fake_sglang(log: dict[str, Any]) -> dict[str, types.ModuleType]:
    sglang = types.ModuleType("sglang")

    class Engine:
        def __init__(self, **kw: Any) -> None:
            log["init"] = kw
            self.memory = _PrefixMemory()

        def flush_cache(self) -> None:
            self.memory = _PrefixMemory()

        def shutdown(self) -> None:
            log["shutdown"] = True

        def generate(self, input_ids: list[list[int]], sampling_params: list[Any]) -> list[Any]:
            log.setdefault("params", []).extend(sampling_params)
            return [
                {
                    "output_ids": [3] * p["max_new_tokens"],
                    "meta_info": {
                        "prompt_tokens": len(ids),
                        "cached_tokens": self.memory.cached(ids),
                    },
                }
                for ids, p in zip(input_ids, sampling_params, strict=True)
            ]

    sglang.Engine = Engine  # type: ignore[attr-defined]
    return {"sglang": sglang}


def _args() -> Any:
    return types.SimpleNamespace(dtype="bfloat16", peer_memory=0.4, seed=0)


def _calls(engine_bench: Any) -> list[Any]:
    Call = engine_bench.Call
    prefix = list(range(100, 140))
    schema = json.dumps({"type": "object"})
    return [
        Call([*prefix, 1, 2], {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}),
        Call([*prefix, 3], {"temperature": 0.7, "max_new_tokens": 2, "n": 3, "seed": 5}),
        Call([*prefix, 4], {"temperature": 0, "max_new_tokens": 5, "json_schema": schema}),
    ]


def test_vllm_adapter_maps_params_outputs_and_hit_rate(
    engine_bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log: dict[str, Any] = {}
    for name, module in _fake_vllm(log).items():
        monkeypatch.setitem(sys.modules, name, module)
    system = engine_bench.VllmSystem(tmp_path, _args())
    assert log["init"]["load_format"] == "dummy"
    assert log["init"]["enable_prefix_caching"] is True
    assert log["init"]["gpu_memory_utilization"] == 0.4
    calls = _calls(engine_bench)
    system.reset()
    system.generate(calls)
    assert [len(c.outputs) for c in calls] == [1, 3, 1]
    assert calls[1].outputs == [[7, 7], [8, 8], [9, 9]]
    first, second, third = log["params"]
    assert first["ignore_eos"] is True and first["max_tokens"] == 4 and first["n"] == 1
    assert second["n"] == 3 and second["seed"] == 5 and second["temperature"] == 0.7
    assert third["structured_outputs"].json == {"type": "object"}
    # 42 + 3 x 41 + 41 prompt tokens; cached: 0, then 40 for each of the three samples, then 40.
    assert system.hit_rate() == pytest.approx((3 * 40 + 40) / (42 + 3 * 41 + 41))
    system.reset()
    assert log["resets"] == 2
    assert system.hit_rate() != system.hit_rate()  # nan: nothing measured since the reset


def test_sglang_adapter_expands_n_with_distinct_seeds(
    engine_bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log: dict[str, Any] = {}
    for name, module in _fake_sglang(log).items():
        monkeypatch.setitem(sys.modules, name, module)
    system = engine_bench.SglangSystem(tmp_path, _args())
    assert log["init"]["load_format"] == "dummy"
    assert log["init"]["mem_fraction_static"] == 0.4
    calls = _calls(engine_bench)
    system.reset()
    system.generate(calls)
    assert [len(c.outputs) for c in calls] == [1, 3, 1]
    sent = log["params"]
    assert len(sent) == 5
    assert [p.get("sampling_seed") for p in sent[1:4]] == [5000, 5001, 5002]
    assert "sampling_seed" not in sent[0]
    assert sent[4]["json_schema"] == calls[2].params["json_schema"]
    assert calls[0].outputs == [[3, 3, 3, 3]]
    # per request: 0 of 42, then 40 of 41 three times, then 40 of 41.
    assert system.hit_rate() == pytest.approx(160 / 206)
    system.close()
    assert log["shutdown"]


def test_peers_are_only_offered_on_a_gpu(engine_bench: Any) -> None:
    assert engine_bench.installed_peers("cpu") == []


def _rows(systems: dict[str, float], **setup: Any) -> list[dict[str, Any]]:
    rows = []
    for workload in ("few_shot", "json"):
        for name, speed in systems.items():
            rows.append(
                {
                    "workload": workload,
                    "system": name,
                    "seconds": 10.0,
                    "requests_per_s": speed / 16,
                    "output_tokens_per_s": speed,
                    "hit_rate": 0.9 if name in ("radixlm", "vllm") else float("nan"),
                    "optimal_hit_rate": 0.95,
                    "extra": "",
                    **setup,
                }
            )
    return rows


def _results(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    (results / "engine.json").write_text(json.dumps(rows))
    machine = {
        "cpu": "test cpu",
        "cores": 2,
        "usable_cores": 2,
        "memory_gb": 8,
        "gpus": [],
        "torch": "x",
        "torch_threads": 2,
        "python": "3",
        "platform": "linux",
        "load_average": 0.1,
        "date": "2026-12-01 00:00 UTC",
        "commit": "abc1234",
    }
    meta = {"command": "python tools/bench/report.py", "quick": False, "machine": machine}
    (results / "meta.json").write_text(json.dumps(meta))
    return results


def _render(report: Any, results: Path, tmp_path: Path, monkeypatch: Any) -> str:
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# B\n\nkept above\n\n{report.START}\nold\n{report.END}\n\nkept below\n")
    img = tmp_path / "img"
    argv = ["report.py", "--from-json", str(results), "--page", str(page), "--img", str(img)]
    monkeypatch.setattr(sys, "argv", argv)
    assert report.main() == 0
    return page.read_text()


def test_report_renders_tables_and_plots_between_its_markers(
    report: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    systems = {"radixlm": 100.0, "radixlm-nocache": 20.0, "transformers": 8.0}
    results = _results(tmp_path, _rows(systems))
    text = _render(report, results, tmp_path, monkeypatch)
    assert "kept above" in text and "kept below" in text and "\nold\n" not in text
    assert "| few_shot | 6.25 (100.0) | 1.25 (20.0) | 0.50 (8.0) | 5.00× | 12.50× |" in text
    assert "| json | 90.0 % | 95.0 % | 94.7 % |" in text
    assert "Qwen2.5-0.5B" in text and "float32 on cpu" in text
    names = sorted(p.name for p in (tmp_path / "img").iterdir())
    assert names == ["hit_rate.png", "ratio_vs_transformers.png", "throughput.png"]
    assert all((tmp_path / "img" / n).stat().st_size > 5000 for n in names)


def test_report_shows_gpu_peers_with_their_hit_rates(
    report: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    systems = {"radixlm": 900.0, "transformers": 100.0, "vllm": 600.0, "sglang": 800.0}
    rows = _rows(systems, shape="llama-3.1-8b", dtype="bfloat16", device="cuda", scale=4)
    text = _render(report, _results(tmp_path, rows), tmp_path, monkeypatch)
    assert "× vLLM" in text and "× SGLang" in text
    assert "| few_shot | 56.25 (900.0) | 6.25 (100.0) | 37.50 (600.0) | 50.00 (800.0) | " in text
    assert "9.00× | 1.50× | 1.12× |" in text
    assert "vLLM hit rate" in text and "| 90.0 % | 95.0 % | 94.7 % | 90.0 % | – |" in text
    assert "Llama-3.1-8B" in text and "bfloat16 on cuda" in text and "× 4" in text


def test_id_tokenizer_maps_word_ids_and_text_one_to_one(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from _common import ID_TOKENS_FROM, id_tokenizer
    finally:
        sys.path.remove(str(BENCH))
    import random

    from transformers import AutoTokenizer

    from radixlm.constrained import TokenizerInfo

    tokenizer = id_tokenizer(tmp_path, 5000)
    assert len(tokenizer) == 5000 and tokenizer.eos_token_id == 0
    # What a server loads from a qwen2 model directory: transformers' Qwen2Tokenizer.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    served = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(ID_TOKENS_FROM, 5000) for _ in range(rng.randrange(1, 200))]
        text = tokenizer.decode(ids)
        assert tokenizer.encode(text, add_special_tokens=False) == ids
        assert served.encode(text, add_special_tokens=False) == ids
    assert tokenizer.decode([ID_TOKENS_FROM, ID_TOKENS_FROM + 25, ID_TOKENS_FROM + 26]) == " a z aa"
    json_text = '{"name": "Paris", "population": 2102650}\n'
    assert tokenizer.decode(tokenizer.encode(json_text, add_special_tokens=False)) == json_text
    chat = [{"role": "user", "content": " ab"}, {"role": "assistant", "content": " cd"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == " ab cd"
    assert TokenizerInfo.from_hf(served, vocab_size=5000).vocab_type == "byte_level"


class _StandInServer:
    """An OpenAI completions endpoint that answers every prompt with three fixed tokens and
    reports a prefix cache's cached tokens in its usage."""

    def __init__(self, tokenizer: Any, reports_cache: bool) -> None:
        self.tokenizer = tokenizer
        self.reports_cache = reports_cache
        self.memory = _PrefixMemory()
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: Any) -> Any:
        import httpx

        if request.url.path == "/flush_cache":
            self.memory = _PrefixMemory()
            return httpx.Response(200, json={"success": True})
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = self.tokenizer.encode(body["prompt"], add_special_tokens=False)
        usage: dict[str, Any] = {"prompt_tokens": len(prompt)}
        cached = self.memory.cached(prompt)
        if self.reports_cache:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        text = self.tokenizer.decode([700, 701, 0][: body["max_tokens"]])
        return httpx.Response(200, json={"choices": [{"text": text}], "usage": usage})


@pytest.mark.parametrize("server", ["radixlm", "transformers"])
def test_http_system_sends_the_calls_as_completions_and_reads_usage(
    engine_bench: Any, tmp_path: Path, server: str
) -> None:
    import httpx
    from _common import id_tokenizer  # engine_bench put tools/bench on the path

    tokenizer = id_tokenizer(tmp_path, 2000)
    stand_in = _StandInServer(tokenizer, reports_cache=server == "radixlm")
    client = httpx.Client(base_url="http://stand-in", transport=httpx.MockTransport(stand_in))
    system = engine_bench.HttpSystem(server, "model-dir", tokenizer, client)
    assert system.name == f"{server}-serve"
    system.reset()
    calls = _calls(engine_bench)
    for call in calls:  # word ids, which the id tokenizer's text spells one to one
        call.prompt = [t + 300 for t in call.prompt]
    system.generate(calls)
    # n = 3 becomes three requests with their own seeds; outputs come back as token ids, the
    # EOS radixlm was told to ignore included.
    assert [len(c.outputs) for c in calls] == [1, 3, 1]
    assert calls[0].outputs == [[700, 701, 0]] and calls[1].outputs[2] == [700, 701]
    bodies = stand_in.bodies
    assert len(bodies) == 5
    assert sorted(b.get("seed", -1) for b in bodies) == [-1, -1, 15, 16, 17]
    assert all(tokenizer.encode(b["prompt"], add_special_tokens=False)[:40] == list(range(400, 440))
               for b in bodies)  # fmt: skip
    schema_sent = [b for b in bodies if "json_schema" in b]
    if server == "radixlm":
        assert len(schema_sent) == 1 and schema_sent[0]["max_tokens"] == 5
        assert all(b["skip_special_tokens"] is False for b in bodies)
        assert sum(b["ignore_eos"] for b in bodies) == 1
        # per request: 0 of 42, then 40 of 41 three times, then 40 of 41 (in any order, the
        # stand-in's cache sees the shared 40-token prefix after the first request).
        assert system.hit_rate() == pytest.approx(160 / 206, abs=2 / 206)
    else:
        assert not schema_sent and not any("ignore_eos" in b for b in bodies)
        assert system.hit_rate() != system.hit_rate()  # nan: transformers reports no cache
    system.close()


def _http_results(results: Path) -> None:
    rows = _rows({"radixlm-serve": 64.0, "transformers-serve": 16.0}, scale=0.25)
    for row in rows:
        if row["system"] == "radixlm-serve":
            row["hit_rate"] = 0.9
    (results / "http.json").write_text(json.dumps(rows))
    meta = json.loads((results / "meta.json").read_text())
    meta["http_command"] = "python tools/bench/engine_bench.py --http radixlm,transformers"
    meta["minutes"] = 12.5
    (results / "http_meta.json").write_text(json.dumps(meta))


def test_report_renders_the_http_part_after_the_report_and_keeps_it(
    report: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = _results(tmp_path, _rows({"radixlm": 100.0, "transformers": 8.0}))
    text = _render(report, results, tmp_path, monkeypatch)
    assert report.HTTP_START not in text  # no HTTP figures, no HTTP part
    _http_results(results)
    page, img = tmp_path / "benchmarks.md", tmp_path / "img"
    argv = ["report.py", "--http-only", "--from-json", str(results), "--page", str(page)]
    monkeypatch.setattr(sys, "argv", [*argv, "--img", str(img)])
    assert report.main() == 0
    text = page.read_text()
    report_part, http_part = text.split(report.END)
    assert "| few_shot | 6.25 (100.0) | 0.50 (8.0) | 12.50× |" in report_part
    assert http_part.index(report.HTTP_START) < http_part.index(report.HTTP_END)
    assert "| json | 4.00 (64.0) | 1.00 (16.0) | 4.00× | 90.0 % | 95.0 % |" in http_part
    assert "× 0.25" in http_part and "took 12.5 min" in http_part
    assert http_part.rstrip().endswith("kept below")
    # A full re-render redraws the report's plots and keeps (and refreshes) the HTTP part.
    assert _render_again(report, results, page, img, monkeypatch) == text
    assert (img / "http.png").stat().st_size > 5000


def _render_again(report: Any, results: Path, page: Path, img: Path, monkeypatch: Any) -> str:
    argv = ["report.py", "--from-json", str(results), "--page", str(page), "--img", str(img)]
    monkeypatch.setattr(sys, "argv", argv)
    assert report.main() == 0
    return page.read_text()


# --------------------------------------------------------- tools/bench/grammar_corpus_bench.py


@pytest.fixture(scope="module")
def corpus_bench() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("grammar_corpus_bench")
    finally:
        sys.path.remove(str(BENCH))


# Stand-in corpora: one schema every system compiles, one whose uniqueItems only auto enforces
# (llguidance refuses it, xgrammar and outlines-core let duplicates through), one that no
# system compiles.
PAIR = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
UNIQUE = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2,
          "uniqueItems": True}  # fmt: skip
BROKEN = {"type": "no such type"}


def _stand_in_corpora(tmp_path: Path) -> dict[str, Path]:
    folder = tmp_path / "real"
    folder.mkdir()
    (folder / "pair.json").write_text(json.dumps(PAIR))
    (folder / "unique.json").write_text(json.dumps(UNIQUE))
    (folder / "MANIFEST.json").write_text(json.dumps([{"file": "pair.json"}]))
    (folder / "half-written.json").write_text('{"type": ')
    listed = tmp_path / "keyword.json"
    listed.write_text(json.dumps([{"name": "broken", "keyword": "type", "schema": BROKEN},
                                  {"name": "pair", "schema": PAIR}]))  # fmt: skip
    return {"real": folder, "keyword": listed, "vendor": tmp_path / "not yet extracted"}


def test_corpora_load_from_folders_and_lists_and_note_what_is_missing(
    corpus_bench: Any, tmp_path: Path
) -> None:
    paths = _stand_in_corpora(tmp_path)
    real, notes = corpus_bench.load_corpus(paths["real"])
    assert [name for name, _ in real] == ["pair", "unique"]  # MANIFEST.json is not a schema
    assert len(notes) == 1 and notes[0].startswith("half-written.json: not JSON")
    listed, notes = corpus_bench.load_corpus(paths["keyword"])
    assert [name for name, _ in listed] == ["broken", "pair"] and not notes
    absent, notes = corpus_bench.load_corpus(paths["vendor"])
    assert absent == [] and notes[0].endswith("absent")
    assert [n for n, _ in corpus_bench.quick_pick(real + listed, 2)] == ["broken", "unique"]


def test_judge_checks_formats_and_refs_it_cannot_follow(corpus_bench: Any) -> None:
    ipv4 = corpus_bench.Judge({"type": "string", "format": "ipv4"})
    assert ipv4(b'"10.0.0.1"') == ("valid", "")
    assert ipv4(b'"01.20.13.062"')[0] == "invalid"
    assert ipv4(b'"\xff"')[1].startswith("not UTF-8")
    assert ipv4(b'"10.0.0.1"}')[1].startswith("not JSON")
    remote = corpus_bench.Judge({"$ref": "https://example.com/schema.json"})
    assert remote(b"1")[0] == "unverifiable"


class _ScriptedGrammar:
    """Allows every token of a three-token vocabulary (0 stops); after the second token it
    reports one violation (fatal when asked), then allows only the stop token."""

    def __init__(self, fatal: bool) -> None:
        from radixlm.constrained import Violation

        self.history: list[int] = []
        self.violations = [Violation("uniqueItems", "/1", "a repeat", rollback=1, fatal=fatal)]
        self.pending: Any = None

    def fill(self, bitmask: Any) -> None:
        bitmask[0] = 0b001 if len(self.history) >= 3 else 0b111

    def accept(self, token: int) -> bool:
        self.history.append(token)
        if len(self.history) == 2 and self.violations:
            self.pending = self.violations.pop()
        return True

    def error(self) -> None:
        return None

    def violation(self) -> Any:
        return self.pending

    def rollback(self, count: int) -> None:
        del self.history[len(self.history) - count :]
        self.pending = None


def test_walk_rolls_back_a_violation_and_ends_on_a_fatal_one(corpus_bench: Any) -> None:
    import random

    import torch
    from grammar_corpus_systems import Vocab, walk

    vocab = Vocab([None, b"a", b"b"], [0])
    bitmask = torch.zeros((1, 1), dtype=torch.int32)
    done = walk(_ScriptedGrammar(fatal=False), vocab, bitmask, random.Random(0), 50)
    assert done.outcome == "finished" and done.rollbacks == 1
    assert done.tokens == 4 and len(done.text) == 3  # three letters, then the stop token
    assert len(done.step_s) == 5  # the rolled-back token was sampled and timed too
    failed = walk(_ScriptedGrammar(fatal=True), vocab, bitmask, random.Random(0), 50)
    assert failed.outcome == "fatal" and failed.message == "a repeat" and failed.tokens == 2


def test_corpus_part_compares_raw_systems_with_auto(
    corpus_bench: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setattr(corpus_bench, "CORPORA", _stand_in_corpora(tmp_path))
    limits = corpus_bench.Limits(walks=3, later_walks=1, max_tokens=60)
    figures = corpus_bench.corpus_part(
        ["real", "keyword", "vendor"], [600, 700], limits, isolate=False
    )
    records = figures["records"]
    assert len(records) == 4 * 2 * 4  # 4 schemas in 2 corpora, 2 vocabularies, 4 systems
    got = {(r["schema"], r["system"]): r for r in records if r["vocab"] == 600}
    assert all(not got[("broken", s)]["compiled"] for s in corpus_bench.SYSTEMS)
    assert not got[("unique", "llguidance")]["compiled"]
    auto = got[("unique", "auto")]
    assert auto["compiled"] and auto["validated"] == ["uniqueItems"]
    assert {w["verdict"] for w in auto["walks"]} == {"valid"}
    assert {len(r["walks"]) for r in records if r["vocab"] == 700 and r["compiled"]} == {1}
    summary = figures["summary"]
    rows = {(r["corpus"], r["vocab"], r["system"]): r for r in summary["systems"]}
    first = rows[("real", 600, "auto")]
    assert first["compiled"] == 2 and first["walks"] == 6 and first["invalid"] == 0
    assert rows[("keyword", 600, "xgrammar")]["compiled_pct"] == 0.5
    (choices,) = [r for r in summary["auto"] if (r["corpus"], r["vocab"]) == ("real", 600)]
    assert choices["validated"] == 1 and choices["validated_keywords"] == {"uniqueItems": 1}
    assert sum(choices[f"served_{s}"] for s in corpus_bench.RAW) == 2
    goals = {(g["corpus"], g["vocab"]): g for g in summary["goals"]}
    assert goals[("real", 600)]["validity_met"] and goals[("real", 600)]["overhead_schemas"] == 2
    printed = capsys.readouterr().out
    assert "vendor: skipped" in printed and "## goals for auto" in printed
    assert "| real | 600 | auto | 2/2 (100%) |" in printed
    json.dumps(figures)  # what --json writes


def test_a_compile_past_the_time_limit_counts_as_not_compiled(corpus_bench: Any) -> None:
    from grammar_corpus_systems import Job, Worker

    schema = json.dumps({"type": "object", "properties": {f"k{i}": {"type": "string"}
                                                          for i in range(8)}})  # fmt: skip
    worker = Worker("outlines", 600)
    try:
        late = worker.run(Job(schema, corpus_bench.Limits(walks=1, compile_s=1e-4), False))
        assert late.get("timeout") and not late["compiled"], late  # (what came back instead)
        # The killed worker was replaced: the next schema compiles.
        again = worker.run(Job(schema, corpus_bench.Limits(walks=1, max_tokens=40), False))
        assert again["compiled"] and len(again["walks"]) == 1
    finally:
        worker.close()
