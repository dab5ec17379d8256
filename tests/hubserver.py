"""A local stand-in for the Hugging Face Hub, serving one model repo from a directory.

It speaks the part of the Hub's HTTP API that huggingface_hub's `HfApi.model_info`,
`list_repo_tree`, `hf_hub_download` and `snapshot_download` use (checked against
huggingface_hub 2.4):

- `GET /api/models/{repo}[/revision/{rev}][?blobs=true]`: model info with `sha` and
  `siblings` (size, git blob id, LFS sha256/size when `blobs` is asked for);
- `GET /api/models/{repo}/tree/{rev}[/{dir}][?recursive=true]`: the file listing;
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: small files answered in place (ETag = git
  blob id); LFS files redirected (302) to a second listener on another port that
  plays the CDN, with `X-Linked-Etag` (sha256) and `X-Linked-Size`, as the Hub does.
  Every answer carries `X-Repo-Commit`. Bodies honour `Range` (206 + Content-Range).

The repo has one state, read from the directory at each request (so a test can
rewrite a file at any time); its commit id is a hash of the listing, and any
40-hex revision is served that state. The CDN serves a file's current bytes, so a
file changed after it was listed reaches the client changed.

Test knobs: `token` (every Hub request must carry `Authorization: Bearer <token>`,
else 401 GatedRepo), `drop_midway` (a GET of a file sends some bytes, then the
connection is cut; optionally every later request for it answers 503 until
`heal`), `pace` (file bodies are sent in 1 MiB pieces at a set rate, so a download
takes long enough to watch; lifting it speeds up bodies under way), and `requests`, a log of what the client asked.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
LFS_MIN_BYTES = 10 * 1000 * 1000  # the Hub stores any file above 10 MB in LFS
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
PACE_PIECE = 1 << 20  # bytes written between pauses when paced


@dataclass(frozen=True)
class Blob:
    """One file of the served repo, as the Hub describes it."""

    path: str
    """Path inside the repo ('/'-separated)."""
    size: int
    """Bytes."""
    oid: str
    """Git blob id (sha1 of 'blob <size>\\0' + content)."""
    sha256: str | None
    """LFS sha256 of the content, None for a file kept in git."""


@dataclass(frozen=True)
class Seen:
    """One request the server answered."""

    role: str
    """'hub' or 'cdn'."""
    method: str
    """HTTP method."""
    path: str
    """URL path (unquoted), without the query."""
    headers: dict[str, str]
    """Request headers, names lower-cased."""
    status: int
    """Status code answered."""


@dataclass
class _Drop:
    after_bytes: int
    """Body bytes sent before the connection is cut."""
    outage: bool
    """After the cut, answer 503 for this file until heal()."""
    fired: bool = False


@dataclass
class _State:
    root: Path
    repo_id: str
    token: str | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: list[Seen] = field(default_factory=list)
    drops: dict[str, _Drop] = field(default_factory=dict)
    hashes: dict[tuple[str, int, int], Blob] = field(default_factory=dict)
    cdn_url: str = ""
    pace_bps: float | None = None


class HubServer:
    """The fake Hub (plus its CDN) on 127.0.0.1; a context manager that starts and stops both."""

    def __init__(self, root: Path, repo_id: str, token: str | None = None):
        self.state = _State(root=Path(root), repo_id=repo_id, token=token)
        self._hub = _Listener(self.state, "hub")
        self._cdn = _Listener(self.state, "cdn")
        self.state.cdn_url = self._cdn.url

    @property
    def endpoint(self) -> str:
        """What HF_ENDPOINT should be set to."""
        return self._hub.url

    @property
    def requests(self) -> list[Seen]:
        with self.state.lock:
            return list(self.state.requests)

    def blobs(self) -> dict[str, Blob]:
        """The repo's files as currently listed, by path."""
        return {b.path: b for b in _listing(self.state)}

    def commit(self) -> str:
        return _commit(_listing(self.state))

    def drop_midway(self, path: str, after_bytes: int, outage: bool = False) -> None:
        """Cut the next GET of `path` after `after_bytes` body bytes."""
        with self.state.lock:
            self.state.drops[path] = _Drop(after_bytes=after_bytes, outage=outage)

    def pace(self, bytes_per_s: float | None) -> None:
        """Send each file body at most this fast (per request); None: as fast as the socket takes it."""
        with self.state.lock:
            self.state.pace_bps = bytes_per_s

    def heal(self) -> None:
        """Forget every drop and outage."""
        with self.state.lock:
            self.state.drops.clear()

    def content_gets(self, path: str) -> list[Seen]:
        """The GETs that fetched `path`'s bytes (from the Hub or the CDN)."""
        return [r for r in self.requests if r.method == "GET" and r.status in (200, 206) and _served_path(r) == path]

    def unknown_routes(self) -> list[Seen]:
        """Requests this server did not understand (it must speak all the client asks)."""
        return [r for r in self.requests if r.status == 404 and r.headers.get("x-fake-unknown") == "1"]

    def __enter__(self) -> HubServer:
        self._hub.start()
        self._cdn.start()
        return self

    def __exit__(self, *exc) -> None:
        self._hub.stop()
        self._cdn.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return  # the client hung up mid-request (cancelled downloads): not a server fault
        super().handle_error(request, client_address)


class _Listener:
    def __init__(self, state: _State, role: str):
        handler = type(f"{role.title()}Handler", (_Handler,), {"state": state, "role": role})
        self.server = _Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, name=f"fakehub-{role}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _served_path(seen: Seen) -> str | None:
    if seen.role == "cdn":
        return seen.headers.get("x-fake-file")
    parts = seen.path.split("/resolve/", 1)
    return parts[1].split("/", 1)[1] if len(parts) == 2 and "/" in parts[1] else None


def _listing(state: _State) -> list[Blob]:
    blobs = []
    for file in sorted(p for p in state.root.rglob("*") if p.is_file()):
        stat = file.stat()
        rel = file.relative_to(state.root).as_posix()
        key = (rel, stat.st_size, stat.st_mtime_ns)
        with state.lock:
            known = state.hashes.get(key)
        if known is None:
            known = _describe(rel, file.read_bytes())
            with state.lock:
                state.hashes[key] = known
        blobs.append(known)
    return blobs


def _describe(rel: str, data: bytes) -> Blob:
    oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    lfs = rel.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_BYTES
    return Blob(path=rel, size=len(data), oid=oid, sha256=hashlib.sha256(data).hexdigest() if lfs else None)


def _commit(blobs: list[Blob]) -> str:
    return hashlib.sha1("".join(f"{b.path}\0{b.oid}\n" for b in blobs).encode()).hexdigest()


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) inclusive from 'bytes=a-b' or 'bytes=a-'; None for the whole file."""
    if not header:
        return None
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", header.strip())
    if not match:
        raise ValueError(header)
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) else size - 1
    if first > last or first >= size:
        raise ValueError(header)
    return first, min(last, size - 1)


class _Handler(BaseHTTPRequestHandler):
    state: _State
    role: str
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # quiet: tests read `requests` instead
        pass

    def do_HEAD(self) -> None:
        self._dispatch(body=False)

    def do_GET(self) -> None:
        self._dispatch(body=True)

    # -- routing -----------------------------------------------------------

    def _dispatch(self, body: bool) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        self._seen_path = path
        self._extra_seen: dict[str, str] = {}
        if self.role == "cdn":
            return self._cdn(query, body)
        if self.state.token is not None and self.headers.get("Authorization") != f"Bearer {self.state.token}":
            return self._error(
                401, "GatedRepo", f"Access to model {self.state.repo_id} is restricted; you must be authenticated."
            )
        repo = self.state.repo_id
        api = f"/api/models/{repo}"
        if path == api:
            return self._model_info("main", query)
        if path.startswith(api + "/revision/"):
            return self._model_info(path[len(api + "/revision/") :], query)
        if path.startswith(api + "/tree/"):
            rev, _, sub = path[len(api + "/tree/") :].partition("/")
            return self._tree(rev, sub, query)
        if path.startswith(f"/{repo}/resolve/"):
            rev, _, file = path[len(f"/{repo}/resolve/") :].partition("/")
            return self._resolve(rev, file, body)
        if path == "/api/agent-harnesses":  # huggingface_hub's agent registry: absent here, so it caches nothing
            return self._error(404, None, "not served by the fake hub")
        if path.startswith("/api/models/") or path.startswith(f"/{repo.split('/')[0]}/"):
            return self._error(404, "RepoNotFound", "Repository not found")
        return self._error(404, None, "no such route in the fake hub", unknown=True)

    def _revision(self, rev: str) -> str | None:
        """The commit a revision names, or None (answered 404) when unknown."""
        commit = _commit(_listing(self.state))
        if rev == "main" or _COMMIT.fullmatch(rev):
            return rev if _COMMIT.fullmatch(rev) else commit
        self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return None

    # -- API ---------------------------------------------------------------

    def _model_info(self, rev: str, query: dict) -> None:
        commit = self._revision(rev)
        if commit is None:
            return
        blobs = _listing(self.state)
        siblings = []
        for b in blobs:
            item: dict = {"rfilename": b.path}
            if query.get("blobs") == ["True"] or query.get("blobs") == ["true"]:
                item |= {"size": b.size, "blobId": b.oid}
                if b.sha256 is not None:
                    item["lfs"] = {"size": b.size, "sha256": b.sha256, "pointerSize": 134}
            siblings.append(item)
        repo = self.state.repo_id
        info = {
            "_id": hashlib.md5(repo.encode()).hexdigest()[:24],
            "id": repo,
            "modelId": repo,
            "author": repo.split("/")[0],
            "sha": commit,
            "private": False,
            "gated": False,
            "disabled": False,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "tags": [],
            "library_name": "transformers",
            "siblings": siblings,
        }
        self._json(200, info, commit)

    def _tree(self, rev: str, sub: str, query: dict) -> None:
        commit = self._revision(rev)
        if commit is None:
            return
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        prefix = f"{sub.strip('/')}/" if sub.strip("/") else ""
        entries, dirs = [], set()
        for b in _listing(self.state):
            if not b.path.startswith(prefix):
                continue
            rest = b.path[len(prefix) :]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/", 1)[0])
                continue
            parent = b.path.rsplit("/", 1)[0] if "/" in b.path else ""
            while parent and parent + "/" != prefix and parent.startswith(prefix):
                dirs.add(parent)
                parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
            entry: dict = {"type": "file", "oid": b.oid, "size": b.size, "path": b.path}
            if b.sha256 is not None:
                entry["lfs"] = {"oid": b.sha256, "size": b.size, "pointerSize": 134}
            entries.append(entry)
        folders = [
            {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
            for d in sorted(dirs)
        ]
        self._json(200, folders + entries, commit)

    # -- files ---------------------------------------------------------------

    def _resolve(self, rev: str, file: str, body: bool) -> None:
        commit = self._revision(rev)
        if commit is None:
            return
        blob = next((b for b in _listing(self.state) if b.path == file), None)
        if blob is None:
            return self._error(404, "EntryNotFound", f"{file} does not exist on {rev}", commit=commit)
        if self._in_outage(file):
            return self._error(503, None, "temporarily unavailable", commit=commit)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{blob.oid}"'}
        if blob.sha256 is not None:
            location = f"{self.state.cdn_url}/repos/{blob.sha256}?file={quote(file)}"
            headers |= {"Location": location, "X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(blob.size)}
            return self._reply(302, headers, b"", body)
        self._send_file(file, headers, body)

    def _cdn(self, query: dict, body: bool) -> None:
        file = query.get("file", [""])[0]
        self._extra_seen["x-fake-file"] = file
        if not file or not (self.state.root / file).is_file():
            return self._error(404, None, "no such object")
        if self._in_outage(file):
            return self._error(503, None, "temporarily unavailable")
        self._send_file(file, {}, body)

    def _send_file(self, file: str, headers: dict[str, str], body: bool) -> None:
        data = (self.state.root / file).read_bytes()
        try:
            span = _parse_range(self.headers.get("Range"), len(data))
        except ValueError:
            return self._reply(416, headers | {"Content-Range": f"bytes */{len(data)}"}, b"", body)
        status = 200
        if span is not None:
            status = 206
            headers = headers | {"Content-Range": f"bytes {span[0]}-{span[1]}/{len(data)}"}
            data = data[span[0] : span[1] + 1]
        headers = headers | {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        drop = self._take_drop(file) if body else None
        if drop is not None:
            return self._reply_and_cut(status, headers, data, drop.after_bytes)
        self._reply(status, headers, data, body, paced=True)

    def _take_drop(self, file: str) -> _Drop | None:
        with self.state.lock:
            drop = self.state.drops.get(file)
            if drop is None or drop.fired:
                return None
            drop.fired = True
            if not drop.outage:
                del self.state.drops[file]
            return drop

    def _in_outage(self, file: str) -> bool:
        with self.state.lock:
            drop = self.state.drops.get(file)
            return drop is not None and drop.fired and drop.outage

    # -- replies -------------------------------------------------------------

    def _json(self, status: int, payload, commit: str) -> None:
        data = json.dumps(payload).encode()
        self._reply(status, {"Content-Type": "application/json", "X-Repo-Commit": commit}, data, True)

    def _error(
        self, status: int, code: str | None, message: str, commit: str | None = None, unknown: bool = False
    ) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        if unknown:
            self._extra_seen["x-fake-unknown"] = "1"
        self._reply(status, headers, json.dumps({"error": message}).encode(), self.command != "HEAD")

    def _record(self, status: int) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()} | self._extra_seen
        with self.state.lock:
            self.state.requests.append(Seen(self.role, self.command, self._seen_path, headers, status))

    def _reply(self, status: int, headers: dict[str, str], data: bytes, body: bool, paced: bool = False) -> None:
        self._record(status)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not (body and data):
            return
        for start in range(0, len(data), PACE_PIECE):
            rate = self.state.pace_bps if paced else None  # read a piece at a time: a test may lift the pace midway
            if not rate:
                self.wfile.write(data[start:])
                return
            piece = data[start : start + PACE_PIECE]
            self.wfile.write(piece)
            self.wfile.flush()
            time.sleep(len(piece) / rate)

    def _reply_and_cut(self, status: int, headers: dict[str, str], data: bytes, after_bytes: int) -> None:
        """Promise the whole body, send part of it, then close the socket."""
        self._record(status)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[:after_bytes])
        self.wfile.flush()
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
