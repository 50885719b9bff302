"""Browse a run's tapes in a web page: `uv run -m orchestrate.after.browse RUN_DIR [--port 8765]`.

A small JSON API over the run directory plus one static page (browse.html,
no build step), served by the standard library on 127.0.0.1:

    GET /                   the page
    GET /api/run            config, metrics (one record per iteration), tape files
    GET /api/tapes?...      one page of tape summaries, filtered and sorted
    GET /api/tape?file=&index=   one tape whole, its tokens with log-probs and KL, its group

It stays responsive on big runs: each tape file is indexed once (byte offset
and a small summary per line, redone only when the file changes), lists are
paged, and a tape is read from its offset when it is asked for. Only the
layout of the run directory is known here (tapes/iter_*.jsonl,
tapes/eval_*.jsonl, config.json, metrics.jsonl, checkpoints/*/, and the
learner's advantages/NNNNNN.jsonl read with `contract.rundir.read_advantages`),
so this module imports nothing from agents, and of the rest of orchestrate only
the mark dynamic sampling leaves on the tapes it drops
(`orchestrate.loop.dynamic_sampling.DROPPED_BY`). It lives here, not in tapes/,
because it reads the run directory (contract) and tapes, the bottom layer,
imports nothing of ours.

A tape is shown as the episode it records: the environment's observations and
the agent's actions turn by turn, each turn with its reward and the return and
advantage the learner trained it with, read from the learner's advantages file
of that iteration (never recomputed here: the learner's baseline, discount and
normalisation are its own). Evaluation tapes, iterations not trained yet,
tapes with an infrastructure error and tapes whose group dynamic sampling
dropped show that they were not trained on.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import re
import socket
import sys
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from contract.cli import StrictParser
from contract.kl import k3
from contract.rundir import RunDir, advantages_file, read_advantages
from orchestrate.after.episode_view import TAPE_FILE, episode_view, load_tokenizer, trained_turns, tree_rows
from tapes.store import read_tape_at

PAGE = Path(__file__).with_name("browse.html")
MAX_LIMIT = 500


def summarize(data: dict, file: str, index: int, kind: str) -> dict:
    """What a tape list shows and filters on, from one parsed tape line."""
    meta = data.get("metadata") or {}
    steps = data.get("steps") or []
    calls = data.get("llm_calls") or []
    context = data.get("context")
    env = context.get("env") if isinstance(context, dict) and isinstance(context.get("env"), dict) else {}
    observations = [s for s in steps if s.get("kind") == "env_observation"]
    task = next((s for s in observations if not s.get("turn")), None)
    cut = any(c.get("finish_reason") == "length" for c in calls)
    format_error = any((s.get("info") or {}).get("format_error") for s in observations)
    terminated, truncated = bool(meta.get("terminated")), bool(meta.get("truncated")) or cut
    return {
        "file": file,
        "index": index,
        "kind": kind,
        "id": meta.get("id", ""),
        "iteration": meta.get("iteration", 0),
        "policy_version": meta.get("policy_version", 0),
        "task_id": meta.get("task_id", ""),
        "group_id": meta.get("group_id", ""),
        "reward": meta.get("reward"),
        "reward_reason": meta.get("reward_reason", ""),
        "error": meta.get("error"),
        "dropped": meta.get(
            "dropped"
        ),  # left out of the batch (dynamic sampling, a fork diverged): TapeMetadata.dropped
        "parent_id": meta.get("parent_id"),  # a fork's parent and branch point (tree rollouts, orchestrate.after.fork)
        "branch_at": meta.get("branch_at"),
        "env_id": str(env.get("id") or ""),
        "turns": meta.get("turns") or sum(s.get("kind") == "env_action" for s in steps) or len(calls),
        "success": meta.get("success"),
        "terminated": terminated,
        "truncated": truncated,  # the episode was cut (turn limit, context full) or an output was cut
        "cut": cut,  # an output was cut by max_tokens
        "end": "truncated" if truncated else "terminated" if terminated else "",
        "format_error": format_error,  # some action could not be parsed
        "length": sum(len(c.get("output_token_ids") or []) for c in calls),
        "steps": len(steps),
        "calls": len(calls),
        "question": ((task or {}).get("text") or "")[:200],
    }


def checked_summary(line: bytes, file: str, index: int, kind: str, lineno: int) -> dict:
    """summarize() of one line, or, for a line that is not a tape (not JSON, not UTF-8, JSON of another
    shape or with mistyped fields), a summary flagged as a bad line `FILE:LINE: ...`: the rest of the
    file and of the run still list."""
    try:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not a tape object")
        s = summarize(data, file, index, kind)
        for key, kinds in (("iteration", int), ("policy_version", int), ("task_id", str), ("group_id", str),
                           ("id", str), ("reward_reason", (str, type(None))), ("question", str)):  # fmt: skip
            if not isinstance(s[key], kinds) or isinstance(s[key], bool):
                raise ValueError(f"metadata.{key} is {type(s[key]).__name__}")
        if s["reward"] is not None and (isinstance(s["reward"], bool) or not isinstance(s["reward"], (int, float))):
            raise ValueError(f"metadata.reward is {type(s['reward']).__name__}")
        if s["error"] is not None and not isinstance(s["error"], str):
            s["error"] = str(s["error"])
        return s
    except Exception as exc:  # noqa: BLE001 - any shape a foreign line may have
        s = summarize({}, file, index, kind)
        s["error"] = f"{file}:{lineno}: not a tape ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        s["bad_line"] = True
        return s


def inside(root: Path, path: Path) -> bool:
    """Whether `path`, symlinks resolved, lies in `root`: links that point out of the run are not followed."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


# an LLM call's fields shown token by token (`tokens`), not as the call's own
SHOWN_APART = {"output_token_ids", "logprobs", "ref_logprobs", "teacher_logprobs", "teacher_top_ids",
               "teacher_top_logprobs"}  # fmt: skip
SHOWN_TOP = 3  # of the teacher's top-k at a token, the most likely shown in its tooltip


@dataclass
class IndexedFile:
    path: Path
    kind: str  # "rollout" or "eval"
    iteration: int
    stamp: tuple[int, int] = (0, 0)  # (size, mtime_ns) the index was built from
    offsets: list[int] = field(default_factory=list)
    summaries: list[dict] = field(default_factory=list)
    advantages_stamp: tuple[int, int] | None = None  # of the advantages file the learner's turns were read from
    learned: list[list[dict] | None] = field(default_factory=list)  # the learner's turns, per tape

    def refresh(self, root: Path) -> None:
        st = self.path.stat()
        stamp = (st.st_size, st.st_mtime_ns)
        adv_path = advantages_file(root, self.iteration)
        advantages_stamp = _stamp(adv_path) if self.kind == "rollout" else None
        if stamp != self.stamp:
            self._index(stamp)
        elif advantages_stamp == self.advantages_stamp:
            return
        advantages = None
        if advantages_stamp is not None:
            try:
                advantages = read_advantages(root, self.iteration)
            except (OSError, ValueError):  # unreadable: shown as not written
                advantages, advantages_stamp = None, None
        source = f"{adv_path.parent.name}/{adv_path.name}"
        self.learned = []
        for s in self.summaries:
            turns, note = trained_turns(self.kind, s["error"], s["id"], advantages, source, s["dropped"])
            first = turns[0] if turns else {}
            s.update(
                trained=turns is not None,
                learner_note=note,
                advantage=first.get("advantage"),
                **{"return": first.get("return")},
            )
            self.learned.append(turns)
        self.advantages_stamp = advantages_stamp

    def _index(self, stamp: tuple[int, int]) -> None:
        offsets, summaries = [], []
        with open(self.path, "rb") as f:
            pos = 0
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    summaries.append(checked_summary(line, self.path.name, len(offsets), self.kind, lineno))
                    offsets.append(pos)
                pos += len(line)
        groups: dict[str, list[dict]] = {}
        for s in summaries:
            groups.setdefault(s["group_id"] or s["id"], []).append(s)
        for members in groups.values():
            for m in members:
                m["group_size"] = len(members)
        self.offsets, self.summaries, self.stamp = offsets, summaries, stamp


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


class RunIndex:
    """The tapes of one run directory, indexed for paged lists and random access."""

    def __init__(self, root: str | Path, tokenizer: str | Path | None = None):
        self.root = Path(root)
        self.files: dict[str, IndexedFile] = {}
        self._lock = threading.Lock()
        self._tokenizer_path = tokenizer
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        self._tokenizer_lock = threading.Lock()  # apart from the index lock: lists never wait for it

    # -- run-level files ----------------------------------------------------

    def config(self) -> dict | None:
        path = RunDir(self.root).config_path
        if not inside(self.root, path):
            return None
        try:
            config = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None
        return config if isinstance(config, dict) else None

    def metrics(self) -> list[dict]:
        path = RunDir(self.root).metrics_path
        out = []
        if path.exists() and inside(self.root, path):
            for line in path.read_bytes().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn last line
                if isinstance(record, dict):
                    out.append(record)
        return out

    def bad_lines(self) -> list[str]:
        """`FILE:LINE: why` of every indexed line that is not a tape."""
        return [s["error"] for f in self.files.values() for s in f.summaries if s.get("bad_line")]

    def refresh(self) -> list[IndexedFile]:
        """Index new or changed tape files; returns them in order (rollouts by iteration, then evals)."""
        with self._lock:
            folder = RunDir(self.root).tapes
            present = {}
            for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
                m = TAPE_FILE.match(path.name)
                if m and inside(self.root, path):
                    present[path.name] = (path, "rollout" if m.group(1) == "iter" else "eval", int(m.group(2)))
            self.files = {
                name: self.files.get(name) or IndexedFile(path, kind, iteration)
                for name, (path, kind, iteration) in present.items()
            }
            for f in self.files.values():
                f.refresh(self.root)
            return sorted(self.files.values(), key=lambda f: (f.kind != "rollout", f.iteration))

    # -- lists ----------------------------------------------------------------

    def list(self, query: dict[str, str]) -> dict:
        files = self.refresh()
        kind = query.get("kind") or "rollout"
        selected = [f for f in files if kind == "all" or f.kind == kind]
        if query.get("iteration") not in (None, ""):
            iteration = int(query["iteration"])
            selected = [f for f in selected if f.iteration == iteration]
        if query.get("file"):
            selected = [f for f in selected if f.path.name == query["file"]]
        rows = [s for f in selected for s in f.summaries]
        rows = [s for s in rows if _keep(s, query)]
        sort = query.get("sort") or ""
        if sort in ("length", "-length", "reward", "-reward", "advantage", "-advantage", "turns", "-turns"):
            key = sort.lstrip("-")
            known = sorted((s for s in rows if s.get(key) is not None), key=lambda s: s[key],
                           reverse=sort.startswith("-"))  # fmt: skip
            rows = known + [s for s in rows if s.get(key) is None]  # unscored tapes last either way
        offset = max(0, int(query.get("offset") or 0))
        limit = min(MAX_LIMIT, max(1, int(query.get("limit") or 50)))
        return {"total": len(rows), "offset": offset, "limit": limit, "items": rows[offset : offset + limit]}

    # -- one tape ---------------------------------------------------------------

    def tokenizer(self):
        """The run's tokenizer (newest checkpoint, else the configured policy folder), or None."""
        with self._tokenizer_lock:
            if not self._tokenizer_loaded:
                self._tokenizer_loaded = True
                candidates = [Path(self._tokenizer_path)] if self._tokenizer_path else []
                if not candidates:
                    run = RunDir(self.root)
                    candidates += [p for i in reversed(run.published()) if inside(self.root, p := run.checkpoint(i))]
                policy = ((self.config() or {}).get("model") or {}).get("policy")
                if not self._tokenizer_path and policy:
                    candidates.append(Path(policy))
                for folder in candidates:
                    self._tokenizer = load_tokenizer(folder)
                    if self._tokenizer is not None:
                        break
            return self._tokenizer

    def token_texts(self, ids: list[int], window: int = 6) -> list[str]:
        """Each token's text: what it adds to the decoding of the few tokens before it.

        Decoding a short window keeps multi-byte characters and word-initial
        spaces right without decoding every prefix (quadratic on long outputs).
        """
        tok = self.tokenizer()
        if tok is None:
            return [f"⟨{i}⟩" for i in ids]
        out = []
        for n in range(len(ids)):
            start = max(0, n - window)
            before = tok.decode(ids[start:n], skip_special_tokens=False) if n > start else ""
            after = tok.decode(ids[start : n + 1], skip_special_tokens=False)
            out.append(after[len(before) :] if after.startswith(before) else tok.decode([ids[n]]))
        return out

    def tape(self, file: str, index: int) -> dict:
        self.refresh()
        f = self.files.get(file)
        if f is None:
            raise LookupError(f"no tape file {file!r} in {self.root / 'tapes'}")
        if not 0 <= index < len(f.offsets):
            raise LookupError(f"{file} has {len(f.offsets)} tapes; no index {index}")
        tape = read_tape_at(f.path, f.offsets[index], index + 1)
        summary = f.summaries[index]
        learned = f.learned[index] if index < len(f.learned) else None
        calls = []
        for call in tape.llm_calls:
            texts = self.token_texts(call.output_token_ids)
            ref = (
                call.ref_logprobs
                if call.ref_logprobs and len(call.ref_logprobs) == len(call.output_token_ids)
                else None
            )
            teacher = call.teacher_logprobs
            if teacher is not None and len(teacher) != len(call.output_token_ids):
                teacher = None
            top_ids, top_lps = call.teacher_top_ids, call.teacher_top_logprobs
            if top_ids is None or top_lps is None or not len(top_ids) == len(top_lps) == len(call.output_token_ids):
                top_ids = top_lps = None
            tokens = []
            for i, (tid, text) in enumerate(zip(call.output_token_ids, texts)):
                lp = call.logprobs[i] if i < len(call.logprobs) else None
                entry = {"id": tid, "text": text, "logprob": lp}
                if ref is not None and lp is not None:
                    entry["ref_logprob"] = ref[i]
                    entry["kl"] = k3(lp, ref[i])
                if teacher is not None:
                    entry["teacher_logprob"] = teacher[i]
                if top_ids is not None:  # the teacher's most likely tokens there (--teacher.topk), the first few
                    shown = top_ids[i][:SHOWN_TOP]
                    entry["teacher_top"] = [[self.token_texts([t])[0], lp] for t, lp in zip(shown, top_lps[i])]
                tokens.append(entry)
            calls.append(
                {
                    **call.model_dump(exclude=SHOWN_APART),
                    "tokens": tokens,
                    "has_ref": ref is not None,
                    "n_prompt_tokens": len(call.prompt_token_ids),
                }
            )
        key = summary["group_id"] or summary["id"]
        group = tree_rows([s for s in f.summaries if (s["group_id"] or s["id"]) == key])
        return {
            "summary": summary,
            "metadata": tape.metadata.model_dump(),
            "context": tape.context,
            "steps": [s.model_dump() for s in tape.steps],
            "calls": calls,
            "episode": episode_view(tape, learned),
            "learner": {"trained": learned is not None, "note": summary.get("learner_note", ""), "turns": learned},
            "group": group,
        }

    def group(self, file: str, group_id: str) -> dict:
        """Every attempt of one group, each with its outputs, reward, turns and the learner's return and
        advantage (of its first turn)."""
        self.refresh()
        f = self.files.get(file)
        if f is None:
            raise LookupError(f"no tape file {file!r}")
        members = [s for s in f.summaries if (s["group_id"] or s["id"]) == group_id]
        if not members:
            raise LookupError(f"no group {group_id!r} in {file}")
        items = []
        for s in members:
            tape = read_tape_at(f.path, f.offsets[s["index"]], s["index"] + 1)
            items.append(
                {
                    **s,
                    "outputs": [c.output_text for c in tape.llm_calls],
                    "last_step": tape.steps[-1].model_dump() if tape.steps else None,
                }
            )
        return {"file": file, "group_id": group_id, "items": items}


def _keep(s: dict, q: dict[str, str]) -> bool:
    reward = q.get("reward") or ""
    r = s["reward"]
    if reward:
        if r is None:
            return False
        m = re.fullmatch(r"(<=|>=|<|>|=)?\s*(-?\d+(?:\.\d+)?)", reward.strip())
        if m:
            op, value = m.group(1) or "=", float(m.group(2))
            ok = {"<": r < value, ">": r > value, "<=": r <= value, ">=": r >= value, "=": r == value}[op]
            if not ok:
                return False
    task = (q.get("task") or "").strip().lower()
    if task and not any(task in s[key].lower() for key in ("task_id", "question", "env_id")):
        return False
    for flag, key in (
        ("format_error", "format_error"),
        ("truncated", "truncated"),
        ("success", "success"),
        ("trained", "trained"),
    ):
        want = q.get(flag) or ""
        if want in ("yes", "no") and bool(s[key]) != (want == "yes"):
            return False
    if q.get("group") and s["group_id"] != q["group"]:
        return False
    return True


def _finite(value: Any) -> Any:
    """`value` with NaN and +-inf as the strings "NaN", "Infinity", "-Infinity": tapes may hold them (a
    log-prob of -inf), JSON.parse refuses the bare constants, and the page shows a string as it is."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class Handler(BaseHTTPRequestHandler):
    index: RunIndex  # set on the subclass made by `serve`

    def log_message(self, format, *args) -> None:  # quiet: one line per request is noise here
        pass

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200) -> None:
        self._send(status, json.dumps(_finite(obj), default=str, allow_nan=False).encode(), "application/json")

    allowed_hosts: frozenset[str] = frozenset()  # set by `serve`: Host headers naming this server

    def do_GET(self) -> None:
        if self.headers.get("Host", "").lower() not in self.allowed_hosts:
            # a page elsewhere that made its own name resolve to 127.0.0.1 (DNS rebinding) is not us
            self._json({"error": "this server answers only requests addressed to it (Host header)"},
                       HTTPStatus.MISDIRECTED_REQUEST)  # fmt: skip
            return
        url = urlparse(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if url.path in ("/", "/index.html"):
                self._send(200, PAGE.read_bytes(), "text/html; charset=utf-8")
            elif url.path == "/favicon.ico":
                self._send(204, b"", "image/x-icon")
            elif url.path == "/api/run":
                files = self.index.refresh()
                self._json({
                    "root": str(self.index.root.resolve()),
                    "config": self.index.config(),
                    "metrics": self.index.metrics(),
                    "files": [{"name": f.path.name, "kind": f.kind, "iteration": f.iteration,
                               "tapes": len(f.offsets)} for f in files],
                    "bad_lines": self.index.bad_lines()[:100],
                })  # fmt: skip
            elif url.path == "/api/tapes":
                self._json(self.index.list(q))
            elif url.path == "/api/tape":
                self._json(self.index.tape(q.get("file", ""), int(q.get("index", "-1"))))
            elif url.path == "/api/group":
                self._json(self.index.group(q.get("file", ""), q.get("group", "")))
            else:
                self._json({"error": f"no such page: {url.path}"}, HTTPStatus.NOT_FOUND)
        except (LookupError, ValueError) as exc:
            self._json({"error": str(exc)}, HTTPStatus.NOT_FOUND if isinstance(exc, LookupError) else 400)
        except BrokenPipeError:
            pass
        except Exception as exc:  # e.g. a tape file removed while the run was being browsed
            self._json({"error": f"{type(exc).__name__}: {exc}"}, HTTPStatus.INTERNAL_SERVER_ERROR)


def serve(
    run_dir: str | Path, host: str = "127.0.0.1", port: int = 8765, tokenizer: str | Path | None = None
) -> ThreadingHTTPServer:
    """A server (not yet serving: call serve_forever, or run it in a thread) for one run directory."""
    index = RunIndex(run_dir, tokenizer)
    handler = type("RunHandler", (Handler,), {"index": index})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    handler.allowed_hosts = allowed_hosts(host, server.server_address[1])
    # Importing transformers and loading the tokenizer takes seconds: start now, not on the first tape opened.
    threading.Thread(target=index.tokenizer, name="load-tokenizer", daemon=True).start()
    return server


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """Host header values a request to this server carries: its address (and loopback names for a
    loopback server; this machine's names and addresses for one bound to all interfaces)."""
    import socket

    names = {host.lower()}
    if is_loopback(host):
        names |= set(LOOPBACK_NAMES)
    if host in ("", "0.0.0.0", "::"):
        names |= set(LOOPBACK_NAMES) | {socket.gethostname().lower(), socket.getfqdn().lower()}
        try:
            names |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
        except OSError:
            pass
    out = set()
    for name in names:
        name = f"[{name}]" if ":" in name and not name.startswith("[") else name
        out |= {f"{name}:{port}"} | ({name} if port == 80 else set())
    return frozenset(out)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number 0-65535")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = StrictParser(
        prog="orchestrate.after.browse", allow_abbrev=False, description="Browse a run's tapes in a web page."
    )
    parser.add_argument("run_dir", help="run directory (holds tapes/, metrics.jsonl, config.json)")
    parser.add_argument("--port", type=_port, default=8765, help="port on 127.0.0.1 (0: any free port) [default: 8765]")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on [default: 127.0.0.1]")
    parser.add_argument(
        "--tokenizer",
        help="tokenizer folder for token texts (default: the run's newest checkpoint, else its policy folder)",
    )
    args = parser.parse_args(argv)
    root = Path(args.run_dir)
    if not RunDir(root).tapes.is_dir():
        parser.error(f"run_dir {root}: no tapes/ folder here; pass a run directory (e.g. runs/embedded)")
    if args.tokenizer and load_tokenizer(Path(args.tokenizer)) is None:
        parser.error(f"--tokenizer {args.tokenizer}: no tokenizer there (tokenizer.json or tokenizer_config.json)")
    try:
        server = serve(root, args.host, args.port, args.tokenizer)
    except socket.gaierror as exc:  # the address, not the port
        parser.error(f"--host {args.host}: not an address this machine has ({exc.strerror})")
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            parser.error(f"--host {args.host}: not an address of this machine ({exc.strerror})")
        parser.error(f"--port {args.port}: cannot listen ({exc.strerror}); pick another, or 0 for any free port")
    host, port = server.server_address[:2]
    if not is_loopback(args.host):
        print(f"warning: --host {args.host}: the page has no authentication: anyone who can reach this address "
              "reads every tape of the run; prefer 127.0.0.1 with an SSH tunnel", file=sys.stderr, flush=True)  # fmt: skip
    print(f"Browsing {root} at http://{host}:{port}/  (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
