"""The live page (13_live_page): its event stream on a real server, and the page itself in a real browser.

The stream is read by httpx (and, for a viewer that reads nothing, by a raw socket) from a real uvicorn server on
loopback serving the tiny random model: snapshots at a bounded rate, ids, lengths and counts in them and never a
prompt's or an answer's text, the API key, a viewer that falls behind dropped, no snapshot taken while nobody
watches. The browser tests drive headless Chromium, the distribution's package (`apt-get install chromium
chromium-driver`), with Selenium and the distribution's chromedriver; nothing is downloaded. Where either is
missing they skip and say so.
"""
import base64, json, shutil, socket, threading, time

import httpx
import pytest

from minivllm.engine import LLMEngine
from minivllm.server import BackgroundServer, build_app

MARK = "zebra-secret-42"


def tiny_app(tiny, **kw):
    model, tok = tiny
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=1024, max_num_seqs=64, log_steps=True)
    return build_app(engine, "tiny", **kw)


def chat(url, content, max_tokens=200, headers=None, **extra):
    "One streamed chat to its end; returns the text of the answer."
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True} | extra
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return text


def in_threads(fn, args_list):
    threads = [threading.Thread(target=fn, args=args) for args in args_list]
    for t in threads: t.start()
    return threads


def read_events(url, done, headers=None, timeout=60.0):
    "(snapshots, raw text) one viewer gets until done(snapshots) or timeout; checks the SSE framing."
    snaps, raw, t0 = [], [], time.monotonic()
    with httpx.stream("GET", url + "/live/events", headers=headers, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-store"
        for line in r.iter_lines():
            raw.append(line)
            assert line == "" or line.startswith("data: {") or line == ": quiet", line
            if line.startswith("data: "): snaps.append(json.loads(line[6:]))
            if done(snaps) or time.monotonic() - t0 > timeout: break
    return snaps, "\n".join(raw)


def eventually(check, timeout=5.0) -> bool:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout: return False
        time.sleep(0.01)
    return True


def finished(snaps):
    "The engine worked and is idle again."
    return any(s["running"] for s in snaps) and not snaps[-1]["running"] and not snaps[-1]["waiting"]


@pytest.fixture(scope="module")
def server(tiny):
    with BackgroundServer(tiny_app(tiny)) as srv:
        yield srv


# --- the stream -------------------------------------------------------------------------------------------------
def test_no_snapshot_is_taken_while_nobody_watches(server):
    feed, eng = server.app.state.live, server.app.state.engine.engine
    taken, steps = feed.taken, eng.num_steps
    for t in in_threads(chat, [(server.url, f"user {i}", 40) for i in range(4)]): t.join()
    assert eng.num_steps > steps + 30
    assert feed.taken == taken and feed.watching == 0


def test_stream_rate_is_bounded_and_shows_no_text(server):
    feed = server.app.state.live
    answers = {}
    def user(i): answers[i] = chat(server.url, f"user {i}: {MARK}-{i}", 400)
    users = in_threads(user, [(i,) for i in range(4)])
    snaps, raw = read_events(server.url, finished)
    for t in users: t.join()
    busy = [s for s in snaps if s["running"]]
    assert len(busy) >= 5, len(busy)
    # at most one snapshot per interval while the engine works (the first came at once, as the viewer joined)
    gaps = [b["time"] - a["time"] for a, b in zip(busy[1:], busy[2:])]
    assert min(gaps) >= 0.09 and len(gaps) / sum(gaps) <= 11, gaps
    held = [s["blocks"]["n"] - s["blocks"]["free"] for s in snaps]
    assert max(held) > 0 and held[-1] == 0, held
    # ids, lengths and counts, never text: neither the prompts nor any answer is anywhere in the stream
    assert MARK not in raw and "user" not in raw
    for text in answers.values():
        assert len(text) >= 100 and text not in raw
    s = busy[-1]
    assert set(s) == {"time", "blocks", "running", "waiting", "steps", "totals", "tokens_per_s"}
    assert set(s["running"][0]) == {"id", "prompt", "len", "computed", "blocks", "preempted", "cached"}
    assert all(isinstance(v, int) for r in s["running"] for v in r.values())
    assert all(isinstance(x, int) for st in s["steps"] for row in st["rows"] for x in row)
    assert sum(s["blocks"]["grid"][1::2]) == s["blocks"]["n"]  # the run-length coded grid covers the pool
    assert s["tokens_per_s"] > 0 and s["totals"]["generation_tokens"] > 0
    assert eventually(lambda: feed.watching == 0)  # the viewer left with its connection


def test_the_page_and_its_files(server):
    page, js, css = (httpx.get(server.url + p) for p in ["/", "/live/page.js", "/live/page.css"])
    assert page.status_code == js.status_code == css.status_code == 200
    assert page.headers["content-type"].startswith("text/html") and js.headers["content-type"].startswith("text/javascript")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/live/page.js"' in page.text and "innerHTML" not in js.text
    assert httpx.get(server.url + "/live/other.js").status_code == 404


def test_api_key_guards_the_page_and_its_stream(tiny):
    with BackgroundServer(tiny_app(tiny, api_key="sesame")) as srv:
        for path in ["/", "/live/page.js", "/live/events", "/v1/models"]:
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert ("www-authenticate" in r.headers) == (not path.startswith("/v1")), path
        assert httpx.get(srv.url + "/", auth=("anyone", "sesame")).status_code == 200
        assert httpx.get(srv.url + "/", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert httpx.get(srv.url + "/", auth=("anyone", "wrong")).status_code == 401
        assert httpx.get(srv.url + "/v1/models", auth=("anyone", "sesame")).status_code == 200
        bad = base64.b64encode(b"no colon, no key").decode()
        assert httpx.get(srv.url + "/", headers={"Authorization": f"Basic {bad}"}).status_code == 401
        assert httpx.get(srv.url + "/", headers={"Authorization": "Basic %%%"}).status_code == 401
        snaps, _ = read_events(srv.url, lambda s: len(s) >= 1, headers={"Authorization": "Bearer sesame"})
        assert len(snaps) == 1 and srv.app.state.live.taken >= 1


def test_a_viewer_that_falls_behind_is_dropped(tiny):
    app = tiny_app(tiny)
    feed = app.state.live
    feed.interval = 0.002  # many snapshots, so that a viewer that reads nothing falls behind fast
    srv = BackgroundServer(app)
    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit small buffers
    with srv:
        users = in_threads(chat, [(srv.url, f"user {i}", 440) for i in range(16)])
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect((srv.host, srv.port))
        stuck.sendall(f"GET /live/events HTTP/1.1\r\nHost: {srv.host}\r\n\r\n".encode())  # and never reads
        got = []
        reader = in_threads(lambda: got.extend(read_events(srv.url, lambda s: len(s) > 10 and feed.dropped)[0]), [()])
        t0 = time.monotonic()
        while not feed.dropped and time.monotonic() - t0 < 60: time.sleep(0.05)
        for t in reader: t.join()
        assert feed.dropped == 1, "the viewer that reads nothing was not dropped"
        assert len(got) > 10  # the viewer that reads kept getting snapshots
        stuck.settimeout(20)  # its connection was closed: what was buffered, then the end
        try:
            while stuck.recv(1 << 16): pass
            closed = True
        except socket.timeout:
            closed = False
        stuck.close()
        for t in users: t.join()
        assert closed and eventually(lambda: feed.watching == 0)


# --- in a browser -----------------------------------------------------------------------------------------------
def chromium_or_skip(width=1400, height=900):
    "Headless Chromium under Selenium with the distribution's chromedriver, or a skip that says what is missing."
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium, in the dev extras)")
    chrome = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chrome and driver):
        pytest.skip("no chromium/chromedriver here: apt-get install chromium chromium-driver (Debian's packages)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for arg in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"]:
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


@pytest.fixture
def browser():
    b = chromium_or_skip()
    yield b
    b.quit()


def js(browser, expr):
    return browser.execute_script(f"return ({expr})")


def wait_for(browser, expr, timeout=60.0):
    t0 = time.monotonic()
    while not js(browser, expr):
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {expr}"
        time.sleep(0.02)


LAST_ANSWER = "[...document.querySelectorAll('.msg.assistant .text')].pop()"
GRID = "document.getElementById('grid')"


def test_chat_streams_and_the_grid_fills_then_frees(browser, server, tmp_path):
    from selenium.webdriver.common.by import By
    browser.get(server.url + "/")
    wait_for(browser, "document.body.dataset.events > 0 && document.querySelector('#model option')")
    assert js(browser, "document.querySelector('#model').value") == "tiny"
    assert js(browser, f"{GRID}.dataset.held") == "0"
    idle_picture = js(browser, f"{GRID}.toDataURL()")
    box = browser.find_element(By.ID, "max-tokens")
    box.clear()
    box.send_keys("400")
    browser.find_element(By.ID, "prompt").send_keys("Hello, page")
    browser.find_element(By.ID, "send").click()  # the page's own form, as a user sends
    lengths, held, pictures = [], [], set()
    t0 = time.monotonic()
    while js(browser, "minivllm.page.controller !== null") and time.monotonic() - t0 < 60:
        lengths.append(js(browser, f"{LAST_ANSWER}.textContent.length"))
        held.append(int(js(browser, f"{GRID}.dataset.held")))
        pictures.add(js(browser, f"{GRID}.toDataURL()"))
        time.sleep(0.05)
    browser.save_screenshot(str(tmp_path / "live_page.png"))
    answer = js(browser, f"{LAST_ANSWER}.textContent")
    # the answer streamed in: seen growing through several lengths before the end, then whole
    grown = sorted(set(l for l in lengths if 0 < l < len(answer)))
    assert len(answer) >= 50 and len(grown) >= 3, (len(answer), grown)
    assert js(browser, "document.getElementById('chat-status').textContent").startswith("finished")
    # the grid changed while it generated, and every block comes back after
    assert max(held) > 0 and len(pictures - {idle_picture}) >= 2, held
    wait_for(browser, f"{GRID}.dataset.held === '0' && document.getElementById('s-running').textContent === '0'")
    assert js(browser, "document.querySelectorAll('#steps .step').length") > 0


def test_stop_ends_the_answer_and_gives_its_blocks_back(browser, server):
    from selenium.webdriver.common.by import By
    browser.get(server.url + "/")
    wait_for(browser, "document.body.dataset.events > 0")
    browser.execute_script("minivllm.send('a long one, please', {max_tokens: 440, ignore_eos: true})")
    wait_for(browser, f"{LAST_ANSWER}.textContent.length > 5 && {GRID}.dataset.held > 0")
    browser.find_element(By.ID, "stop").click()
    wait_for(browser, "minivllm.page.controller === null")
    assert js(browser, "document.getElementById('chat-status').textContent") == "stopped"
    wait_for(browser, f"{GRID}.dataset.held === '0'")  # the server aborted it: every block is back
    assert server.app.state.engine.engine.generation_tokens > 0


PAYLOAD = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"><b>bold</b>'


def test_model_output_with_html_shows_as_text(browser, server):
    """The model's output is forced to hold HTML (a grammar allows nothing else: `guided_choice`), generated by the
    real engine and streamed through the page's own chat code; the page shows it as text."""
    browser.get(server.url + "/")
    wait_for(browser, "document.body.dataset.events > 0")
    browser.execute_script("minivllm.send('show me some HTML', {guided_choice: [arguments[0]], temperature: 0})",
                           PAYLOAD)
    wait_for(browser, "minivllm.page.controller === null && minivllm.page.messages.length === 2")
    assert js(browser, f"{LAST_ANSWER}.textContent") == PAYLOAD
    assert js(browser, "document.querySelectorAll('#messages script, #messages img, #messages b').length") == 0
    assert js(browser, "window.pwned === undefined")
    assert "&lt;script&gt;" in js(browser, f"{LAST_ANSWER}.innerHTML")


MARKDOWN = ("Here:\n\n```python\ndef f(x):\n    return x[::-1]\n```\n\n- one `item`\n- two\n\n"
            "| a | b |\n|---|---|\n| 1 | 2 |\n\nInline <b>bold</b> and [a link](javascript:window.pwned=3).")


def test_an_answer_in_markdown_is_rendered_as_it_streams(browser, server):
    "Code fences with their language, lists, inline code and tables; its HTML as text, its script links dead."
    browser.get(server.url + "/")
    wait_for(browser, "document.body.dataset.events > 0")
    browser.execute_script("window.seen = new Set(); new MutationObserver(() => { const t = "
                           f"{LAST_ANSWER}; if (t) seen.add(t.childElementCount); }}).observe("
                           "document.getElementById('messages'), {childList: true, subtree: true})")
    browser.execute_script("minivllm.send('markdown please', {guided_choice: [arguments[0]], temperature: 0})",
                           MARKDOWN)
    wait_for(browser, "minivllm.page.controller === null && minivllm.page.messages.length === 2")
    q = lambda css: js(browser, f"{LAST_ANSWER}.querySelectorAll({css!r}).length")
    assert q("pre[data-lang='python'] > code.language-python") == 1 and q("ul > li") == 2
    assert q("li code") == 1 and q("table th") == 2 and q("table td") == 2
    assert "return x[::-1]" in js(browser, f"{LAST_ANSWER}.querySelector('pre').textContent")
    assert q("b") == 0 and "<b>bold</b>" in js(browser, f"{LAST_ANSWER}.textContent")  # HTML stays text
    assert "javascript:" not in js(browser, f"{LAST_ANSWER}.innerHTML")
    assert len(js(browser, "[...window.seen]")) >= 3  # rendered piece by piece while it streamed, not once at the end


def test_a_users_html_shows_as_text(browser, server):
    browser.get(server.url + "/")
    wait_for(browser, "document.body.dataset.events > 0")
    browser.execute_script("minivllm.send(arguments[0], {max_tokens: 4})", PAYLOAD)
    wait_for(browser, "minivllm.page.controller === null && minivllm.page.messages.length === 2")
    user = "document.querySelector('.msg.user .text')"
    assert js(browser, f"{user}.textContent") == PAYLOAD and js(browser, f"{user}.childElementCount") == 0
    assert js(browser, "window.pwned === undefined")


def test_the_grid_stays_readable_at_the_bundled_models_pool(browser, tiny):
    "10,922 blocks (the bundled model's pool on this CPU): several blocks a cell, cells of 8 pixels or more."
    model, tok = tiny
    engine = LLMEngine(model, tok, block_size=16, num_kv_blocks=10922, max_num_seqs=8)
    with BackgroundServer(build_app(engine, "tiny")) as srv:
        browser.get(srv.url + "/")
        wait_for(browser, "document.body.dataset.events > 0")
        browser.execute_script("minivllm.send('hello', {max_tokens: 300, ignore_eos: true})")
        wait_for(browser, f"{GRID}.dataset.held > 0")
        per, cell = int(js(browser, f"{GRID}.dataset.per")), int(js(browser, f"{GRID}.dataset.cell"))
        assert per == 5 and cell >= 8, (per, cell)
        assert js(browser, "document.getElementById('grid-scale').textContent") == "5 blocks a cell"
        assert js(browser, f"{GRID}.height") <= 320  # the whole pool in view
        browser.find_element("id", "stop").click()
        wait_for(browser, "minivllm.page.controller === null")
        browser.get("about:blank")


def test_favicon_and_the_models_temperature(tiny):
    "/favicon.ico is served, open without the key; the page links it, and its temperature box starts at the model's."
    from minivllm.engine import EngineArgs
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineArgs(override_generation_config={"temperature": 0.3}), num_kv_blocks=64)
    with BackgroundServer(build_app(engine, "tiny", api_key="sesame")) as srv:
        icon = httpx.get(srv.url + "/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
        assert icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO file, open without the key
        page = httpx.get(srv.url + "/", headers={"Authorization": "Bearer sesame"}).text
        assert '<link rel="icon" href="/favicon.ico">' in page
        assert '<input id="temperature" type="number" min="0" max="2" step="0.05" value="0.3">' in page


def test_the_page_works_behind_an_api_key(browser, tiny):
    with BackgroundServer(tiny_app(tiny, api_key="sesame")) as srv:
        browser.get(srv.url + "/")
        assert "<canvas" not in browser.page_source  # no key: a login box (HTTP Basic), not the page
        basic = base64.b64encode(b"me:sesame").decode()
        browser.execute_cdp_cmd("Network.enable", {})
        browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {basic}"}})
        browser.get(srv.url + "/")
        wait_for(browser, "document.body.dataset.events > 0 && document.querySelector('#model option')")
        browser.execute_script("minivllm.send('hi', {max_tokens: 8})")
        wait_for(browser, "minivllm.page.controller === null && minivllm.page.messages.length === 2")
        assert js(browser, "document.getElementById('chat-status').textContent").startswith("finished")
        browser.get("about:blank")  # close the page's stream before the server stops
