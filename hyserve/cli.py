"""Command line: ``hyserve generate`` (offline generation), ``hyserve serve`` (the OpenAI-compatible server) and
``hyserve demo`` (a self-contained first run)."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import socket
import sys
import time

from hyserve.engine_args import EngineArgumentParser, engine_args, make_llm
from hyserve.sampling_params import SamplingParams


def port_number(value: str) -> int:
    """argparse type of a TCP port: an int in [0, 65535] (0 = any free port)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {value!r}: expected an integer in 0..65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: must be in 0..65535")
    return port


def bind_port(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` now and return the socket, which the server later listens on. Bound before the model
    loads, so a port in use fails in a second, not after the load; and held from then on, so nothing started
    during the load (worker processes, a distributed store, their ephemeral ports) can take it. Not listening
    yet: until the engine is up, a client is refused at once rather than left waiting. Raises ``ValueError``
    naming the address when it cannot be bound. Created as a TCP socket (``IPPROTO_TCP``, not protocol 0), so
    that asyncio turns Nagle's algorithm off (TCP_NODELAY) on every connection it accepts; without it a kept-alive
    connection waits about 40 ms per response for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # As uvicorn binds: SO_REUSEADDR, so a port left in TIME_WAIT by a previous run counts as free.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"cannot listen on {host}:{port}: the address is already in use (another server "
                             "running?); pick another --port or stop it") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    p.add_argument("--min-p", type=float, default=0.0, help="(default: 0)")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request seed (default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sample_seed, ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = make_llm(args, args.model)
    prompts = args.prompt or ["Hello"]
    t0 = time.perf_counter()
    if args.chat:
        outs = [llm.chat([{"role": "user", "content": p}], _params(args), use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, _params(args))
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        print(json.dumps({"prompt": o.prompt, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
                          "finish_reason": o.outputs[0].finish_reason}, ensure_ascii=False))
    print(f"# {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Serve the packaged default model on a free loopback port, ask it over HTTP, print the answers, stop."""
    import threading

    import httpx
    import uvicorn

    from hyserve.llm import default_model_dir
    from hyserve.server import AsyncEngine, build_app

    model = args.model or default_model_dir()
    engine = make_llm(args, model).llm_engine
    app = build_app(AsyncEngine(engine, start=False), None)
    sock = bind_port("127.0.0.1", 0)  # held until the server listens on it
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=120) as client:
            for _ in range(600):
                if server.started:
                    break
                time.sleep(0.05)
            name = client.get("/v1/models").json()["data"][0]["id"]
            print(f"# serving {model} as {name!r} at {base} (OpenAI API; `hyserve serve` runs it until stopped)")
            prompts = args.prompt or ["def fibonacci(n):\n", "import os\n\n\ndef main():\n"]
            for prompt in prompts:
                body = {"model": name, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0}
                r = client.post("/v1/completions", json=body).json()
                print(f"\n$ POST /v1/completions prompt={prompt!r}\n{prompt}{r['choices'][0]['text']}")
            chat = {"model": name, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "messages": [{"role": "user", "content": "Write a Python class."}]}
            r = client.post("/v1/chat/completions", json=chat).json()
            print(f"\n$ POST /v1/chat/completions\n{r['choices'][0]['message']['content']}")
            usage = r["usage"]
            print(f"\n# chat usage: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens")
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve MODEL_DIR over the OpenAI-compatible HTTP API until interrupted."""
    sock = bind_port(args.host, args.port)
    try:
        return _serve(args, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    if args.model is None:
        from hyserve.llm import default_model_dir

        try:
            args.model = default_model_dir()  # the small model that ships inside the package
        except ValueError as e:
            raise ValueError(f"serve: no MODEL_DIR argument and {e}") from None
    import os

    from hyserve.server import AsyncEngine, build_app
    from hyserve.server.serving import make_server, raise_open_files_limit

    raise_open_files_limit()  # every connection takes a file descriptor
    api_key = args.api_key or os.environ.get("HYSERVE_API_KEY") or None
    from hyserve.server.tools import check_parser_flags
    check_parser_flags(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)  # before loading
    engine = make_llm(args, args.model).llm_engine
    async_engine = AsyncEngine(engine, start=False)
    app = build_app(async_engine, args.served_model_name, api_key=api_key,
                    max_request_body_bytes=args.max_request_body_bytes,
                    body_read_timeout_s=args.request_read_timeout,
                    trust_request_chat_template=args.trust_request_chat_template,
                    chat_template_timeout_s=args.chat_template_timeout,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser)
    server = make_server(app, async_engine, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                         shutdown_timeout_s=args.shutdown_timeout, request_read_timeout_s=args.request_read_timeout,
                         timeout_keep_alive_s=args.timeout_keep_alive,
                         limit_concurrency=args.limit_concurrency or None,
                         limit_connections=args.limit_connections or None)
    logging.getLogger("hyserve.server").info(
        "API key: %s", "required on /v1/* (/health, /version and /metrics stay open)" if api_key else
        "none (--api-key or HYSERVE_API_KEY sets one)")
    # A failed engine loop (a dead worker, a bug) has failed every open request by the time this runs: stop
    # serving and exit non-zero, so that whatever supervises the server restarts it (/health says 503 meanwhile).
    def on_engine_failure(error: BaseException) -> None:
        server.should_exit = True

    async_engine.add_dead_callback(on_engine_failure)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # workers in other processes or on other ranks stop with the server
    if async_engine.dead_error is not None:
        logging.getLogger("hyserve.server").error("exiting with status 1: the engine failed: %r",
                                                  async_engine.dead_error)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = EngineArgumentParser(prog="hyserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate offline from a local checkpoint directory")
    g.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                   help="a local checkpoint directory (config.json, *.safetensors, tokenizer.json; nothing is "
                        "downloaded); default: the packaged model")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="serve a checkpoint over the OpenAI-compatible HTTP API (/v1/completions, ...)")
    s.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                   help="a local checkpoint directory (config.json, *.safetensors, tokenizer.json; nothing is "
                        "downloaded) (default: the packaged default model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=port_number, default=8000, help="port to listen on (default: 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients pass and /v1/models lists (default: MODEL_DIR's basename)")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: info)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1/* route; /health, /version and /metrics "
                        "stay open (default: $HYSERVE_API_KEY if set, else no key)")
    s.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, seconds running requests get to finish before they are aborted (open "
                        "streams then end with finish_reason 'abort' and [DONE]) (default: 5)")
    s.add_argument("--max-request-body-bytes", type=int, default=32 * 2**20,
                   help="largest request body accepted; larger ones get a 413 (default: 33554432 = 32 MiB)")
    s.add_argument("--request-read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's headers, and then its body, must arrive within this time, else the "
                        "connection is closed (headers) or a 408 answered (body) (default: 30)")
    s.add_argument("--timeout-keep-alive", type=int, default=5, metavar="SECONDS",
                   help="close an idle keep-alive connection after this time (default: 5)")
    s.add_argument("--limit-concurrency", type=int, default=1024,
                   help="most requests in flight at once; beyond it requests get a 503 (idle connections do not "
                        "count, /health is always answered); 0 = no limit (default: 1024)")
    s.add_argument("--limit-connections", type=int, default=4096,
                   help="most open connections; a new one beyond it closes the connection idle longest (only "
                        "when every connection has a request in flight is the new one refused); keep it above "
                        "--limit-concurrency; lowered to fit the open-files limit; 0 = no limit (default: 4096)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template sent in a request (by default such requests get a 400)")
    s.add_argument("--chat-template-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="stop rendering a chat template after this time and answer 400 (default: 10)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse the tool calls of answers to requests with tools (tool_choice 'auto'; needs "
                        "--tool-call-parser)")
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls: hermes, qwen3_coder or qwen3_xml (docs/server.md)")
    s.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split <think>...</think> into reasoning_content: qwen3 (docs/server.md)")
    engine_args(s, serving=True)
    s.set_defaults(func=cmd_serve)
    d = sub.add_parser("demo", help="serve the packaged default model on loopback and show it answering")
    d.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the packaged model)")
    d.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    engine_args(d)
    _sampling_args(d)
    d.set_defaults(func=cmd_demo)
    from hyserve.tools import add_missing_defaults, bench, soak

    bench.register(sub)
    soak.register(sub)
    for sp in (g, s, d):  # bench and soak add theirs at registration
        add_missing_defaults(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"hyserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
