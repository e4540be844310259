"""`vfleet bench run` and `vfleet bench compare`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from vfleet.errors import VfleetError
from vfleet.fleet.status import base_url
from vfleet.fleet.targets import HostTarget, resolve
from vfleet.measure import report
from vfleet.measure.baseline import baseline_from, save
from vfleet.measure.client import Client
from vfleet.measure.prompts import PromptBuilder, vllm_counter
from vfleet.measure.scenarios import Bench, Metrics, Settings
from vfleet.measure.server import Unreachable, served_model, server_version
from vfleet.measure.stats import compare
from vfleet.paths import DEFAULT_INVENTORY

SCENARIO_NAMES = ("context", "decode", "prefill", "concurrency")

DESCRIPTION = """\
Measure one vLLM server the way the seed write-ups did, and keep the result as JSON, a markdown
table and PNG plots. Only the server is contacted: its /v1/models, /version, /tokenize,
/metrics and the OpenAI endpoints (with --host, also the host itself, over ssh as `vfleet
doctor` does, for its facts: OS, CPU, memory, GPUs and driver, which go into the result with
the release). Run it while nothing else uses the server: MTP acceptance comes from the
server-wide /metrics counters.

Scenarios (--scenario, comma-separated; default context,decode,prefill):
  context      per context length (--lengths) a cold request, whose random first line means
               nothing can come from the prefix cache, then a warm one (the same prompt again),
               each generating --decode-tokens. Shows TTFT cold vs warm, prefill and decode
               speed and MTP acceptance as the context grows (seed 001's table).
  decode       long generations (--decode-tokens, default 800) from a short prompt: decode
               tok/s over the tokens after the first, and acceptance. Short outputs would
               measure mostly the first token; ~800-1000 tokens make decode speed stable.
  prefill      cold prompts of --prefill-lengths with 1 output token; fits
               TTFT = fixed + N / rate by least squares (R² says how well a line explains it),
               dropping the first run (seed 004): the rate without the fixed per-request cost.
  concurrency  --concurrency simultaneous requests (1,2,4): aggregate generated tok/s, and
               what each stream still gets.

Method: temperature 0, thinking off (chat_template_kwargs enable_thinking=false; a hidden
thinking phase would distort both TTFT and decode), streamed, timed on the client. A warm-up
request first, so kernels compiled on first use are not measured. Lengths that do not fit
max_model_len - output tokens - margin are replaced by the largest that does.
"""

RUN_EPILOG = """\
every run is bounded: --time-limit (default 1800 s) and --max-requests; when one is reached
the benchmark stops between runs and the result says so ("stopped").

output (--out DIR): result.json (every run, the summaries, the prefill fit, the server's
vLLM version and model, the parameters, --release-json embedded), result.md (the tables, also
printed), context.png and prefill.png.

exit status: 0 measured (also when stopped by a limit), 1 some runs failed or the server
could not be reached, 2 bad input.

examples:
  vfleet bench run --url http://127.0.0.1:8000 --model qwen3.6-27b
  vfleet bench run --url :8000 --scenario decode --decode-tokens 1000 --repeats 5
  vfleet bench run --url :8000 --lengths 0,1K,32K,128K --release-json \\
      ~/.local/share/vfleet/instances/main/current/release.json --out bench/fp8-kv
  vfleet bench run --host gpu1 -i my-inventory.yml --save-baseline mine.yaml
  vfleet bench compare bench/fp16-kv/result.json bench/fp8-kv/result.json
"""

COMPARE_EPILOG = """\
each figure measured in both results (same scenario and size) is compared as the ratio of the
means B/A. "better"/"worse" only when the change exceeds the noise: the larger relative spread
(max-min)/mean of either side's repeats (and --min-noise); "within noise" otherwise; "no
repeats" when neither side repeated it (run with --repeats 3 to know). Lower is better for
times (*_s), higher for speeds and acceptance.

the noise comes from the repeats inside each result; drift between two runs (other load on
the machine, clocks, temperature) is not in it. Compare a setup with itself once (A/A): the
largest change it shows is the drift, pass it as --min-noise. On a shared 2-core CPU machine
an A/A run of the tiny model differed by up to 30 % in decode speed with 2 repeats each.

example:
  vfleet bench compare before/result.json after/result.json --min-noise 0.02
"""


# --------------------------------------------------------------------------- input


def parse_sizes(text: str, option: str, *, minimum: int = 0) -> tuple[int, ...]:
    """'0,1K,32k,131072' -> (0, 1024, 32768, 131072); K = 1024 tokens."""
    out: list[int] = []
    for part in text.split(","):
        item = part.strip()
        scale = 1024 if item[-1:].lower() == "k" else 1
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) * scale < minimum:
            raise VfleetError(
                f"{item!r} is not a whole number of at least {minimum}",
                key=option,
                fix=f"a comma-separated list such as {option} 0,1K,8K,32K (K = 1024)",
            )
        out.append(int(digits) * scale)
    return tuple(sorted(set(out)))


def parse_scenarios(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in SCENARIO_NAMES]
    if bad or not names:
        raise VfleetError(
            f"unknown scenario {', '.join(bad) or '(none)'}",
            key="--scenario",
            fix=f"one or more of {','.join(SCENARIO_NAMES)}",
        )
    return names


def _positive(value: float, option: str, example: str) -> None:
    if not value > 0:
        raise VfleetError(f"must be positive, got {value:g}", key=option, fix=f"e.g. {example}")


def _release(path: Path) -> Any:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise VfleetError(
            f"cannot read it: {exc.strerror or exc}",
            where=str(path),
            key="--release-json",
            fix="the release.json of a deployed release (instances/NAME/current/release.json)",
        ) from None
    except ValueError as exc:
        raise VfleetError(
            f"not JSON: {exc}", where=str(path), key="--release-json", fix="pass release.json"
        ) from None
    if not isinstance(data, dict):
        raise VfleetError("not a JSON object", where=str(path), key="--release-json")
    return data


# --------------------------------------------------------------------------- progress


class Bar:
    """A one-line text bar on stderr; silent unless stderr is a terminal."""

    def __init__(self, stream: TextIO, enabled: bool, width: int = 30) -> None:
        self.stream = stream
        self.enabled = enabled
        self.width = width
        self.t0 = time.monotonic()

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        filled = self.width * done // total if total else self.width
        elapsed = int(time.monotonic() - self.t0)
        line = (
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} requests "
            f"{elapsed // 60}m{elapsed % 60:02d}s  {label}"
        )
        self.stream.write(line.ljust(100)[:100] + ("\n" if label == "done" else ""))
        self.stream.flush()


# --------------------------------------------------------------------------- parser


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark a vLLM server: TTFT cold/warm, prefill, decode, MTP acceptance",
        description=DESCRIPTION,
        epilog="run `vfleet bench run --help` for the options and examples",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bsub = p.add_subparsers(dest="bench_command", metavar="ACTION", required=True)
    r = bsub.add_parser(
        "run",
        help="measure a server and write result.json, result.md and plots",
        description=DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = r.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="vLLM base URL or HOST:PORT, e.g. :8000")
    where.add_argument(
        "--host",
        help="an inventory host: its instance's URL (through an ssh tunnel when vLLM listens "
        "on the host's loopback) and release manifest, found as `vfleet doctor HOST` finds them",
    )
    inv = r.add_argument_group("with --host (as `vfleet doctor`: else the host's vfleet_* vars)")
    inv.add_argument("-i", "--inventory", default=str(DEFAULT_INVENTORY), help="inventory")
    inv.add_argument("--instance", help="instance name (default: main)")
    inv.add_argument("--profile", help="hardware profile")
    inv.add_argument("--preset", help="model preset")
    inv.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE", help="setting")
    inv.add_argument("--base-dir", help="vfleet's folder on the host")
    r.add_argument(
        "--model", metavar="NAME", help="served model name (default: the only one the server lists)"
    )
    r.add_argument(
        "--scenario",
        metavar="NAMES",
        default="context,decode,prefill",
        help="comma-separated: context,decode,prefill,concurrency (default: %(default)s)",
    )
    r.add_argument(
        "--lengths",
        metavar="SIZES",
        default="0,1K,8K,32K,128K",
        help="context sweep prompt sizes in tokens, K = 1024 (default: %(default)s)",
    )
    r.add_argument(
        "--prefill-lengths",
        metavar="SIZES",
        default="2K,4K,8K,16K,32K",
        help="prefill sweep prompt sizes (default: %(default)s)",
    )
    r.add_argument(
        "--concurrency",
        metavar="N,N",
        default="1,2,4",
        help="simultaneous requests for the concurrency scenario (default: %(default)s)",
    )
    r.add_argument(
        "--concurrency-context",
        metavar="SIZE",
        default="1K",
        help="prompt size of each concurrent request (default: %(default)s)",
    )
    r.add_argument(
        "--decode-tokens",
        metavar="N",
        type=int,
        default=800,
        help="output tokens of context, decode and concurrency runs (default: %(default)s)",
    )
    r.add_argument(
        "--repeats", type=int, default=3, metavar="N", help="runs per size (default: %(default)s)"
    )
    r.add_argument(
        "--out", type=Path, metavar="DIR", help="result folder (default: ./bench-<UTC time>)"
    )
    r.add_argument(
        "--time-limit",
        type=float,
        default=1800.0,
        metavar="S",
        help="stop after S seconds in all (default: %(default)g)",
    )
    r.add_argument(
        "--max-requests",
        type=int,
        default=1000,
        metavar="N",
        help="stop after N requests (default: 1000)",
    )
    r.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="limit for one request (default: %(default)g)",
    )
    r.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="cap sizes at this context when /v1/models does not say (vLLM does)",
    )
    r.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions (default) or /v1/completions (raw prompt, no template)",
    )
    r.add_argument("--thinking", action="store_true", help="leave thinking on (default: off)")
    r.add_argument(
        "--ignore-eos",
        action="store_true",
        help="always generate --decode-tokens (vLLM's ignore_eos), even past the answer's end",
    )
    r.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of the random prompt prefixes"
    )
    r.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    r.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    r.add_argument(
        "--release-json",
        type=Path,
        metavar="FILE",
        help="a deployed release.json to embed (what was measured: versions, arguments)",
    )
    r.add_argument(
        "--save-baseline",
        type=Path,
        metavar="FILE",
        help="also save the decode, acceptance and prefill figures as the baseline of the "
        "deployment named by --release-json (e.g. profiles/baselines/local/PROFILE--MODEL.yaml: "
        "the decode-below-baseline alert and `vfleet status` then use it)",
    )
    r.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="send the API key held in environment variable VAR (vLLM --api-key)",
    )
    r.add_argument("--json", action="store_true", help="print result.json instead of the table")
    r.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    r.set_defaults(fn=cmd_run)

    c = bsub.add_parser(
        "compare",
        help="compare two results: ratio per figure and whether it exceeds the noise",
        description="Compare two `vfleet bench run` results (A = before, B = after).",
        epilog=COMPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("a", type=Path, metavar="A.json")
    c.add_argument("b", type=Path, metavar="B.json")
    c.add_argument(
        "--min-noise",
        type=float,
        default=0.0,
        help="smallest relative change that counts, e.g. 0.02 (default: 0)",
    )
    c.add_argument("--json", action="store_true", help="a JSON list, one object per figure")
    c.set_defaults(fn=cmd_compare)


# --------------------------------------------------------------------------- run


def cmd_run(a: argparse.Namespace) -> int:
    if a.host is None:
        return _run(a, None)

    doctor_args = argparse.Namespace(
        host=a.host,
        inventory=a.inventory,
        instance=a.instance,
        profile=a.profile,
        model=a.preset,
        sets=a.sets,
        base_dir=a.base_dir,
        deployment=None,
        profiles_dir=None,
    )
    target = resolve(doctor_args)
    print(f"bench: {target.source}: {target.url}", file=sys.stderr)
    try:
        return _run(a, target)
    finally:
        target.close()


def _run(a: argparse.Namespace, target: HostTarget | None) -> int:
    if a.save_baseline and not (a.release_json or target):
        raise VfleetError(
            "a baseline must name the deployment it was measured on",
            key="--save-baseline",
            fix="add --release-json <base>/instances/<instance>/current/release.json",
        )
    try:  # the sidecar's parser and window; `make venv` installs them, a bare vfleet does not
        from vfleet_healthcheck.vllm_metrics import (
            DEFAULT_VERSION,
            UnsupportedVersion,
            families,
            table_version,
        )

    except ImportError as exc:
        raise VfleetError(
            f"needs the vfleet-healthcheck package: {exc}",
            where="vfleet bench",
            fix="pip install -e ./healthcheck (`make venv` does)",
        ) from None

    try:
        url = target.url if target else base_url(a.url)
    except ValueError as exc:
        raise VfleetError(
            str(exc), key="--url", fix="a vLLM base URL such as http://127.0.0.1:8000, or :8000"
        ) from None
    settings = Settings(
        scenarios=parse_scenarios(a.scenario),
        lengths=parse_sizes(a.lengths, "--lengths"),
        prefill_lengths=parse_sizes(a.prefill_lengths, "--prefill-lengths", minimum=1),
        concurrency=parse_sizes(a.concurrency, "--concurrency", minimum=1),
        concurrency_context=parse_sizes(a.concurrency_context, "--concurrency-context")[0],
        decode_tokens=a.decode_tokens,
        repeats=a.repeats,
        time_limit_s=a.time_limit,
        max_requests=a.max_requests,
        request_timeout_s=a.request_timeout,
        seed=a.seed,
        endpoint=a.endpoint,
        enable_thinking=a.thinking,
        ignore_eos=a.ignore_eos,
        warmup=not a.no_warmup,
    )
    for value, option, example in (
        (a.decode_tokens, "--decode-tokens", "--decode-tokens 800"),
        (a.repeats, "--repeats", "--repeats 3"),
        (a.time_limit, "--time-limit", "--time-limit 1800"),
        (a.max_requests, "--max-requests", "--max-requests 1000"),
        (a.request_timeout, "--request-timeout", "--request-timeout 600"),
    ):
        _positive(value, option, example)
    if a.decode_tokens < 2:
        raise VfleetError("decode speed needs 2 tokens or more", key="--decode-tokens")
    release = _release(a.release_json) if a.release_json else None
    if target is not None and release is None:
        release = target.release
    api_key = None
    if a.api_key_env:
        api_key = os.environ.get(a.api_key_env)
        if not api_key:
            raise VfleetError(
                f"environment variable {a.api_key_env} is empty or unset",
                key="--api-key-env",
                fix=f"export {a.api_key_env}=... (the key vLLM was started with)",
            )
    out_dir: Path = a.out or Path(f"bench-{datetime.now(UTC):%Y%m%d-%H%M%S}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise VfleetError(
            "exists and is not an empty folder", where=str(out_dir), fix="pass a new --out DIR"
        )

    client = Client(url, timeout=a.request_timeout, api_key=api_key)
    model, max_model_len = served_model(client, a.model, a.max_model_len)
    version = server_version(client)
    warnings: list[str] = []
    metrics: Metrics | None = None
    table_name: str | None = None
    try:
        table_name = table_version(version or DEFAULT_VERSION)
        metrics = Metrics(url, families(version or DEFAULT_VERSION))
    except UnsupportedVersion as exc:
        warnings.append(f"no MTP figures: {exc}")
    if version is None:
        warnings.append(f"vLLM version unknown (no /version): metric names of {DEFAULT_VERSION}")
    if max_model_len is None:
        warnings.append("max_model_len unknown: sizes not capped (pass --max-model-len)")
    counter = vllm_counter(client, model)
    builder = PromptBuilder(counter)
    bar = Bar(sys.stderr, sys.stderr.isatty() and not a.quiet)
    started = time.time()
    bench = Bench(
        client,
        model,
        settings,
        builder,
        metrics=metrics,
        max_model_len=max_model_len,
        progress=bar,
    )
    outcome = bench.run()
    outcome.warnings[:0] = warnings
    doc = report.document(
        url=url,
        model=model,
        vllm_version=version,
        max_model_len=max_model_len,
        metrics_table=table_name,
        settings=settings,
        outcome=outcome,
        started_at=started,
        finished_at=time.time(),
        token_counting="vLLM /tokenize" if counter else "estimated (no /tokenize)",
        deployment=release,
        host_facts=target.host if target else None,
        deployment_source=str(a.release_json)
        if a.release_json
        else (target.source if target else None),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    text = report.markdown(doc)
    (out_dir / "result.md").write_text(text, encoding="utf-8")
    written = [out_dir / "result.json", out_dir / "result.md"]
    if not a.no_plots:
        try:
            written += report.plot(doc, out_dir)
        except ImportError as exc:
            print(f"no plots: {exc} (pip install matplotlib)", file=sys.stderr)
    print(json.dumps(doc, indent=2) if a.json else text, end="" if not a.json else "\n")
    if a.save_baseline:
        save(baseline_from(doc), a.save_baseline)
        written.append(a.save_baseline)
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    if not outcome.runs and outcome.stopped:
        raise Unreachable(outcome.stopped, where=url)
    return 1 if any(r.error for r in outcome.runs) else 0


def cmd_compare(a: argparse.Namespace) -> int:

    docs = []
    for path in (a.a, a.b):
        try:
            docs.append(report.load_document(path))
        except ValueError as exc:
            raise VfleetError(
                str(exc), where=str(path), fix="pass result.json files written by vfleet bench run"
            ) from None
    if not 0 <= a.min_noise < 1:
        raise VfleetError(
            f"must be within 0..1, got {a.min_noise:g}", key="--min-noise", fix="e.g. 0.02"
        )
    rows = compare(report.metric_samples(docs[0]), report.metric_samples(docs[1]), a.min_noise)
    if a.json:
        objs = [{**asdict(c), "verdict": c.verdict} for c in rows]
        print(json.dumps(objs, indent=2))
    else:
        print(report.compare_markdown(str(a.a), str(a.b), rows), end="")
    return 0
