"""A Google Cloud Storage server on 127.0.0.1, for the tests and for trying gs:// paths without a
cloud account: gcp-storage-emulator (in memory; `pip install -r requirements-test.txt`), with what it
lacks and the project's clients rely on. conftest.py starts it (fixture `gcs_server`), and so can you:

    python gcs_emulator.py        # serves on a free port of 127.0.0.1 with the bucket gs://local, runs until killed
    python gcs_emulator.py --bucket mine --port 4443
    python gcs_emulator.py --latency-ms 50 --bandwidth-mbs 200 --threads   # as bench.py data --remote runs it

It prints the port on its first line (what conftest.py and bench_remote.py read), then the
`export NAME=value` lines (ENVIRONMENT) that point gcsfs, tensorstore (orbax's arrays) and
google-auth at it: pasted into a shell, they make every gs:// path of the commands run there reach
this server. Its contents live in memory and end with it.

With --latency-ms and --bandwidth-mbs every read (GET) waits that long before it is answered and sends
its body no faster than that, as a store across a network would; --threads answers requests
concurrently (only for reads of objects already written: the generation checks below assume one
request at a time).

Added to the emulator as shipped, as the real service behaves:
- a download (`alt=media`) carries the object's generation in `x-goog-generation` (and
  `x-goog-metageneration`); tensorstore, which writes orbax's arrays, reads it there, and without it
  an OCDBT checkpoint fails at random ("Malformed StorageGeneration").
- `ifGenerationMatch` / `ifGenerationNotMatch` are answered: a write or delete whose condition fails
  gets 412; a read gets 412, or 304 when the object is the generation it must not be. OCDBT writes
  its manifest on that condition. Requests are handled one at a time, so a check and its write are
  one step.
- the listen backlog is 1024, not 5: tensorstore and gcsfs open many connections at once, and a
  dropped one is retried only about a second later.
- a client that stalls in the middle of a request (a paused process) is dropped after 5 s, as the
  service drops a stalled connection, instead of holding the one-at-a-time server for good; one that
  hangs up before its answer is sent is dropped without a word (no BrokenPipeError traceback), and a
  read of a missing object is a 404 without the emulator's "Resource not found" lines.
- an upload with an empty body makes a zero-byte object (the emulator fails on it).
- nothing is kept of deleted objects (the emulator keeps them "soft-deleted" by default) and no
  metadata file is rewritten on every change: a memory store needs neither, and both grow with a session.

And one thing for the tests, which the real service does when a bucket's permissions change under a job
or it is overloaded: writes refused. `POST /_emulator/refusals` with a JSON list of rules
`{"bucket": B, "prefix": P, "status": 403}` makes every write or delete of an object in B whose name
starts with P get that status (403: access denied, not retried by clients; 503: unavailable, retried
with backoff) with the service's JSON error body, until the next POST replaces the rules (`[]`: none).
`GET /_emulator/refusals` gives the rules, each with `refused`, the number of requests it has refused.
A rule sees requests by the name they write: simple, multipart and resumable uploads (the request that
starts one), copies and rewrites (their destination), deletes and metadata updates; not the parts of a
batch request.

And a request log, to count what a client asks: `GET /_emulator/requests` gives every request answered
since the server started or since the last `DELETE /_emulator/requests`, in order, as
`{"method", "bucket", "object", "media"}` (`object` the object's name or null for a listing or a
bucket; `media` true for a download of an object's bytes).
"""
from __future__ import annotations

import argparse
import functools
import http
import http.server
import logging
import sys
import time

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator import storage as emulator_storage
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import buckets as emulator_buckets

emulator_storage.DEFAULT_SOFT_DELETE_RETENTION_SECONDS = 0
emulator_storage.Storage._write_config_to_file = lambda self: None
# a read of an object that is not there is answered 404, as by the service, without two lines on the terminal
logging.getLogger(emulator_storage.__name__).addFilter(lambda record: record.funcName != "get_file")


def _generation(request, storage) -> int | None:
    """The generation of the object a request names (None when there is none)."""
    params = request.params or {}
    name = params.get("object_id") or (request.query.get("name") or [None])[0]
    try:
        return int(storage.get_file_obj(params["bucket_name"], name)["generation"])
    except (KeyError, NotFound):
        return None


def _refused(request, storage) -> http.HTTPStatus | None:
    """The status of a request whose generation precondition fails, else None."""
    match, not_match = (request.query.get(key, [None])[0] for key in ("ifGenerationMatch", "ifGenerationNotMatch"))
    if match is None and not_match is None:
        return None
    generation = _generation(request, storage)
    if match is not None and int(match) != (generation or 0):  # 0: the object must not exist
        return http.HTTPStatus.PRECONDITION_FAILED
    if not_match is not None and generation is not None and int(not_match) == generation:
        read = request.method == "GET"
        return http.HTTPStatus.NOT_MODIFIED if read else http.HTTPStatus.PRECONDITION_FAILED
    return None


NETWORK = {"latency_s": 0.0, "bytes_per_s": None}  # what --latency-ms and --bandwidth-mbs set


_RULES: list[dict] = []  # the writes refused (POST /_emulator/refusals)
_REQUESTS: list[dict] = []  # every request answered (GET /_emulator/requests), until DELETE empties it


def _written(request) -> tuple[str, str] | None:
    """(bucket, object name) of the object a request writes or deletes; None for a read (or a name it
    does not say)."""
    if request.method == "GET":
        return None
    params = request.params or {}
    if params.get("dest_object_id"):  # copyTo, rewriteTo
        return params["dest_bucket_name"], params["dest_object_id"]
    name = params.get("object_id") or (request.query.get("name") or [None])[0]
    if name is None and request.query.get("uploadType") and "upload_id" not in request.query:
        data = request.data  # the metadata of a multipart or resumable upload
        if isinstance(data, dict):
            name = (data.get("meta") if isinstance(data.get("meta"), dict) else data).get("name")
    return (params["bucket_name"], name) if name and params.get("bucket_name") else None


def _refusal(request) -> dict | None:
    """The rule that refuses this request, counted; None when none does."""
    written = _written(request) if _RULES else None
    for rule in _RULES if written else ():
        if written[0] == rule["bucket"] and written[1].startswith(rule["prefix"]):
            rule["refused"] += 1
            return rule
    return None


def _rules(request, response, storage, *args, **kwargs):
    """GET: the rules and their counts; POST: replace them."""
    if request.method == "POST":
        _RULES[:] = [{"bucket": r["bucket"], "prefix": r.get("prefix", ""), "status": int(r.get("status", 403)),
                      "refused": 0} for r in request.data or []]
    response.json(_RULES)


def _requests(request, response, storage, *args, **kwargs):
    """GET: the requests answered, in order; DELETE: forget them."""
    if request.method == "DELETE":
        _REQUESTS.clear()
    response.json(list(_REQUESTS))


def _guarded(handler):
    def handle(request, response, storage, *args, **kwargs):
        params = request.params or {}
        _REQUESTS.append({"method": request.method, "bucket": params.get("bucket_name"),
                          "object": params.get("object_id"),
                          "media": request.method == "GET" and (handler is emulator.objects.download
                                                                or request.query.get("alt") == ["media"])})
        if request.method == "GET" and NETWORK["latency_s"]:
            time.sleep(NETWORK["latency_s"])
        try:
            return _answer(handler, request, response, storage, *args, **kwargs)
        finally:
            body = getattr(response, "_content", None)  # the emulator's Response keeps the body there
            if request.method == "GET" and NETWORK["bytes_per_s"] and body:
                time.sleep(len(body) / NETWORK["bytes_per_s"])

    return handle


def _answer(handler, request, response, storage, *args, **kwargs):
    """The emulator's answer, with the generation checks and headers it lacks, and the refusals asked for."""
    refused = _refused(request, storage)
    if refused is not None:
        response.status = refused
        return None
    rule = _refusal(request)
    if rule is not None:
        request.data  # noqa: B018  (the body is read, so that the connection stays in step)
        response.status = http.HTTPStatus(rule["status"])
        permission = f"storage.objects.{'delete' if request.method == 'DELETE' else 'create'}"
        message = (f"test@example.com does not have {permission} access to the Google Cloud Storage object. "
                   f"Permission '{permission}' denied on resource (or it may not exist).")
        response.json({"error": {"code": rule["status"],
                                 "message": message if rule["status"] == 403 else response.status.phrase}})
        return None
    if request.method == "POST" and request.query.get("uploadType") == ["media"] and request.data is None:
        request._data = b""  # an empty body: a zero-byte object, which the emulator fails to make
    result = handler(request, response, storage, *args, **kwargs)
    media = request.method == "GET" and (handler is emulator.objects.download or
                                         request.query.get("alt") == ["media"])
    if media and response.status in (http.HTTPStatus.OK, http.HTTPStatus.PARTIAL_CONTENT):
        generation = _generation(request, storage)
        if generation is not None:
            response["x-goog-generation"] = str(generation)
            response["x-goog-metageneration"] = "1"
    return result


# the routing table holds the handlers themselves: each is wrapped in place
emulator.HANDLERS = ((r"^/_emulator/refusals$", {"GET": _rules, "POST": _rules}),
                     (r"^/_emulator/requests$", {"GET": _requests, "DELETE": _requests}),
                     *((pattern, {method: _guarded(handler) for method, handler in handlers.items()})
                       for pattern, handlers in emulator.HANDLERS))


class _Handler(emulator.RequestHandler):
    # A client that stalls in the middle of a request (a paused process: SIGSTOP) is dropped after this
    # many seconds, as the service drops a stalled connection; until then the one-at-a-time server waits
    timeout = 5.0


class _Quiet:
    """A client that hangs up in the middle of an answer (a killed or stopped process, a read cut short) is
    the client's business, as on the real service: no traceback on the server's terminal."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):  # BrokenPipeError, reset, ...
            super().handle_error(request, client_address)


class _Server(_Quiet, http.server.HTTPServer):
    request_queue_size = 1024


class _ThreadingServer(_Quiet, http.server.ThreadingHTTPServer):
    request_queue_size = 1024


# The settings that point each client at the server (URL: http://127.0.0.1:PORT) and skip its search for
# credentials; conftest.py's gcs_server sets the same for the suite.
ENVIRONMENT = {
    "STORAGE_EMULATOR_HOST": "{url}",  # gcsfs (fsspec's gs://) and google-cloud-storage
    "TENSORSTORE_GCS_HTTP_URL": "{url}",  # tensorstore: orbax's arrays
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",  # tensorstore: this token, no credential search
    "NO_GCE_CHECK": "true",  # google-auth: no probe of a Compute Engine metadata server
    "FSSPEC_GCS_TOKEN": "anon",  # gcsfs: no credentials, so no search for them (and no google-auth warning)
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # gcsfs: no questions to the storage control API, which this lacks
}


def exports(url: str) -> list[str]:
    """The `export NAME=value` lines of ENVIRONMENT for a server at `url`."""
    return [f"export {name}={value.format(url=url)}" for name, value in ENVIRONMENT.items()]


def parse_args(argv):
    parser = argparse.ArgumentParser(description="A Google Cloud Storage server on 127.0.0.1 (in memory), for the "
                                     "tests, bench.py data --remote and trying gs:// paths locally. Prints the port, "
                                     "then the export lines that point the clients at it.",
                                     allow_abbrev=False)  # an option only as written in full, as every command
    parser.add_argument("--bucket", default="local", help="the bucket it starts with (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port of 127.0.0.1 (default: a free one)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="wait before answering each read")
    parser.add_argument("--bandwidth-mbs", type=float, help="send each read's body at most this fast (MB/s)")
    parser.add_argument("--threads", action="store_true", help="answer requests concurrently (reads)")
    return parser.parse_args(argv)


def main(argv=None) -> int | None:
    args = parse_args(argv)
    NETWORK.update(latency_s=args.latency_ms / 1e3, bytes_per_s=args.bandwidth_mbs and args.bandwidth_mbs * 1e6)
    store = emulator_storage.Storage(use_memory_fs=True)
    if args.bucket:
        emulator_buckets.create_bucket(args.bucket, store)
    server = (_ThreadingServer if args.threads else _Server)(("127.0.0.1", args.port),
                                                              functools.partial(_Handler, store))
    port = server.server_address[1]
    print(port, flush=True)  # first, alone on its line: the port the system chose (conftest.py reads it)
    print("\n".join(exports(f"http://127.0.0.1:{port}")), flush=True)
    if args.bucket:
        print(f"# gs://{args.bucket} is ready: paste the export lines above into the shell that runs the commands; "
              f"this server keeps everything in memory until it is stopped (Ctrl-C)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
