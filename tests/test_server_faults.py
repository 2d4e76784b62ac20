"""The server under faults, overload and shutdown, as an operator meets them: a real `python -m minivllm.server`
process (the tiny random model, loopback only), with faults injected by monkeypatching the engine before `main`.

Each test prints the figures it measures (time from engine death to every client answered and to process exit,
answers under 10x overload, a SIGTERM with 16 streams in flight, /health during an 8 MB prompt). Bounds on time
are generous: they catch a hang, not a slow machine.
"""
import asyncio, json, os, selectors, signal, socket, subprocess, sys, tempfile, time
from pathlib import Path

import httpx
import pytest

from minivllm.utils import free_port

ROOT = Path(__file__).resolve().parent.parent

# Injected faults, run in the server process before main. A request whose prompt starts with a marker is marked
# when the engine adds it; the fault fires on the next step.
MARK = """
marked = {}
orig_add = engine.LLMEngine.add_request
def add_request(self, prompt, params=None, request_id=None):
    rid = orig_add(self, prompt, params, request_id)
    text = self.tokenizer.decode(list(prompt)[:3])
    if text in ("DIE", "!!!"):
        marked[rid] = text
    return rid
engine.LLMEngine.add_request = add_request
"""
STEP_RAISES = MARK + """
orig_step = engine.LLMEngine.step
def step(self):
    if "DIE" in marked.values():
        raise RuntimeError("injected: the engine step failed")
    return orig_step(self)
engine.LLMEngine.step = step
"""
LOOP_RAISES = MARK + """
orig_stats = engine.LLMEngine.stats
def stats(self):
    if "DIE" in marked.values():
        raise RuntimeError("injected: the engine loop failed outside a step")
    return orig_stats(self)
engine.LLMEngine.stats = stats
"""
SLOW_STEPS = """
import time
orig_step = engine.LLMEngine.step
def step(self):
    time.sleep(0.01)  # 480 steps take 5 s or more, whatever the CPU: streams still run when the drain ends
    return orig_step(self)
engine.LLMEngine.step = step
"""
NAN_LOGITS = MARK + """
orig_hidden = engine.ModelRunner.sample_hidden  # before the head: the logits, or a greedy head's arg-max
def sample_hidden(self, batch, feed=None):
    hidden = orig_hidden(self, batch, feed).clone()  # [S, hidden]
    for row, seq in enumerate(batch.sampling):
        if marked.get(seq.request_id) == "!!!":
            hidden[row] = float("nan")
    return hidden
engine.ModelRunner.sample_hidden = sample_hidden
"""


class ServerProcess:
    "`python -c` that applies `patch`, then runs the server's main on a free loopback port."

    def __init__(self, folder: Path, *flags: str, patch: str = "", startup: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.NamedTemporaryFile("w", suffix=".log", delete=False).name)
        code = "import sys\nfrom minivllm import engine, server\n" + patch + "\nserver.main(sys.argv[1:])"
        args = ["--model", str(folder), "--port", str(self.port), "--host", "127.0.0.1", "--block-size", "4",
                "--num-gpu-blocks-override", "1024", "--uvicorn-log-level", "warning", *flags]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, env=env)
        t0 = time.monotonic()
        while time.monotonic() - t0 < startup:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.proc.kill()
        pytest.fail("server did not start:\n" + self.log.read_text())

    def wait_exit(self, timeout: float) -> float | None:
        "Seconds until the process exited (None if it still runs after `timeout`)."
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                return time.monotonic() - t0
            time.sleep(0.02)
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def serve(tiny_folder):
    started = []

    def start(*flags, patch=""):
        started.append(ServerProcess(tiny_folder, *flags, patch=patch))
        return started[-1]

    yield start
    for s in started:
        s.close()


async def _request(c: httpx.AsyncClient, body: dict, stream: bool, path="/v1/completions") -> tuple:
    "(status, last SSE line or the error code, seconds) of one request; status 'hang' past the client's timeout."
    t0 = time.monotonic()
    try:
        if not stream:
            r = await c.post(path, json=body)
            code = r.json()["error"]["code"] if r.status_code != 200 else None
            return r.status_code, code, time.monotonic() - t0
        async with c.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())["error"]["code"], time.monotonic() - t0
            lines = [line async for line in r.aiter_lines() if line]
        errors = [json.loads(l[6:])["error"]["code"] for l in lines if l.startswith('data: {"error"')]
        return r.status_code, (errors[0] if errors else None, lines[-1] if lines else None), time.monotonic() - t0
    except httpx.TimeoutException:
        return "hang", None, time.monotonic() - t0


def _events_ok(last) -> bool:
    return last[1] == "data: [DONE]"


LONG = {"prompt": "a long one", "max_tokens": 480, "ignore_eos": True}


async def _wait_running(url: str, n: int, timeout: float = 30) -> None:
    "Until the engine runs n requests (from /metrics)."
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=5) as c:
        while time.monotonic() - t0 < timeout:
            text = (await c.get("/metrics")).text
            line = next(l for l in text.splitlines() if l.startswith("vllm:num_requests_running"))
            if float(line.split()[-1]) >= n:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{n} requests never ran")


# --- engine death ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["step raises", "loop raises outside a step"])
def test_engine_death_answers_everyone_and_exits(serve, fault):
    srv = serve(patch=STEP_RAISES if fault == "step raises" else LOOP_RAISES)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=30, limits=httpx.Limits(max_connections=64)) as c:
            clients = [asyncio.create_task(_request(c, LONG, stream=i % 2 == 0)) for i in range(8)]
            await _wait_running(srv.url, 8)
            t_death = time.monotonic()
            doom = asyncio.create_task(_request(c, {"prompt": "DIE now", "max_tokens": 5}, stream=False))
            answers = await asyncio.gather(*clients, doom)
            answered = time.monotonic() - t_death
            try:
                late = (await c.post("/v1/completions", json={"prompt": "hi"})).status_code
            except httpx.TransportError:
                late = "refused"  # the process had already gone
            return answers, answered, late, t_death

    answers, answered, late, t_death = asyncio.run(main())
    exited = srv.wait_exit(30)
    exit_after = time.monotonic() - t_death
    print(f"\n{fault}: every client answered {answered * 1000:.0f} ms after the fault; process exited with "
          f"status {srv.proc.returncode} {exit_after:.2f} s after it; a new request got {late}")
    streams, whole = answers[0:8:2], [*answers[1:8:2], answers[8]]
    assert all(a[0] == 200 and a[1] == ("engine_dead", "data: [DONE]") for a in streams), streams
    assert all(a[:2] == (500, "engine_dead") for a in whole), whole
    assert late in (503, "refused")
    assert exited is not None and srv.proc.returncode == 1, srv.log.read_text()[-3000:]
    assert "the engine thread died" in srv.log.read_text()


def test_an_error_of_one_request_fails_that_request_only(serve):
    "Non-finite logits for the requests whose prompt starts with '!!!': they get a 500 / an error event; the rest run."
    srv = serve(patch=NAN_LOGITS)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            ok = [_request(c, {"prompt": f"fine {i}", "max_tokens": 30, "ignore_eos": True}, i % 2 == 0) for i in range(6)]
            bad = [_request(c, {"prompt": "!!! poisoned", "max_tokens": 30}, s) for s in (False, True)]
            return await asyncio.gather(*ok, *bad)

    answers = asyncio.run(main())
    fine, (bad_whole, bad_stream) = answers[:6], answers[6:]
    print(f"\nfailed alone: {bad_whole[:2]}, stream {bad_stream[:2]}; the 6 others: {sorted({a[0] for a in fine})}")
    assert [a[0] for a in fine] == [200] * 6 and all(a[1] is None or a[1][0] is None for a in fine), fine
    assert bad_whole[:2] == (500, "generation_failed"), bad_whole
    assert bad_stream[0] == 200 and bad_stream[1] == ("generation_failed", "data: [DONE]"), bad_stream
    assert httpx.get(srv.url + "/health").status_code == 200 and srv.proc.poll() is None


# --- overload ----------------------------------------------------------------------------------------------
def _burst(port: int, n: int, body: dict, timeout: float = 60) -> list[tuple]:
    """`n` requests on raw sockets, connected first, then sent at once: (status, seconds from its send to its status
    line, Retry-After) each; status 'hang' if none came within `timeout`. Raw sockets keep the client's own work out
    of the figures."""
    data = json.dumps(body).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    socks = [socket.create_connection(("127.0.0.1", port), timeout=timeout) for _ in range(n)]
    sel, sent, out = selectors.DefaultSelector(), {}, {}
    for s in socks:
        sent[s] = time.monotonic()
        s.sendall(req)
        sel.register(s, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            s, got = key.fileobj, time.monotonic()
            head = s.recv(4096)
            retry = next((l.split(b":")[1].strip().decode() for l in head.split(b"\r\n")
                          if l.lower().startswith(b"retry-after")), None)
            out[s] = (int(head[9:12]) if head else "closed", got - sent[s], retry)
            sel.unregister(s)
    for s in socks:
        s.close()
    return [out.get(s, ("hang", timeout, None)) for s in socks]


def test_overload_at_10x_capacity_is_shed_at_once(serve):
    """A queue of 8 sequences and 80 requests at once (10x): 8 are served, the others get a 503 with Retry-After;
    no 500, no hang. Then, with the queue full, a client arriving alone gets its 503 at once."""
    srv = serve("--max-num-seqs", "2", "--max-num-queued-reqs", "8")
    burst = _burst(srv.port, 80, {"prompt": "busy", "max_tokens": 64, "ignore_eos": True})

    async def alone():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60, limits=httpx.Limits(max_connections=100)) as c:
            full = [asyncio.create_task(_request(c, {**LONG, "max_tokens": 200}, stream=i % 2 == 0)) for i in range(8)]
            await _wait_running(srv.url, 2)
            one = [await _request(c, {"prompt": "me too"}, stream=False) for _ in range(20)]
            return one, await asyncio.gather(*full)

    one, full = asyncio.run(alone())
    shed = sorted(t for s, t, _ in burst if s == 503)
    served = sorted(t for s, t, _ in burst if s == 200)
    times = sorted(t for _, _, t in one)
    print(f"\n80 requests at once vs a queue of 8: {len(served)} served (slowest {served[-1]:.2f} s), {len(shed)} "
          f"shed with 503 (median {shed[len(shed) // 2] * 1000:.0f} ms, slowest {shed[-1] * 1000:.0f} ms); a client "
          f"alone at a full queue: 503 in {times[10] * 1000:.1f} ms (median of 20), {times[-1] * 1000:.1f} ms (slowest)")
    assert {s for s, _, _ in burst} == {200, 503} and len(served) == 8, burst
    assert {r for s, _, r in burst if s == 503} == {"1"}
    assert [(s, code) for s, code, _ in one] == [(503, "overloaded")] * 20 and times[-1] < 2.0  # a hang guard
    assert [s for s, _, _ in full] == [200] * 8
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200  # every place in the queue came back
    # a single request larger than the whole queue is a 400: retrying cannot help
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": ["hi"] * 5000, "n": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_503_carries_retry_after(serve):
    srv = serve("--max-num-seqs", "1", "--max-num-queued-reqs", "1")

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            first = asyncio.create_task(c.post("/v1/completions", json={**LONG, "max_tokens": 200}))
            await _wait_running(srv.url, 1)
            second = await c.post("/v1/completions", json={"prompt": "me too"})
            await first
            return second

    r = asyncio.run(main())
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "server_error"


# --- the event loop stays free -----------------------------------------------------------------------------
def test_health_stays_fast_during_an_8mb_prompt(serve):
    "A process of its own sends the large bodies, so that the probe's figures are the server's, not the sender's."
    srv = serve()
    sender = f"""
import httpx, json
bodies = [("/v1/completions", {{"prompt": "x" * (8_000_000 - 200)}}),
          ("/v1/chat/completions", {{"messages": [{{"role": "user", "content": "word " * 1_500_000}}]}}),
          ("/tokenize", {{"prompt": "y" * 7_000_000}})]
for path, body in bodies:
    r = httpx.post("{srv.url}" + path, content=json.dumps(body).encode(), timeout=60,
                   headers={{"Content-Type": "application/json"}})
    print(r.status_code, r.json()["error"]["code"])
"""
    proc = subprocess.Popen([sys.executable, "-c", sender], stdout=subprocess.PIPE, text=True)
    lat = []
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        while proc.poll() is None or len(lat) < 5:
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            lat.append(time.monotonic() - t0)
            time.sleep(0.005)
    out = proc.communicate(timeout=60)[0].split("\n")
    print(f"\n/health during an 8 MB prompt, a 7.5 MB chat and a 7 MB /tokenize, one after the other: {len(lat)} "
          f"probes, median {sorted(lat)[len(lat) // 2] * 1000:.1f} ms, slowest {max(lat) * 1000:.1f} ms; answers {out[:3]}")
    assert out[:3] == ["400 context_length_exceeded"] * 3
    assert max(lat) < 2.0  # a hang guard only: the figure is printed above


def _raw(port: int, head: bytes, timeout: float = 10) -> tuple[bytes, float]:
    "Send `head` on a raw socket and read what comes back until the server closes (or `timeout`)."
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        t0 = time.monotonic()
        s.sendall(head)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data and b"}" in data:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
        return data, time.monotonic() - t0


def test_oversized_content_length_is_refused_before_the_body(serve):
    srv = serve()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {100 << 20}\r\n\r\n").encode()
    data, took = _raw(srv.port, head)   # no body sent at all
    print(f"\n100 MB Content-Length: answered in {took * 1000:.0f} ms without a byte of body")
    assert data.startswith(b"HTTP/1.1 413") and b"request_too_large" in data


def test_a_trickling_body_is_timed_out(serve):
    srv = serve("--request-body-timeout", "1")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n")
        t0, data = time.monotonic(), b""
        for _ in range(40):   # one byte every 0.1 s: 4 s if the server waited for the whole body
            try:
                s.sendall(b" ")
                s.settimeout(0.1)
                data += s.recv(65536)
                if data:
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        took = time.monotonic() - t0
    print(f"\nbody at 10 bytes/s: {data[:12]!r} after {took:.2f} s")
    assert data.startswith(b"HTTP/1.1 408") and took < 3.9


def test_connections_are_bounded(serve):
    "With --limit-concurrency 10, 30 clients that send their bodies slowly: those beyond the limit get a 503 at once."
    srv = serve("--limit-concurrency", "10", "--request-body-timeout", "5")
    socks, answers = [], []
    try:
        for _ in range(30):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            socks.append(s)
            time.sleep(0.05)
        for s in socks:
            s.settimeout(0.05)
            try:
                answers.append(s.recv(100)[:12])
            except TimeoutError:
                answers.append(b"(waiting)")
    finally:
        for s in socks:
            s.close()
    refused = sum(a.startswith(b"HTTP/1.1 503") for a in answers)
    held = answers.count(b"(waiting)")
    print(f"\n30 slow connections, limit 10: {refused} refused at once, {held} held")
    assert refused >= 15 and 1 <= held <= 10 and refused + held == 30
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_a_body_that_is_not_json_gets_415(serve):
    srv = serve()
    r = httpx.post(srv.url + "/v1/completions", content=b"prompt=hi",
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


# --- shutdown ----------------------------------------------------------------------------------------------
def test_sigterm_with_16_streams_in_flight(serve):
    "Draining: health 503, new requests 503, short requests finish, long streams end with an error event + [DONE]."
    srv = serve("--shutdown-timeout", "2", patch=SLOW_STEPS)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            long = [asyncio.create_task(_request(c, LONG, stream=True)) for _ in range(16)]
            await _wait_running(srv.url, 16)
            short = asyncio.create_task(_request(c, {"prompt": "quick", "max_tokens": 3}, stream=False))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            health = (await c.get("/health")).status_code
            new = (await c.post("/v1/completions", json={"prompt": "late"})).status_code
            streams = await asyncio.gather(*long)
            ended = time.monotonic() - t0
            return streams, await short, health, new, ended, t0

    streams, short, health, new, ended, t0 = asyncio.run(main())
    exited = srv.wait_exit(30)
    print(f"\nSIGTERM, 16 streams, --shutdown-timeout 2: streams ended {ended:.2f} s after the signal "
          f"({sorted({s[1] for s in streams})}); process exited {time.monotonic() - t0:.2f} s after it with "
          f"status {srv.proc.returncode}; /health while draining {health}, a new request {new}")
    assert all(s[0] == 200 and s[1] == ("shutting_down", "data: [DONE]") for s in streams), streams
    assert short[0] == 200 and (health, new) == (503, 503)
    assert exited is not None and srv.proc.returncode == 0, srv.log.read_text()[-3000:]


def test_a_second_signal_exits_at_once(serve):
    srv = serve("--shutdown-timeout", "60", patch=SLOW_STEPS)  # the stream must outlast the first signal

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            stream = asyncio.create_task(_request(c, LONG, stream=True))
            await _wait_running(srv.url, 1)
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            exited = await asyncio.to_thread(srv.wait_exit, 10)
            stream.cancel()
            return exited, time.monotonic() - t0

    exited, took = asyncio.run(main())
    print(f"\nsecond SIGTERM: exited after {took:.2f} s with status {srv.proc.returncode}")
    assert exited is not None and srv.proc.returncode == 128 + signal.SIGTERM
