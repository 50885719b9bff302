"""The tape browser and orchestrate.after.show treat run files as untrusted input (issue 13, item 6)."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading

import pytest

from orchestrate.after.browse import PAGE, RunIndex, serve
from tapes.store import write_tapes
from tests.test_browse import synthetic_tape

EVIL = '<img src=x onerror="window.pwned=1">'

# Expressions interpolated into HTML that are numbers computed by the page itself, or whole HTML built
# from escaped parts by the page's own functions.
PAGE_OWN = {
    "X(p[0])",
    "Y(p[1])",
    "W",
    "H",
    "H - 3",
    "line",
    "dots",
    "colourFor(t)",
    "renderTokens(c)",
    "stepBody(step)",
    "c.tokens.length",
    "i + 1",
    "html",
    "from",
    'isEval ? "eval" : "rollout"',
}


def _interpolations(js: str) -> list[str]:
    """Every ${...} of the page's template literals (balanced braces)."""
    out, i = [], 0
    while (i := js.find("${", i)) >= 0:
        depth, j = 1, i + 2
        while depth and j < len(js):
            depth += {"{": 1, "}": -1}.get(js[j], 0)
            j += 1
        out.append(js[i + 2 : j - 1].strip())
        i = j
    return out


def test_every_value_inserted_into_the_page_is_escaped():
    html = PAGE.read_text()
    script = html[html.index("<script>") :]
    unescaped = []
    exprs = _interpolations(script)
    while exprs:
        expr = exprs.pop()
        if "`" in expr:  # a nested template (a ternary or a map over items): check its own interpolations
            exprs += _interpolations(expr)
            expr = re.sub(r"`[^`]*`", '""', expr)
        # esc/fmt escape; signCls and yesNo return constant words; num() builds its markup with esc()
        if (
            expr.startswith(("esc(", "fmt(", "encodeURIComponent(", "CSS.escape(", "signCls(", "yesNo(", "num("))
            or expr in PAGE_OWN
        ):
            continue
        branch = r"(\"[^\"]*\"|(esc|fmt)\([^?:]*\))"
        if re.fullmatch(rf"[^?]*\?\s*{branch}\s*:\s*{branch}", expr, re.S):
            continue  # a choice between literals and escaped values
        if re.fullmatch(r"[^?]*\?\s*\"[^\"]*\"\s*:\s*(\"[^\"]*\"|[^?]*\?\s*\"[^\"]*\"\s*:\s*\"[^\"]*\")", expr, re.S):
            continue  # a choice between two literals
        if re.fullmatch(r"[\w.()\[\]]+\.toFixed\(\d\)", expr) or expr in (
            "page.offset + 1",
            "last",
            "page.total",
            "it",
            "index",
            "members.length",
            'c.messages.map((msg) => "").join("")',
            "turn.call + 1",  # numbers
            'badges.join("")',  # badges built from constant markup and fmt()
            "k",
            'typeof v === "string" ? v : JSON.stringify(v)',  # inside an esc(...) of the whole note text
        ):
            continue  # numbers, or text set with textContent / into a URL
        unescaped.append(expr)
    assert not unescaped, unescaped


def test_esc_escapes_markup_and_quotes(tmp_path):
    if not os.path.exists("/usr/bin/node"):
        pytest.fail("node is needed to run the page's esc()")
    html = PAGE.read_text()
    esc = re.search(r"function esc\(s\) \{.*?\n\}", html, re.S).group(0)
    out = subprocess.run(["/usr/bin/node", "-e", esc + f"\nprocess.stdout.write(esc({json.dumps(EVIL + chr(39))}) + '|' + esc(3) + '|' + esc(null))"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.stdout == "&lt;img src=x onerror=&quot;window.pwned=1&quot;&gt;&#39;|3|", out


@pytest.fixture
def served(tmp_path):
    servers = []

    def start(run, host="127.0.0.1"):
        server = serve(run, host=host, port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def get(port, path, host=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest("GET", path, skip_host=True)
    conn.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
    conn.endheaders()
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, body


def test_a_line_that_is_json_but_not_a_tape_does_not_break_the_listing(tmp_path, served):
    run = tmp_path / "run"
    path = run / "tapes" / "iter_000001.jsonl"
    write_tapes(path, [synthetic_tape(i, 1) for i in range(4)])
    with open(path, "ab") as f:
        f.write(b"[1, 2, 3]\n")  # line 5
        f.write(b'{"metadata": "not an object"}\n')  # line 6
        f.write(json.dumps({"metadata": {"iteration": EVIL, "reward": "high"}}).encode() + b"\n")  # line 7
        f.write(b'{"steps": 5}\n')  # line 8
        f.write(b"\xff\xfe not utf-8\n")  # line 9
        f.write(b"{torn\n")  # line 10
    port = served(run)
    status, body = get(port, "/api/tapes?limit=50&sort=-reward")
    assert status == 200, body
    listing = json.loads(body)
    assert listing["total"] == 10
    bad = sorted(s["error"] for s in listing["items"] if s.get("bad_line"))
    assert [b.split(": ")[0] for b in bad] == [f"iter_000001.jsonl:{n}" for n in (10, 5, 6, 7, 8, 9)], bad
    assert all(isinstance(s["iteration"], int) for s in listing["items"])  # nothing of the bad lines leaks through
    status, body = get(port, "/api/run")
    assert status == 200 and len(json.loads(body)["bad_lines"]) == 6
    status, body = get(port, "/api/tape?file=iter_000001.jsonl&index=5")  # opening one names it
    assert status == 400 and b"iter_000001.jsonl:6" in body
    status, _ = get(port, "/api/tape?file=iter_000001.jsonl&index=0")
    assert status == 200


def test_symlinks_out_of_the_run_are_not_followed(tmp_path, served):
    secret = tmp_path / "elsewhere"
    write_tapes(secret / "iter_000009.jsonl", [synthetic_tape(i, 9) for i in range(3)])
    (secret / "config.json").write_text('{"secret": "do not show"}')
    (secret / "metrics.jsonl").write_text('{"iteration": 1, "secret": 1}\n')
    run = tmp_path / "run"
    write_tapes(run / "tapes" / "iter_000001.jsonl", [synthetic_tape(i, 1) for i in range(2)])
    os.symlink(secret / "iter_000009.jsonl", run / "tapes" / "iter_000002.jsonl")
    os.symlink(secret / "config.json", run / "config.json")
    os.symlink(secret / "metrics.jsonl", run / "metrics.jsonl")
    os.symlink(run / "tapes" / "iter_000001.jsonl", run / "tapes" / "iter_000003.jsonl")  # inside: fine
    port = served(run)
    status, body = get(port, "/api/run")
    assert status == 200
    data = json.loads(body)
    assert data["config"] is None and data["metrics"] == [] and b"do not show" not in body
    assert sorted(f["name"] for f in data["files"]) == ["iter_000001.jsonl", "iter_000003.jsonl"]
    status, body = get(port, "/api/tape?file=iter_000002.jsonl&index=0")
    assert status == 404
    assert RunIndex(run).list({"kind": "all"})["total"] == 4


def test_requests_for_another_host_are_refused(tmp_path, served):
    run = tmp_path / "run"
    write_tapes(run / "tapes" / "iter_000001.jsonl", [synthetic_tape(i, 1) for i in range(2)])
    port = served(run)
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"127.0.0.1:{port + 1}", ""):
        status, body = get(port, "/api/tapes", host=host)
        assert status == 421 and b"total" not in body, (host, status)
        assert get(port, "/", host=host)[0] == 421
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
        assert get(port, "/api/tapes", host=host)[0] == 200, host


def test_a_non_loopback_host_prints_a_warning(tmp_path):
    run = tmp_path / "run"
    write_tapes(run / "tapes" / "iter_000001.jsonl", [synthetic_tape(0, 1)])
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        proc = subprocess.Popen([sys.executable, "-m", "orchestrate.after.browse", str(run), "--port", "0", "--host", host],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            proc.stdout.readline()  # "Browsing ..." comes after the warning
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=10)
        assert ("no authentication" in err) == warned, err


def test_show_escapes_terminal_control_characters(tmp_path):
    tape = synthetic_tape(1, 1)
    tape.llm_calls[0].output_text = "ok\x1b]0;owned\x07\x1b[2J\x1b[31mred\u202etxt.exe\x9b"
    tape.metadata.reward_reason = "bad\x1b[1A"
    tape.metadata.task_id = "t\x1bc"
    path = write_tapes(tmp_path / "iter_000001.jsonl", [tape])
    for color in (["--no-color"], []):
        out = subprocess.run([sys.executable, "-m", "orchestrate.after.show", str(path), *color], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert "\x07" not in text and "\u202e" not in text and "\x9b" not in text
        assert re.findall(r"\x1b(?!\[[0-9;]*m)", text) == []  # only colour codes of our own, if any
        if color:
            assert "\x1b" not in text
        assert "ok\\x1b]0;owned\\x07\\x1b[2J" in text and "\\u202e" in text and "bad\\x1b[1A" in text
