"""An OpenAI-compatible HTTP server for a trained run, with batched generation.

    python serve.py --checkpoint RUN_DIR [--host 127.0.0.1] [--port 8000] [--step N] [--base DIR]
                    [--model-name NAME] [--api-key KEY] [--slots 16] [--context T] [--max-queue 256]
                    [--max-body-bytes 4194304]

Any run serves: pretrained or fine-tuned, a LoRA run (merged at load, as sample.py does), a prompt/completion
run (a prompt is its in_text, the reply its completion, as sample.py prints it), every model family. The
endpoints (inference/openai_api.py): `GET /health`, `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions`, and the tokenizer's `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.
The official `openai` client, curl, chat front ends and lm-evaluation-harness's `local-completions` talk to
it; docs/serving.md lists every field and error.

Requests are decoded together (inference/batching.py): `--slots` completions at once on one KV cache of
`--context` positions a slot (default: the model's block_size), a new one joining between two chunks of
decode steps (about 20 ms), one that ends freeing its slot. A greedy completion is the same token for token
whatever else is being generated, and the one sample.py prints.

It binds 127.0.0.1 unless `--host` says otherwise; with `--api-key` (or the GPT_API_KEY environment variable)
every request must carry `Authorization: Bearer KEY`. Bodies past `--max-body-bytes` get 413, requests past
`--max-queue` waiting completions 429. A port in use, a directory that is not a run, a context that does not fit
the device: one `error:` line at start, status 2. SIGINT or SIGTERM stops it: completions in flight end with an
error (a stream's last event), then one line, status 130 or 143.
"""
from __future__ import annotations

import os

from core import errors  # light: nothing but the standard library

if __name__ == "__main__":
    errors.stop_at_once_while_loading()  # a Ctrl-C while JAX and the rest load: one line, no traceback

API_KEY_VARIABLE = "GPT_API_KEY"


def parse_args(argv):
    p = errors.ArgumentParser(error=errors.ServeError, description="Serve a trained run over HTTP with the OpenAI API.")
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR", help="run directory (config, checkpoints, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only; "
                                                       "0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 = any free one)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step; default the last")
    p.add_argument("--base", metavar="BASE_DIR", help="a LoRA run's base model (a run directory) where it is now, if it "
                                                      "moved since the run trained")
    p.add_argument("--model-name", help="the name requests give as `model` (default: the run directory's name)")
    p.add_argument("--api-key", help=f"require `Authorization: Bearer KEY` on every request (default: the "
                                     f"{API_KEY_VARIABLE} environment variable; none: open to whoever reaches the port)")
    p.add_argument("--slots", type=int, default=16, help="completions generated at once (default: %(default)s)")
    p.add_argument("--context", type=int, default=None, help="positions a slot holds, prompt and completion "
                                                             "(default: the model's block_size)")
    p.add_argument("--max-queue", type=int, default=256, help="completions that may wait for a slot; more get 429 "
                                                              "(default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body; larger get 413 "
                                                                       "(default: %(default)s)")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise errors.ServeError(f"--port must be between 0 and 65535, got {args.port}")
    for name in ("slots", "max_queue", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise errors.ServeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.context is not None and args.context < 2:
        raise errors.ServeError(f"--context must be >= 2, got {args.context}")
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_VARIABLE) or None
    if args.api_key is not None and not args.api_key.strip():
        raise errors.ServeError("--api-key is empty")
    return args


if __name__ == "__main__":
    errors.parse_before_loading(parse_args)  # --help and argument mistakes: at once, before JAX loads

import asyncio
import contextlib
import pathlib
import signal
import socket
import sys

from core.errors import ServeError


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use is said at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = "is in use (another server on it?): choose another with --port" if e.errno == 98 else e.strerror
        raise ServeError(f"port {port} on {host} {why}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def main(argv=None) -> int:
    args = parse_args(argv)
    sock = bind(args.host, args.port)
    import jax
    import uvicorn

    from core import chat
    from inference import batching, openai_api
    from store import rundir
    from tokendata import shards

    run = rundir.existing(args.checkpoint, args.base)
    cfg = run.record.config().model
    tokenizer = run.record.tokenizer()
    context = args.context or cfg.block_size
    if cfg.max_length is not None and context > cfg.max_length:
        raise ServeError(f"--context {context} exceeds block_size {cfg.block_size} of this learned-position model")
    check_fits(cfg, args.slots, context)
    eot_id = shards.eot_id_of(tokenizer)
    template = run.dir.read_bytes(chat.CHAT_TEMPLATE).decode() if run.dir.is_file(chat.CHAT_TEMPLATE) else None
    model, step = run.weights.load_model(args.step)
    engine = batching.Engine(model, cfg, slots=args.slots, context=context, eot_id=eot_id, max_queue=args.max_queue)
    compiled = engine.warm_up()
    name = args.model_name or pathlib.PurePath(str(args.checkpoint).rstrip("/")).name or "model"
    server = openai_api.Server(engine, tokenizer, name=name, step=step, vocab_size=cfg.vocab_size, context=context,
                               learned_positions=cfg.max_length is not None, eot_id=eot_id, chat_template=template,
                               api_key=args.api_key, max_body=args.max_body_bytes)
    app = openai_api.make_app(server)
    port = sock.getsockname()[1]
    shown = args.host if ":" not in args.host else f"[{args.host}]"
    url = f"http://{shown}:{port}"
    auth = ' -H "Authorization: Bearer $GPT_API_KEY"' if args.api_key else ""
    print(f"serving {args.checkpoint} step {step} as model {name!r} at {url}/v1 ({args.slots} slots of {context} "
          f"positions, {jax.devices()[0].platform}, compiled in {compiled:.1f} s); try:\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 20}}'", flush=True)
    engine.start()
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=GRACE_SECONDS,
                            lifespan="off")
    uv = server_class()(config, engine, server)
    asyncio.run(uv.serve(sockets=[sock]))
    if uv.signum is None:
        return 0
    signame = signal.Signals(uv.signum).name
    how = "interrupted" if uv.signum == signal.SIGINT else f"stopped by {signame}"
    ended = f"; {uv.ended} completion{'s' if uv.ended != 1 else ''} in flight ended with an error" if uv.ended else ""
    raise errors.Interrupted(f"{how}: the server at {url} stopped{ended}", uv.signum)


GRACE_SECONDS = 5  # how long a stopping server waits for its replies to go out


def check_fits(cfg, slots: int, context: int) -> None:
    """A ServeError when the slots' KV cache and the prefill of a short prompt do not fit the device beside the
    weights, naming the most slots that do (a longer prompt's prefill is checked when it comes: 413)."""
    from inference import batching, decoding

    memory, what = decoding.device_memory()
    room = memory - decoding.weight_bytes(cfg)
    need = lambda s: batching.cache_bytes(cfg, s, context) + batching.prefill_bytes(cfg, batching.MIN_BUCKET, context)  # noqa: E731
    if need(slots) <= room:
        return
    fit = decoding.largest(lambda s: need(s) <= room, slots)
    raise ServeError(f"--slots {slots} x --context {context} needs {need(slots) / 2**30:,.1f} GiB for the KV cache and "
                     f"a prompt's prefill, more than the {max(room, 0) / 2**30:,.1f} GiB of {what} beside the weights; "
                     + (f"at most --slots {fit} fits" if fit else "lower --context"))


def server_class():
    import uvicorn

    class Stoppable(uvicorn.Server):
        """uvicorn's server with this command's signals: the first SIGINT or SIGTERM ends every completion in
        flight with an error (a stream gets it as its last event), then the server shuts down; a second one
        ends it at once."""

        def __init__(self, config, engine, server):
            super().__init__(config)
            self.engine, self.server, self.signum, self.ended = engine, server, None, 0

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            previous = {s: signal.signal(s, lambda n, f: loop.call_soon_threadsafe(self.stop_by, n))
                        for s in errors.STOP_SIGNALS}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def stop_by(self, signum: int) -> None:
            if self.signum is not None:
                errors.end_now(f"error: stopped by {signal.Signals(signum).name} while stopping", 128 + signum)
            if signum == signal.SIGHUP:
                errors.detach_from_terminal()
            self.signum = signum
            name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
            self.server.stopping = f"stopped by {name}"
            self.ended = self.engine.active() + self.engine.waiting()
            self.engine.stop(f"the server is stopping ({self.server.stopping}); nothing more is generated")
            self.should_exit = True

    return Stoppable


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr and exit status 2."""
    return errors.run_cli(main, argv, at_once=True)  # while it starts: nothing to undo


if __name__ == "__main__":
    sys.exit(cli())
