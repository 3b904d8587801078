"""Results store: one embedded SQLite database of evaluations keyed by their identity (SPEC §9).

An *evaluation identity* is ``(config_hash, protocol, protocol_hash, dataset, split, depth, seed, tag)``:
``config_hash`` hashes the run config without the fields that leave the trained weights unchanged
(:func:`config_identity`); ``protocol_hash`` the protocol name and the settings that change the numbers;
``depth`` is the loop depth T (``diagnose``: the loop step t). Each identity holds one set of metrics, replaced
in one transaction, so a re-run never double-counts a seed. Several writer processes are safe (WAL mode, busy
timeout, ``BEGIN IMMEDIATE``). Schema: :data:`_SCHEMA`; ``provenance`` (added to older files by ``CREATE TABLE IF
NOT EXISTS``) holds each evaluation's :func:`looplm.run.provenance.provenance`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from looplm.config import DepthConfig, build_choice

SCHEMA_VERSION = 1

#: config fields left out of the evaluation identity: they do not change the trained weights (or,
#: for ``train.seed``, are an identity column of their own).
NON_IDENTITY_FIELDS: dict[str, tuple[str, ...]] = {
    "train": ("seed", "device", "num_threads", "eval_every", "eval_batches", "eval_depth", "ckpt_every",
              "checkpoint_format", "max_nonfinite_steps", "logger"),
    "data": ("data_root", "cache_dir"),
}

#: ``data`` fields read only by one dataset; left out of the identity of the others (so configs hash as they
#: did before these fields existed)
DATASET_FIELDS: dict[str, tuple[str, ...]] = {"hf": ("hf_path", "hf_name", "hf_splits", "text_column"),
                                              "task": ("task", "task_k", "task_heldout", "task_seed")}

IDENTITY_COLUMNS: tuple[str, ...] = ("config_hash", "protocol", "protocol_hash", "dataset", "split", "depth",
                                     "seed", "tag")
_WHERE = " AND ".join(f"{col} = ?" for col in IDENTITY_COLUMNS)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS configs (config_hash TEXT PRIMARY KEY, config_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS protocols (protocol_hash TEXT PRIMARY KEY, protocol TEXT NOT NULL,
                                      settings_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS evaluations (
    config_hash TEXT NOT NULL, protocol TEXT NOT NULL, protocol_hash TEXT NOT NULL,
    dataset TEXT NOT NULL, split TEXT NOT NULL, depth INTEGER NOT NULL, seed INTEGER NOT NULL,
    tag TEXT NOT NULL, metric TEXT NOT NULL, value REAL, updated_at REAL NOT NULL,
    PRIMARY KEY (config_hash, protocol, protocol_hash, dataset, split, depth, seed, tag, metric)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS runs (
    sweep TEXT NOT NULL, run_id TEXT NOT NULL, variant TEXT NOT NULL, variant_order INTEGER NOT NULL,
    grid_json TEXT NOT NULL, seed INTEGER NOT NULL, config_hash TEXT NOT NULL, config_json TEXT NOT NULL,
    params INTEGER, flops_json TEXT NOT NULL, run_dir TEXT NOT NULL, weights_sha256 TEXT,
    summary_json TEXT NOT NULL, updated_at REAL NOT NULL,
    PRIMARY KEY (sweep, run_id)
);
CREATE TABLE IF NOT EXISTS provenance (
    config_hash TEXT NOT NULL, protocol TEXT NOT NULL, protocol_hash TEXT NOT NULL,
    dataset TEXT NOT NULL, split TEXT NOT NULL, depth INTEGER NOT NULL, seed INTEGER NOT NULL,
    tag TEXT NOT NULL, provenance_json TEXT NOT NULL,
    PRIMARY KEY (config_hash, protocol, protocol_hash, dataset, split, depth, seed, tag)
) WITHOUT ROWID;
"""

#: the tables a file must hold to be read as a looplm results database (``provenance`` is optional: older files)
REQUIRED_TABLES: tuple[str, ...] = ("meta", "configs", "protocols", "evaluations", "runs")


def canonical_json(obj: Any) -> str:
    """The JSON text that is hashed and stored: sorted keys, no spaces (NaN kept as ``NaN``)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _config_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise TypeError(f"config: expected a looplm Config or its dict, got {type(config).__name__}")


def config_identity(config: Any) -> dict[str, Any]:
    """The part of a run config (``Config`` or its dict) that defines the trained model: without ``name``,
    :data:`NON_IDENTITY_FIELDS` and other datasets' :data:`DATASET_FIELDS`; a post-LN ``residual_depth`` of 0
    resolved to the depth sampler's maximum (as the model builder does)."""
    d = _config_dict(config)
    d.pop("name", None)
    for section, names in NON_IDENTITY_FIELDS.items():
        for name in names:
            d.get(section, {}).pop(name, None)
    model = d.get("model", {})
    if isinstance(model, dict) and model.get("residual", "pre_ln") != "pre_ln" and model.get("residual_depth") == 0:
        # N = K·R as the model builder resolves it (looplm.model.build_model): the same model either way
        model["residual_depth"] = build_choice(DepthConfig, d["depth"]).max_depth()
    data = d.get("data", {})
    for dataset, names in DATASET_FIELDS.items():
        if isinstance(data, dict) and data.get("dataset") != dataset:
            for name in names:
                data.pop(name, None)
    return d


def config_hash(config: Any) -> str:
    """sha256 (64 hex chars) of the canonical JSON of :func:`config_identity`."""
    return _sha256(canonical_json(config_identity(config)))


def protocol_hash(protocol: str, settings: Mapping[str, Any] | None = None) -> str:
    """sha256 (64 hex chars) of the protocol name and its (JSON-serializable) settings."""
    return _sha256(canonical_json({"protocol": protocol, "settings": dict(settings or {})}))


@dataclass(frozen=True)
class EvalIdentity:
    """The key of one stored evaluation (SPEC §9). Build it with :meth:`make`."""

    config_hash: str
    protocol: str
    protocol_hash: str
    dataset: str
    split: str
    depth: int
    seed: int
    tag: str = ""

    @classmethod
    def make(cls, config: Any, protocol: str, *, dataset: str, split: str, depth: int,
             settings: Mapping[str, Any] | None = None, seed: int | None = None,
             tag: str = "") -> "EvalIdentity":
        """Identity of evaluating ``config`` (seed from ``config.train.seed`` unless given)."""
        if seed is None:
            seed = int(_config_dict(config)["train"]["seed"])
        return cls(config_hash=config_hash(config), protocol=protocol,
                   protocol_hash=protocol_hash(protocol, settings), dataset=dataset, split=split,
                   depth=int(depth), seed=int(seed), tag=tag)

    def as_tuple(self) -> tuple:
        return tuple(getattr(self, c) for c in IDENTITY_COLUMNS)


@dataclass
class RunRecord:
    """Per-run metadata (one row of ``runs``), keyed by (sweep, run_id); ``flops``: depth →
    ``{"body", "body_head"}`` FLOPs/token (SCSE eq. 20–21); ``grid``: ``{"section.field": value}``."""

    sweep: str
    run_id: str
    variant: str
    seed: int
    config: dict[str, Any]
    run_dir: str
    variant_order: int = 0
    grid: dict[str, Any] = field(default_factory=dict)
    params: int | None = None
    flops: dict[int, dict[str, int]] = field(default_factory=dict)
    weights_sha256: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def config_hash(self) -> str:
        return config_hash(self.config)


class ResultStoreError(ValueError):
    """The results database cannot be used (not SQLite, damaged, or locked too long); names the file."""


def _put_config(c: sqlite3.Connection, config: Any) -> str:
    identity = canonical_json(config_identity(config))
    c.execute("INSERT OR REPLACE INTO configs VALUES (?, ?)", (_sha256(identity), identity))
    return _sha256(identity)


def _float(v: Any) -> float:
    return math.nan if v is None else float(v)


class ResultStore:
    """The SQLite results database at ``path`` (created with its schema when missing); a context manager.

    Every public write is one transaction (a write that fails midway leaves the database as it was).
    ``readonly=True`` opens an existing file with SQLite ``mode=ro`` after checking its tables and schema
    version. ResultStoreError (naming the file): not SQLite, damaged (found on opening or by any later read or
    write), no looplm tables, or locked past ``timeout`` seconds; ValueError: another schema version.
    """

    def __init__(self, path: str | Path, *, timeout: float = 60.0, readonly: bool = False) -> None:
        self.path = Path(path)
        self.timeout = timeout
        if readonly:
            if not self.path.is_file():
                raise FileNotFoundError(f"{self.path}: the results database does not exist")
            self._conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=self.timeout,
                                         isolation_level=None)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(self.path), timeout=timeout, isolation_level=None)
        try:
            self._check_readonly() if readonly else self._create()
        except sqlite3.DatabaseError as exc:  # e.g. "file is not a database"
            self._conn.close()
            raise self._error(exc) from None
        except BaseException:
            self._conn.close()
            raise

    def _create(self) -> None:
        self._conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        self._retry(lambda: self._conn.execute("PRAGMA journal_mode = WAL"))
        self._conn.execute("PRAGMA synchronous = NORMAL")
        with self._write() as c:
            # one statement at a time: executescript() would commit the open transaction
            for stmt in filter(str.strip, _SCHEMA.split(";")):
                c.execute(stmt)
            c.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            self._check_version()

    def _check_readonly(self) -> None:
        tables = {r[0] for r in self._rows("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if missing := [t for t in REQUIRED_TABLES if t not in tables]:
            raise ResultStoreError(f"{self.path}: not a looplm results database (no table "
                                   f"{', '.join(missing)}); give the results.db written by `looplm sweep`")
        self._check_version()

    def _check_version(self) -> None:
        row = next(iter(self._rows("SELECT value FROM meta WHERE key = 'schema_version'")), None)
        if row is None or row[0] != str(SCHEMA_VERSION):
            raise ValueError(f"{self.path}: schema_version {row[0] if row else 'missing'}; this looplm reads "
                             f"{SCHEMA_VERSION}")

    # -- plumbing ---------------------------------------------------------------------------------
    def _retry(self, fn):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _rows(self, sql: str, args: Iterable[Any] = ()) -> list[tuple]:
        """Every row of the query ``sql``: each read goes through here, so that a damaged page, which SQLite finds
        only when a query reads it, leaves as :class:`ResultStoreError` naming the file."""
        try:
            return self._conn.execute(sql, tuple(args)).fetchall()
        except sqlite3.DatabaseError as exc:
            raise self._error(exc) from exc

    @contextlib.contextmanager
    def _write(self):
        """One ``BEGIN IMMEDIATE`` … ``COMMIT`` transaction, rolled back on any exception (KeyboardInterrupt
        too); SQLite errors leave as :class:`ResultStoreError` naming the file."""
        try:
            self._retry(lambda: self._conn.execute("BEGIN IMMEDIATE"))
        except sqlite3.DatabaseError as exc:
            raise self._error(exc) from exc
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException as exc:
            if self._conn.in_transaction:
                try:
                    self._conn.execute("ROLLBACK")
                except sqlite3.Error:  # a damaged file can fail this too; report the first error
                    if not isinstance(exc, sqlite3.DatabaseError):
                        raise
            if isinstance(exc, sqlite3.DatabaseError):
                raise self._error(exc) from exc
            raise

    def _error(self, exc: sqlite3.DatabaseError) -> ResultStoreError:
        msg = str(exc)
        if "locked" in msg or "busy" in msg:
            return ResultStoreError(f"{self.path}: the results database stayed locked for more than "
                                    f"{self.timeout:g} s ({msg}); another process is writing it")
        return ResultStoreError(f"{self.path}: not a usable looplm results database ({msg}); give the path of "
                                "a results.db written by `looplm sweep`, or move the damaged file aside")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rehash(self) -> int:
        """Re-key every config hash that today's :func:`config_identity` hashes differently, with its
        evaluations and runs (a row already under the new hash wins); returns how many. Idempotent."""
        rows = self._rows("SELECT config_hash, config_json FROM configs")
        moves = [(old, config_hash(json.loads(text)), json.loads(text)) for old, text in rows]
        moves = [(old, new, identity) for old, new, identity in moves if new != old]
        if not moves:
            return 0
        with self._write() as c:
            for old, new, identity in moves:
                c.execute("UPDATE OR IGNORE evaluations SET config_hash = ? WHERE config_hash = ?", (new, old))
                c.execute("DELETE FROM evaluations WHERE config_hash = ?", (old,))  # the ignored duplicates
                c.execute("UPDATE OR IGNORE provenance SET config_hash = ? WHERE config_hash = ?", (new, old))
                c.execute("DELETE FROM provenance WHERE config_hash = ?", (old,))
                c.execute("UPDATE runs SET config_hash = ? WHERE config_hash = ?", (new, old))
                c.execute("DELETE FROM configs WHERE config_hash = ?", (old,))
                _put_config(c, identity)
        return len(moves)

    # -- evaluations ------------------------------------------------------------------------------
    def put_many(self, items: Iterable[tuple[EvalIdentity, Mapping[str, float]]], *, config: Any = None,
                 settings: Mapping[str, Any] | None = None, provenance: Mapping[str, Any] | None = None) -> int:
        """Store each ``(identity, metrics)`` (NaN as NULL), replacing what it held (its provenance too), in one
        transaction; returns how many. ValueError: an empty metric set, or ``config`` / ``settings`` not hashing
        to an identity's hashes."""
        items = [(ident, dict(m)) for ident, m in items]
        now = time.time()
        with self._write() as c:
            chash = _put_config(c, config) if config is not None else None
            for ident, metrics in items:
                if not metrics:
                    raise ValueError(f"metrics: empty metric set for {ident}")
                if chash is not None and ident.config_hash != chash:
                    raise ValueError(f"config: hashes to {chash[:12]}, identity has {ident.config_hash[:12]}")
                if settings is not None:
                    phash = protocol_hash(ident.protocol, settings)
                    if phash != ident.protocol_hash:
                        raise ValueError(f"settings: hash to {phash[:12]} for protocol {ident.protocol!r}, "
                                         f"identity has {ident.protocol_hash[:12]}")
                    c.execute("INSERT OR REPLACE INTO protocols VALUES (?, ?, ?)",
                              (phash, ident.protocol, canonical_json(dict(settings))))
                names = sorted(metrics)
                c.execute(f"DELETE FROM evaluations WHERE {_WHERE} AND metric NOT IN "
                          f"({', '.join('?' * len(names))})", (*ident.as_tuple(), *names))
                c.executemany(
                    f"INSERT INTO evaluations ({', '.join(IDENTITY_COLUMNS)}, metric, value, updated_at) "
                    f"VALUES ({', '.join('?' * (len(IDENTITY_COLUMNS) + 3))}) "
                    f"ON CONFLICT ({', '.join(IDENTITY_COLUMNS)}, metric) "  # UPSERT, SQLite >= 3.24
                    "DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
                    [(*ident.as_tuple(), name, _none_if_nan(metrics[name]), now) for name in names])
                c.execute(f"DELETE FROM provenance WHERE {_WHERE}", ident.as_tuple())
                if provenance is not None:
                    c.execute("INSERT INTO provenance VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                              (*ident.as_tuple(), canonical_json(dict(provenance))))
        return len(items)

    def provenance(self, identity: EvalIdentity) -> dict[str, Any] | None:
        """The provenance stored with ``identity`` (None when none was)."""
        return self._json(f"SELECT provenance_json FROM provenance WHERE {_WHERE}", identity.as_tuple())

    def get(self, identity: EvalIdentity) -> dict[str, float]:
        """The metrics stored for ``identity`` (empty dict when none)."""
        rows = self._rows(f"SELECT metric, value FROM evaluations WHERE {_WHERE}", identity.as_tuple())
        return {m: _float(v) for m, v in rows}

    def has(self, identity: EvalIdentity, metrics: Iterable[str] = ()) -> bool:
        """Whether ``identity`` is stored (and holds every name in ``metrics``)."""
        got = self.get(identity)
        return bool(got) and all(m in got for m in metrics)

    def _filters(self, filters: Mapping[str, Any]) -> tuple[str, list]:
        allowed = (*IDENTITY_COLUMNS, "metric")
        if unknown := sorted(set(filters) - set(allowed)):
            raise ValueError(f"{unknown[0]}: unknown filter; allowed: {', '.join(allowed)}")
        parts = [f"{k} = ?" for k in filters]
        return (" WHERE " + " AND ".join(parts)) if parts else "", list(filters.values())

    def evaluations(self, **filters: Any) -> list[dict[str, Any]]:
        """Rows (identity columns, ``metric``, ``value`` (NaN for NULL), ``updated_at``) matching ``column=value``
        filters over the identity columns and ``metric`` (ValueError for another)."""
        where, args = self._filters(filters)
        cols = [*IDENTITY_COLUMNS, "metric", "value", "updated_at"]
        rows = self._rows(f"SELECT {', '.join(cols)} FROM evaluations{where} "
                          f"ORDER BY {', '.join(IDENTITY_COLUMNS)}, metric", args)
        return [{**dict(zip(cols, row)), "value": _float(row[cols.index("value")])} for row in rows]

    def count(self, **filters: Any) -> int:
        """Number of stored (identity, metric) rows matching the filters."""
        where, args = self._filters(filters)
        return int(self._rows(f"SELECT COUNT(*) FROM evaluations{where}", args)[0][0])

    def delete(self, **filters: Any) -> int:
        """Delete the rows matching the filters (at least one filter). Returns the rows deleted."""
        if not filters:
            raise ValueError("delete: give at least one filter (refusing to empty the store)")
        where, args = self._filters(filters)
        with self._write() as c:
            return c.execute(f"DELETE FROM evaluations{where}", args).rowcount

    def config(self, config_hash: str) -> dict[str, Any] | None:
        """The identity JSON stored for ``config_hash`` (None when unknown)."""
        return self._json("SELECT config_json FROM configs WHERE config_hash = ?", (config_hash,))

    def protocol_settings(self, protocol_hash: str) -> dict[str, Any] | None:
        """The settings stored for ``protocol_hash`` (None when unknown)."""
        return self._json("SELECT settings_json FROM protocols WHERE protocol_hash = ?", (protocol_hash,))

    def _json(self, sql: str, args: tuple) -> Any:
        rows = self._rows(sql, args)
        return json.loads(rows[0][0]) if rows else None

    # -- runs -------------------------------------------------------------------------------------
    def put_run(self, run: RunRecord) -> None:
        """Insert or replace the metadata of ``run`` (keyed by sweep and run id)."""
        with self._write() as c:
            chash = _put_config(c, run.config)
            c.execute("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (run.sweep, run.run_id, run.variant, run.variant_order, canonical_json(run.grid), run.seed,
                       chash, canonical_json(run.config), run.params,
                       canonical_json({str(k): v for k, v in run.flops.items()}), run.run_dir, run.weights_sha256,
                       canonical_json(run.summary), time.time()))

    def runs(self, sweep: str | None = None) -> list[RunRecord]:
        """Stored runs (of one sweep, or all), ordered by sweep, variant order, run id."""
        sql = ("SELECT sweep, run_id, variant, variant_order, grid_json, seed, config_json, params, flops_json, "
               "run_dir, weights_sha256, summary_json FROM runs" + (" WHERE sweep = ?" if sweep is not None else ""))
        args = (sweep,) if sweep is not None else ()
        rows = self._rows(sql + " ORDER BY sweep, variant_order, run_id", args)
        return [RunRecord(sweep=sw, run_id=rid, variant=var, variant_order=order, grid=json.loads(grid), seed=seed,
                          config=json.loads(cfg), params=params, run_dir=run_dir, weights_sha256=sha,
                          flops={int(k): v for k, v in json.loads(flops).items()}, summary=json.loads(summary))
                for (sw, rid, var, order, grid, seed, cfg, params, flops, run_dir, sha, summary) in rows]

    def run(self, sweep: str, run_id: str) -> RunRecord | None:
        """One stored run (None when missing)."""
        return next((r for r in self.runs(sweep) if r.run_id == run_id), None)


def _none_if_nan(v: Any) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v
