"""`python bench.py data --remote`: the loader reading a data directory in an object store, against the
test suite's GCS server (gcs_emulator.py) on 127.0.0.1 with a network's latency and bandwidth put in.

    python bench.py data --remote [--latency-ms 50] [--bandwidth-mbs 200] [--shards 2000] [--seq 1024]

It prepares a directory of --shards token shards of --shard-tokens random ids each (the tokenizer and
index as data.py writes them), uploads
it to a bucket of a server started here (every read then waits --latency-ms and streams at most
--bandwidth-mbs), and measures as one process of a training job would:

  first batch     from opening the loader (index.json, the tokenizer, one listing of every shard) to the
                  first batch in hand, through the prefetching iterator train.py uses
  rows/s          batches taken as fast as the loader gives them, at 16 and at 64 rows per step
  bytes ratio     bytes the store returned for token data / bytes of the rows of the batches read (the
                  prefetched ones too): 1 when each row is read once, as its own byte range
  requests/step   byte ranges asked for per step (each one HTTP request, many in flight at once)
  local disk      bytes written under a fresh HOME, TMPDIR and cache directory while reading

Targets: first batch <= 2 s; >= 1,000 rows/s per process at 16 rows per step; bytes ratio <= 1.05;
no local disk. Needs the test requirements (gcsfs, gcp-storage-emulator).
"""
from __future__ import annotations

import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the checkout, where gcs_emulator.py is
TARGETS = {"first_batch_s_max": 2.0, "rows_per_s_min_at_16": 1000.0, "bytes_ratio_max": 1.05, "local_bytes_max": 0}
WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or "
         "has had not but one all their they new first also after who been more two when there into its "
         "time other some can than only over most such may years about these may through city would").split()


def _server(latency_ms: float, bandwidth_mbs: float) -> tuple[subprocess.Popen, str]:
    """The GCS server with the network's conditions, answering concurrently; (process, its URL)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "gcs_emulator.py"), "--threads",
                             "--latency-ms", str(latency_ms), "--bandwidth-mbs", str(bandwidth_mbs)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        raise RuntimeError("the GCS server did not start: pip install -r requirements-test.txt")
    return proc, f"http://127.0.0.1:{port}"


def _directory(work: pathlib.Path, shards_wanted: int, shard_tokens: int, prepare: Callable) -> dict:
    """work/data: a directory prepared by `prepare` (data.py's) from a small corpus (its tokenizer and index), its train
    split then replaced by `shards_wanted` shards of `shard_tokens` random ids, written as data.py writes
    them (shard_writer.ShardWriter). Returns the index."""
    import json

    import numpy as np

    from tokendata import shard_writer
    rng = random.Random(0)
    (work / "src").mkdir()
    for i in range(20):
        (work / "src" / f"doc{i:02d}.txt").write_text(" ".join(rng.choices(WORDS, k=2000)) + "\n")
    index = prepare([str(work / "src")], work / "data", vocab_size=512, val_fraction=0.0, progress=False)
    for shard in index["splits"]["train"]["shards"]:
        (work / "data" / shard["file"]).unlink()
    writer = shard_writer.ShardWriter(work / "data", "train", index["dtype"], shard_tokens, index["vocab_size"])
    ids = np.random.default_rng(0)
    for _ in range(shards_wanted):
        tokens = ids.integers(0, index["vocab_size"], shard_tokens)
        writer.write(tokens, np.asarray([shard_tokens - 1]))
    writer.close()
    index["splits"]["train"] = writer.summary()
    index["tokens"] = index["splits"]["train"]["tokens"] + index["splits"].get("val", {}).get("tokens", 0)
    (work / "data" / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc (0 where there is none)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _disk_bytes(*roots: pathlib.Path) -> int:
    return sum(p.stat().st_size for root in roots for p in root.rglob("*") if p.is_file())


def run(args, prepare: Callable) -> tuple[dict, list[tuple[str, str]], str]:
    """(results, rows to print, one-line summary)."""
    from tokendata import loader as loader_lib
    from tokendata import shards
    results: dict = {"latency_ms": args.latency_ms, "bandwidth_MB_per_s": args.bandwidth_mbs,
                     "shards": args.shards, "seq": args.seq}
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        work = pathlib.Path(tmp)
        print(f"preparing {args.shards} shards of {args.shard_tokens} tokens", file=sys.stderr, flush=True)
        index = _directory(work, args.shards, args.shard_tokens, prepare)
        results["shards_in_index"] = len(index["splits"]["train"]["shards"])
        results["shard_tokens"] = args.shard_tokens

        proc, url = _server(args.latency_ms, args.bandwidth_mbs)
        fresh = {name: work / name for name in ("home", "tmp", "cache")}
        for path in fresh.values():
            path.mkdir()
        saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
                                                "NO_GCE_CHECK", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
                                                "HOME", "TMPDIR", "XDG_CACHE_HOME")}
        try:
            os.environ.update(STORAGE_EMULATOR_HOST=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="x", NO_GCE_CHECK="true",
                              GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
            import fsspec

            fs = fsspec.filesystem("gs")
            fs.mkdir("bench")
            print(f"uploading to gs://bench/data through {url}", file=sys.stderr, flush=True)
            fs.put([str(p) for p in sorted((work / "data").iterdir())], "bench/data/")
            os.environ.update(HOME=str(fresh["home"]), TMPDIR=str(fresh["tmp"]),
                              XDG_CACHE_HOME=str(fresh["cache"]))
            tempfile.tempdir = None  # TMPDIR is read again

            counts = {"calls": 0, "ranges": 0, "bytes": 0}
            from core import storage
            reader, _ = storage.filesystem("gs://bench/data")  # the (cached) instance the loader reads through
            cat_ranges = reader.cat_ranges

            def counted(paths, starts, ends, *a, **kw):
                out = cat_ranges(paths, starts, ends, *a, **kw)
                counts["calls"] += 1
                counts["ranges"] += len(paths)
                counts["bytes"] += sum(len(b) for b in out if isinstance(b, bytes))
                return out

            reader.cat_ranges = counted
            try:
                itemsize = 2
                for rows in (16, 64):
                    for key in counts:
                        counts[key] = 0
                    start = time.perf_counter()  # opened as a new process opens it: index, tokenizer, listing
                    loader = loader_lib.TextLoader(shards.open_data("gs://bench/data"), "train", args.seq, rows, seed=1)
                    batches = loader.iterate(0)
                    next(batches)
                    first = time.perf_counter() - start
                    steps, start = args.remote_steps, time.perf_counter()
                    cpu, server_cpu = time.process_time(), _cpu_s(proc.pid)
                    for _ in range(steps):
                        next(batches)
                    elapsed = time.perf_counter() - start
                    cpu, server_cpu = time.process_time() - cpu, _cpu_s(proc.pid) - server_cpu
                    batches.close()
                    read = counts["calls"] * loader.group  # batches read by then (the prefetched ones too)
                    used = read * rows * (args.seq + 1) * itemsize  # the bytes of their rows
                    results[f"{rows}_rows"] = {
                        "first_batch_s": first, "rows_per_s": steps * rows / elapsed, "steps": steps,
                        "batches_read": read, "requests": counts["calls"], "ranges_per_step": counts["ranges"] / read,
                        "bytes_read": counts["bytes"], "bytes_ratio": counts["bytes"] / used,
                        # where the time goes: this process's CPU (the loader and the HTTP client) and the
                        # server's, per row taken, against the wall clock per row
                        "client_cpu_ms_per_row": 1e3 * cpu / (steps * rows),
                        "server_cpu_ms_per_row": 1e3 * server_cpu / (steps * rows),
                        "wall_ms_per_row": 1e3 * elapsed / (steps * rows),
                    }
            finally:
                reader.cat_ranges = cat_ranges
            results["local_bytes"] = _disk_bytes(*fresh.values())
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            tempfile.tempdir = None
            proc.kill()
            proc.wait()

    r16, r64 = results["16_rows"], results["64_rows"]
    met = {"first_batch": r16["first_batch_s"] <= TARGETS["first_batch_s_max"],
           "rows_per_s": r16["rows_per_s"] >= TARGETS["rows_per_s_min_at_16"],
           "bytes_ratio": max(r16["bytes_ratio"], r64["bytes_ratio"]) <= TARGETS["bytes_ratio_max"],
           "local_bytes": results["local_bytes"] <= TARGETS["local_bytes_max"]}
    results["targets"] = {**TARGETS, "met": met}
    verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    rows = [("store", f"GCS server on 127.0.0.1, {args.latency_ms:g} ms a read, {args.bandwidth_mbs:g} MB/s a read; "
                      f"{results['shards_in_index']} shards of {args.shard_tokens} tokens in the index, T={args.seq}")]
    for key, r in (("16", r16), ("64", r64)):
        rows.append((f"{key} rows/step: first batch (target <= 2 s)",
                     f"{r['first_batch_s']:.2f} s ({verdict(r['first_batch_s'] <= 2.0)})"))
        rows.append((f"{key} rows/step: rows/s, one process" + (" (target >= 1000)" if key == "16" else ""),
                     f"{r['rows_per_s']:.0f} over {r['steps']} steps"))
        rows.append((f"{key} rows/step: requests", f"{r['ranges_per_step']:.1f} byte ranges a step, "
                     f"in {r['requests']} concurrent requests; bytes read / used {r['bytes_ratio']:.3f}"))
        rows.append((f"{key} rows/step: CPU per row", f"loader + HTTP client {r['client_cpu_ms_per_row']:.2f} ms, "
                     f"test server {r['server_cpu_ms_per_row']:.2f} ms; wall {r['wall_ms_per_row']:.2f} ms"))
    rows.append(("local disk while reading (target 0)", f"{results['local_bytes']} bytes ({verdict(met['local_bytes'])})"))
    summary = (f"remote data ({args.latency_ms:g} ms, {args.bandwidth_mbs:g} MB/s, {results['shards_in_index']} shards): "
               f"first batch {r16['first_batch_s']:.2f} s; {r16['rows_per_s']:.0f} rows/s at 16 rows/step, "
               f"{r64['rows_per_s']:.0f} at 64; bytes read/used {max(r16['bytes_ratio'], r64['bytes_ratio']):.3f}; "
               f"local disk {results['local_bytes']} B; targets " +
               ", ".join(f"{k} {verdict(v)}" for k, v in met.items()))
    return results, rows, summary
