"""A live `python -m inference serve` subprocess for the server tests, the fixtures most of them
share, and raw HTTP helpers.

Imported by test_server*.py; tests/inference/conftest.py registers the fixtures below for every
inference test module. `tiny_server` is the tiny bundle served with default options, one process
for the whole session; `server` is it unless a module defines its own `server` (with `serving`),
and `client` talks to the requesting module's `server`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from test_engine_fixtures import tiny_bundle

REPO = Path(__file__).resolve().parents[2]
STARTUP_SECONDS = 120  # importing torch and transformers on a loaded 2-core CI machine
_LISTENING = re.compile(r"serving '([^']*)' on (http://\S+)")
MODEL = "tiny-moe"  # the name the shared `server` fixture serves under


class ServerProcess:
    """`python -m inference serve --bundle B --port 0 --local` (or another expert `source`, such as
    `--storaged SOCKET --storaged-model NAME`), its address read from its first line.

    `lines` collects its stdout and stderr (the log, access log included) as they come.
    """

    def __init__(self, bundle: Path, *extra: str, model_name: str = MODEL, env: dict | None = None,
                 healthy: bool = True, source: tuple[str, ...] = ("--local",)):
        command = [sys.executable, "-m", "inference", "serve", "--bundle", str(bundle), "--port", "0", *source,
                   "--dtype", "float32", "--torch-threads", "1", "--model-name", model_name, *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._address = threading.Event()
        self.base_url = ""
        threading.Thread(target=self._read_output, daemon=True).start()
        if not self._address.wait(STARTUP_SECONDS):
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        if healthy:
            self.wait_healthy()

    def _read_output(self) -> None:
        for line in self.process.stdout:  # drained to the end so the server never blocks on a full pipe
            self.lines.append(line)
            match = _LISTENING.search(line)
            if match and not self._address.is_set():
                self.base_url = match.group(2)
                self._address.set()

    def wait_healthy(self, timeout: float = STARTUP_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while get(self.base_url + "/health")[0] != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server never became healthy:\n" + "".join(self.lines))
            time.sleep(0.1)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@contextlib.contextmanager
def serving(bundle: Path, *extra: str, **options) -> Iterator[ServerProcess]:
    """A ServerProcess (ServerProcess's arguments) for the `with` block; on leaving it normally the
    server must stop on SIGINT with status 0 (a clean drain), on an error it is killed."""
    process = ServerProcess(bundle, *extra, **options)
    try:
        yield process
    except BaseException:
        process.kill()
        raise
    assert process.stop(signal.SIGINT) == 0, "".join(process.lines)


def openai_client(server, api_key: str = "unused", timeout: float = 120) -> openai.OpenAI:
    """The official client for `server` (anything with a `base_url`: a ServerProcess, an in-process
    server), without retries: a test sees each reply as the server sent it."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The tiny bundle served as MODEL with default options, shared by the modules that use it (a
    test reads its metrics as differences, never as totals)."""
    with serving(tiny_bundle(tmp_path_factory)) as process:
        yield process


@pytest.fixture(scope="module")
def server(tiny_server) -> ServerProcess:
    """The requesting module's server: tiny_server, unless the module defines its own `server`."""
    return tiny_server


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    """An openai client of the requesting module's `server` fixture (this one's or the module's own)."""
    with openai_client(server) as client:
        yield client


def request_with_headers(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
                         timeout: float = 60) -> tuple[int, dict | str, dict]:
    """(status, decoded JSON or text, response headers) of one HTTP request, error statuses included."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            status, raw, got = response.status, response.read(), response.headers
    except urllib.error.HTTPError as error:
        status, raw, got = error.code, error.read(), error.headers
    except (ConnectionError, urllib.error.URLError):
        return 0, "", {}
    text = raw.decode()
    content_type = got.get("Content-Type", "")
    return status, json.loads(text) if content_type.startswith("application/json") else text, dict(got.items())


def request(method: str, url: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, dict | str]:
    """(status, decoded JSON or text) of one HTTP request, error statuses included."""
    return request_with_headers(method, url, body, timeout=timeout)[:2]


def get(url: str) -> tuple[int, dict | str]:
    return request("GET", url)


def post(url: str, body) -> tuple[int, dict | str]:
    return request("POST", url, body if isinstance(body, bytes) else json.dumps(body).encode())


# A Qwen3-like chat template: renders tools, tool calls and tool results, reads enable_thinking and
# reasoning_effort; what the server's field tests need a template to honour.
RICH_CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- if reasoning_effort is defined %}<|im_start|>system
Reasoning: {{ reasoning_effort }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls is defined %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", \
"arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}{% if not (loop.last and continue_final_message) %}<|im_end|>
{% endif %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def rich_bundle(tmp_path_factory, generation_config: dict) -> Path:
    """The tiny bundle with RICH_CHAT_TEMPLATE and these generation_config.json sampling defaults."""
    source = tiny_bundle(tmp_path_factory)
    bundle = tmp_path_factory.mktemp("rich-bundle") / "bundle"
    shutil.copytree(source, bundle)
    (bundle / "chat_template.jinja").write_text(RICH_CHAT_TEMPLATE)
    config = json.loads((bundle / "generation_config.json").read_text())
    (bundle / "generation_config.json").write_text(json.dumps({**config, **generation_config}, indent=2))
    return bundle


def access_lines(lines: list[str]) -> list[str]:
    """The access log lines among a server's output lines (text or JSON format)."""
    return [line for line in lines if " inference.access: " in line or '"logger": "inference.access"' in line]


def settled_access_count(lines: list[str], quiet: float = 0.3, timeout: float = 10.0) -> int:
    """How many access lines a server has written once none arrived for `quiet` seconds: an earlier
    test's last lines may still be on their way to the reader thread."""
    count, since, deadline = len(access_lines(lines)), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.05)
        now = len(access_lines(lines))
        if now != count:
            count, since = now, time.monotonic()
    return count


_SERIES = re.compile(r'^(\w+)(?:\{(.*)\})?$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(values: dict[str, float] | str, name: str, **labels: str) -> float:
    """The sum of the series called `name` whose labels include `labels` (0 when there is none);
    `values` is metric_values' dict or the exposition text itself."""
    if isinstance(values, str):
        values = metric_values(values)
    total = 0.0
    for key, value in values.items():
        match = _SERIES.match(key)
        if match and match.group(1) == name:
            have = dict(_LABEL.findall(match.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += value
    return total


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
