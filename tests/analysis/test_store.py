"""Results store: evaluation identity (SPEC §9), replace-not-append, concurrent writers."""

from __future__ import annotations

import math
import multiprocessing as mp

import pytest

from looplm.analysis.store import (EvalIdentity, ResultStore, RunRecord, config_hash, config_identity,
                                   protocol_hash)
from looplm.config import Config


def _ident(depth=8, seed=0, protocol="ppl", settings=None, tag="", dataset="brown", split="test"):
    return EvalIdentity.make(Config(), protocol, dataset=dataset, split=split, depth=depth,
                             settings=settings or {"max_tokens": None}, seed=seed, tag=tag)


def test_config_hash_ignores_name_seed_and_device_but_not_the_model():
    base = Config()
    h = config_hash(base)
    assert len(h) == 64
    assert config_hash(base.replace(name="other")) == h
    assert config_hash(base.replace(train=base.train.replace(seed=7, device="cuda", ckpt_every=3))) == h
    assert config_hash(base.to_dict()) == h  # a Config and its dict hash alike
    assert config_hash(base.replace(model=base.model.replace(rule="looped"))) != h
    assert config_hash(base.replace(optim=base.optim.replace(lr=1e-3))) != h
    assert "seed" not in config_identity(base)["train"] and "name" not in config_identity(base)
    assert protocol_hash("ppl", {"max_tokens": 10}) != protocol_hash("ppl", {"max_tokens": 20})
    assert protocol_hash("ppl", {"a": 1, "b": 2}) == protocol_hash("ppl", {"b": 2, "a": 1})
    seeded = base.replace(train=base.train.replace(seed=3))
    assert EvalIdentity.make(seeded, "ppl", dataset="brown", split="test", depth=8).seed == 3


def test_put_replaces_and_never_double_counts(tmp_path):
    with ResultStore(tmp_path / "r.db") as store:
        a = _ident()
        store.put_many([(a, {"ppl": 100.0, "nll": math.log(100.0)})], config=Config(), settings={"max_tokens": None})
        store.put_many([(a, {"ppl": 90.0, "nll": math.log(90.0)})])
        assert store.count() == 2
        assert store.get(a) == {"ppl": 90.0, "nll": math.log(90.0)}
        # a re-run with fewer metrics replaces the whole set (stale metrics dropped)
        store.put_many([(a, {"ppl": 80.0})])
        assert store.get(a) == {"ppl": 80.0} and store.count() == 1
        # every identity column separates evaluations
        others = [_ident(depth=16), _ident(seed=1), _ident(tag="v2"), _ident(split="valid"),
                  _ident(dataset="wikitext2"), _ident(settings={"max_tokens": 512}), _ident(protocol="lambada")]
        for i, ident in enumerate(others):
            store.put_many([(ident, {"ppl": float(i)})])
        assert store.count() == 1 + len(others)
        # a, depth 16, seed 1 and max_tokens 512 (another protocol hash)
        assert store.count(protocol="ppl", dataset="brown", split="test", tag="") == 4
        assert store.count(protocol="ppl", protocol_hash=a.protocol_hash, dataset="brown", split="test",
                           tag="") == 3
        assert store.has(a, ["ppl"]) and not store.has(a, ["nll"])
        assert not store.has(_ident(depth=99))
        store.put_many([(_ident(depth=32), {"ppl": float("nan")})])  # NaN round-trips through NULL
        assert math.isnan(store.get(_ident(depth=32))["ppl"])
        assert store.config(a.config_hash) == config_identity(Config())
        assert store.protocol_settings(a.protocol_hash) == {"max_tokens": None}
        assert store.delete(depth=32) == 1
        with pytest.raises(ValueError, match="unknown filter"):
            store.count(variant="x")
        with pytest.raises(ValueError, match="settings"):
            store.put_many([(a, {"ppl": 1.0})], settings={"max_tokens": 5})
    with ResultStore(tmp_path / "r.db") as store:  # reopen: persisted, WAL mode
        assert store.get(a) == {"ppl": 80.0}
        assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_runs_roundtrip(tmp_path):
    cfg = Config()
    rec = RunRecord(sweep="s", run_id="looped-s0", variant="looped", seed=0, config=cfg.to_dict(), run_dir="/x",
                    variant_order=1, grid={"optim.lr": 0.001}, params=123,
                    flops={8: {"body": 1, "body_head": 2}}, weights_sha256="ab", summary={"val_ppl": 3.0})
    with ResultStore(tmp_path / "r.db") as store:
        store.put_run(rec)
        store.put_run(rec)  # replace, not append
        runs = store.runs()
        assert len(runs) == 1 and runs[0] == rec
        assert store.run("s", "looped-s0").config_hash == config_hash(cfg)
        assert store.run("s", "nope") is None


N_IDS, OVERLAP, METRICS = 60, 30, ("ppl", "nll", "tokens")


def _writer(path: str, writer: int, barrier) -> None:
    """Write identities [writer·(N−OVERLAP), +N) one transaction each; every metric = the writer id."""
    store = ResultStore(path, timeout=60)
    barrier.wait()
    start = writer * (N_IDS - OVERLAP)
    for i in range(start, start + N_IDS):
        store.put_many([(_ident(depth=i), {m: float(writer) for m in METRICS})])
    store.close()


def test_two_processes_write_overlapping_identities(tmp_path):
    path = str(tmp_path / "concurrent.db")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(path, w, barrier)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with ResultStore(path) as store:
        n_ids = 2 * N_IDS - OVERLAP
        assert store.count() == n_ids * len(METRICS)
        rows = store.evaluations()
        assert len({r["depth"] for r in rows}) == n_ids
        by_depth: dict[int, set] = {}
        for r in rows:
            by_depth.setdefault(r["depth"], set()).add(r["value"])
        # each identity's metric set comes whole from one writer (puts are atomic)
        assert all(len(v) == 1 for v in by_depth.values())
        assert by_depth[0] == {0.0} and by_depth[2 * N_IDS - OVERLAP - 1] == {1.0}


def test_identity_resolves_the_post_ln_residual_depth():
    """A post-LN model with residual_depth = 0 is the model with R = the depth sampler's maximum (as
    build_model resolves it), so both spellings share one identity; another R is another model."""
    from looplm.config import FixedDepthConfig, ModelConfig

    def cfg(R):
        return Config(model=ModelConfig(rule="plain", residual="deeploop", residual_depth=R), depth=FixedDepthConfig(depth=3))

    assert config_hash(cfg(0)) == config_hash(cfg(3)) != config_hash(cfg(4))


def test_rehash_rekeys_rows_stored_under_an_older_identity_rule(tmp_path):
    """Rows written under an older identity rule (a post-LN residual_depth of 0 not yet resolved) are re-keyed to today's hash, with their run records; a row already stored
    under the new hash wins; a second rehash changes nothing."""
    import hashlib
    import json

    from looplm.analysis.store import canonical_json
    from looplm.config import FixedDepthConfig, ModelConfig

    cfg = Config(model=ModelConfig(rule="plain", residual="deeploop"), depth=FixedDepthConfig(depth=3))
    ident = config_identity(cfg)
    with_fields = json.loads(json.dumps(ident))
    with_fields["model"]["residual_depth"] = 0  # as the identity held it before R was resolved there
    old_hash, new_hash = hashlib.sha256(canonical_json(with_fields).encode()).hexdigest(), config_hash(cfg)
    assert old_hash != new_hash
    with ResultStore(tmp_path / "r.db") as store:
        store._conn.execute("INSERT INTO configs VALUES (?, ?)", (old_hash, canonical_json(with_fields)))
        store._conn.commit()
        make = EvalIdentity.make(cfg, "ppl", dataset="brown", split="test", depth=4, tag="t")
        stale = [EvalIdentity(**{**make.__dict__, "config_hash": old_hash, "depth": T}) for T in (4, 8)]
        for i, v in zip(stale, (10.0, 20.0)):
            store.put_many([(i, {"ppl": v})])
        store.put_many([(make, {"ppl": 11.0})])  # T=4 evaluated again since: the newer row wins
        store.put_run(RunRecord(sweep="s", run_id="a-s0", variant="a", seed=0, config=cfg.to_dict(), run_dir="x"))
        store._conn.execute("UPDATE runs SET config_hash = ?", (old_hash,))  # as recorded under the old rule
        store._conn.commit()
        assert store.rehash() == 1 and store.rehash() == 0
        got = {r["depth"]: r["value"] for r in store.evaluations(metric="ppl")}
        assert got == {4: 11.0, 8: 20.0}
        assert {r["config_hash"] for r in store.evaluations()} == {new_hash}
        assert store.runs("s")[0].config_hash == new_hash


def test_sweep_cells_group_a_sweeps_evaluations_by_variant(tmp_path):
    from looplm.analysis.claims import sweep_cells

    cfg = Config()
    with ResultStore(tmp_path / "r.db") as store:
        for seed in (0, 1):
            store.put_run(RunRecord(sweep="s", run_id=f"looped-s{seed}", variant="looped", seed=seed,
                                    config=cfg.to_dict(), run_dir="/x", variant_order=0, grid={}, params=123,
                                    flops={}, weights_sha256=None, summary={}))
            store.put_many([(_ident(depth=8, seed=seed), {"ppl": 10.0 + seed, "nll": 2.0})])
        store.put_many([(_ident(depth=8, seed=5), {"ppl": 99.0})])  # no run of the sweep: left out
    cells, params = sweep_cells(tmp_path / "r.db", "s")
    assert params == {"looped": 123}
    assert cells == {"looped": {("ppl", "brown", "ppl", 8): {0: 10.0, 1: 11.0}, ("ppl", "brown", "nll", 8): {0: 2.0, 1: 2.0}}}
    assert sweep_cells(tmp_path / "r.db", "other") == ({}, {})
    # read-only: a missing or empty database stays as it is
    assert sweep_cells(tmp_path / "none.db", "s") == ({}, {}) and not (tmp_path / "none.db").exists()
    import sqlite3

    sqlite3.connect(tmp_path / "empty.db").close()
    size = (tmp_path / "empty.db").stat().st_size
    assert sweep_cells(tmp_path / "empty.db", "s") == ({}, {}) and (tmp_path / "empty.db").stat().st_size == size
    # a summary's loader: None (and nothing written) for a sweep that has not run
    from looplm.analysis.claims import sweep_results

    assert sweep_results(tmp_path / "nowhere", "s") is None and not (tmp_path / "nowhere").exists()
    (tmp_path / "results.db").write_bytes((tmp_path / "r.db").read_bytes())
    cells2, params2, curves = sweep_results(tmp_path, "s")
    assert (cells2, params2, curves) == (cells, params, {})


def test_report_on_an_unrelated_sqlite_file_leaves_it_byte_identical(tmp_path, capsys):
    """`looplm report` opens with mode=ro and checks the schema first: no tables added, no WAL switch."""
    import sqlite3

    from looplm.analysis.store import ResultStoreError
    from looplm.cli import main

    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE notes (x TEXT)")
    con.execute("INSERT INTO notes VALUES ('mine')")
    con.commit()
    con.close()
    before = other.read_bytes()
    assert main(["report", "--db", str(other), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(other) in err and "not a looplm results database" in err
    assert other.read_bytes() == before and not any(p.name.startswith("other.sqlite-") for p in tmp_path.iterdir())
    with pytest.raises(ResultStoreError, match="no table"):
        ResultStore(other, readonly=True)
    assert other.read_bytes() == before


def test_readonly_store_reads_and_refuses_writes(tmp_path):
    import sqlite3

    with ResultStore(tmp_path / "r.db") as store:
        store.put_many([(_ident(), {"ppl": 3.0})])
    before = (tmp_path / "r.db").read_bytes()
    with ResultStore(tmp_path / "r.db", readonly=True) as store:
        assert store.get(_ident()) == {"ppl": 3.0}
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            store._conn.execute("DELETE FROM evaluations")
    assert (tmp_path / "r.db").read_bytes() == before


def test_put_stores_provenance_per_identity(tmp_path):
    prov = {"looplm_version": "0.1.0", "weights_sha256": "ab" * 32}
    with ResultStore(tmp_path / "r.db") as store:
        store.put_many([(_ident(depth=4), {"ppl": 3.0})], provenance=prov)
        store.put_many([(_ident(depth=8), {"ppl": 2.0})])
        assert store.provenance(_ident(depth=4)) == prov and store.provenance(_ident(depth=8)) is None
        store.put_many([(_ident(depth=4), {"ppl": 3.5})])  # re-evaluated without one: the old record is not kept
        assert store.provenance(_ident(depth=4)) is None


@pytest.mark.parametrize("readonly", [True, False])
def test_damage_found_by_a_later_read_is_a_store_error_naming_the_file(tmp_path, readonly):
    """The file opens (its schema and meta pages are intact); every read or write that meets a damaged page
    raises ResultStoreError naming the file, not sqlite3.DatabaseError."""
    from helpers import damaged_results_db

    from looplm.analysis.store import ResultStoreError

    db = damaged_results_db(tmp_path / "r.db")
    calls = {"runs": lambda s: s.runs(), "run": lambda s: s.run("s", "r-s0"), "evaluations": lambda s: s.evaluations(),
             "count": lambda s: s.count(), "get": lambda s: s.get(_ident()), "has": lambda s: s.has(_ident()),
             "config": lambda s: s.config(_ident().config_hash), "provenance": lambda s: s.provenance(_ident()),
             "protocol_settings": lambda s: s.protocol_settings(_ident().protocol_hash), "rehash": lambda s: s.rehash()}
    if not readonly:
        calls.update(put_many=lambda s: s.put_many([(_ident(depth=3), {"ppl": 1.0})]),
                     delete=lambda s: s.delete(depth=1))
    with ResultStore(db, readonly=readonly) as store:
        for name, call in calls.items():
            with pytest.raises(ResultStoreError, match="not a usable looplm results database") as exc:
                call(store)
            assert str(exc.value).startswith(f"{db}: "), name


def test_report_on_a_database_damaged_in_its_middle_is_a_clear_error(tmp_path, capsys):
    from helpers import damaged_results_db

    from looplm.cli import main

    db = damaged_results_db(tmp_path / "results.db")
    assert main(["report", "--db", str(db), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"looplm report: error: {db}: not a usable looplm results database (database disk "
                                "image is malformed); give the path of a results.db written by `looplm sweep`, or "
                                "move the damaged file aside"]
