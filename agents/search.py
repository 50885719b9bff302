"""A local retriever for the search tool: BM25 (the `bm25s` package) over a corpus file of passages.

The corpus is JSON lines, one passage per line: `{"text": ...}` with an
optional `"title"` and `"id"` (default: the line number). Title and text are
indexed together, tokenised by bm25s's tokenizer (lower case, words of two or
more characters, its English stopword list; no stemmer, so nothing is
downloaded or installed beyond bm25s itself).

The index is built once and kept beside the corpus, in `CORPUS.bm25s/` (or
under `SearchConfig.cache_dir`): bm25s's own files plus `manifest.json` with
the corpus's sha256 and size, the tokenizer settings and the bm25s version. A
later load whose corpus or settings differ builds the index again. The cache
is written into a temporary folder and renamed into place, so a crash never
leaves a half-written index that looks complete; where the folder cannot be
written the index is built in memory, with a warning, every time.

The passages themselves are read from the corpus on every load (the sha256
is taken in the same pass): the retriever holds them in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

STOPWORDS = "en"  # bm25s's built-in English list: offline
MANIFEST = "manifest.json"


class SearchConfig(BaseModel):
    """What the search tool searches and how much of it the agent reads."""

    model_config = ConfigDict(extra="forbid")

    corpus: str | None = Field(None, description="passages to search: JSON lines, one passage per line with 'text' "
                               "and optional 'title' and 'id' (needed by --env.tools search)")  # fmt: skip
    top_k: int = Field(3, ge=1, le=50, description="passages returned per search")
    observation_chars: int = Field(3000, ge=200, description="characters of passages the agent reads per search; "
                                   "past it the rest is cut")  # fmt: skip
    cache_dir: str | None = Field(None, description="folder for the BM25 index; default: CORPUS.bm25s/ beside the "
                                  "corpus")  # fmt: skip


class CorpusError(ValueError):
    """The corpus cannot be used; the message is one line naming the file (and line)."""


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str


def read_corpus(path: str | os.PathLike) -> tuple[list[Passage], str, int]:
    """(passages, sha256 of the file, its size in bytes); CorpusError for a file that is not a corpus."""
    path = Path(path).expanduser()
    digest, size, passages = hashlib.sha256(), 0, []
    try:
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                digest.update(raw)
                size += len(raw)
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except ValueError:
                    raise CorpusError(f"{path} line {number}: not JSON; one passage per line, "
                                      '{"text": ..., "title": ..., "id": ...}') from None  # fmt: skip
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise CorpusError(f"{path} line {number}: a passage needs a 'text' string")
                title = row.get("title") or ""
                passages.append(Passage(str(row.get("id", number)), str(title), row["text"]))
    except OSError as exc:
        raise CorpusError(f"{path}: {exc.strerror or exc}") from None
    if not passages:
        raise CorpusError(f"{path} holds no passages")
    return passages, digest.hexdigest(), size


def _tokenize(texts: list[str], return_ids: bool = True):
    """bm25s's tokenizer with the settings the index is built with (the manifest records them)."""
    import bm25s

    return bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=return_ids, show_progress=False)


class Retriever:
    """BM25 over a list of passages; `search(query, k)` -> [(passage, score)], best first."""

    def __init__(self, passages: list[Passage], index, built: bool):
        self.passages = passages
        self.index = index  # a bm25s.BM25
        self.built = built  # True: the index was built by this load (not read from the cache)
        self._lock = threading.Lock()  # tool calls run in worker threads

    @classmethod
    def from_corpus(cls, corpus: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Retriever:
        """Read the corpus and its index from the cache, building (and caching) the index if it is missing or
        stale. CorpusError for a corpus that cannot be used."""
        import bm25s

        corpus = Path(corpus).expanduser()
        passages, sha256, size = read_corpus(corpus)
        manifest = {"corpus_sha256": sha256, "corpus_bytes": size, "passages": len(passages),
                    "stopwords": STOPWORDS, "stemmer": None, "bm25s": bm25s.__version__}  # fmt: skip
        folder = Path(cache_dir).expanduser() if cache_dir else corpus.with_name(corpus.name + ".bm25s")
        try:
            if json.loads((folder / MANIFEST).read_text(encoding="utf-8")) == manifest:
                return cls(passages, bm25s.BM25.load(str(folder), show_progress=False), built=False)
        except (OSError, ValueError):
            pass  # no cache, or one that cannot be read: build it
        index = bm25s.BM25()
        index.index(_tokenize([f"{p.title}\n{p.text}" if p.title else p.text for p in passages]), show_progress=False)
        try:
            _save(index, manifest, folder)
        except OSError as exc:
            log.warning(
                "search: cannot keep the BM25 index in %s (%s); it is built in memory on every load. "
                "Set --env.search.cache_dir to a writable folder to keep it.",
                folder,
                exc.strerror or exc,
            )
        return cls(passages, index, built=True)

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]:
        """The best `k` passages that share a word with the query, best first (fewer if fewer match)."""
        words = _tokenize([query], return_ids=False)
        if not words[0]:
            return []  # only stopwords, punctuation or one-letter words
        with self._lock:
            ids, scores = self.index.retrieve(words, k=min(k, len(self.passages)), show_progress=False)
        return [(self.passages[int(i)], round(float(s), 4)) for i, s in zip(ids[0], scores[0]) if s > 0]


def _save(index, manifest: dict, folder: Path) -> None:
    """Write the index and its manifest into a temporary folder beside `folder`, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        index.save(str(tmp), show_progress=False)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")  # last: marks it complete
        if folder.exists():  # a stale index: move it aside first (a folder cannot be renamed onto another)
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
            os.rename(folder, old / "index")
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@lru_cache(maxsize=4)
def _load_cached(corpus: str, cache_dir: str | None, size: int, mtime_ns: int) -> Retriever:
    return Retriever.from_corpus(corpus, cache_dir)


def load_retriever(corpus: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Retriever:
    """`Retriever.from_corpus`, once per process for an unchanged corpus file (train and test environments,
    preflight and the run share it)."""
    path = Path(corpus).expanduser().resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise CorpusError(f"{path}: {exc.strerror or exc}") from None
    return _load_cached(str(path), str(cache_dir) if cache_dir else None, stat.st_size, stat.st_mtime_ns)
